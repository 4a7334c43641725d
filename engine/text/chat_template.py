"""Chat templates rendered with jinja2 alone, as transformers renders them (its `apply_chat_template` with
`tokenize=False`): the same sandboxed environment, filters and globals, the same message clean-up and the same
`continue_final_message`. The API process renders prompts without importing transformers (or torch, which it
brings); tests/test_text_tokenizer.py holds the two renderings equal.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

ChatTemplates = str | dict[str, str]  # one template, or named ones ("default", "tool_use", ...)
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # the first is the one templates read
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def select_template(templates: ChatTemplates | None, tools: list[dict[str, Any]] | None) -> str:
    """The template to render: a model may keep a template for tool use beside its default."""
    if isinstance(templates, dict):
        if tools is not None and "tool_use" in templates:
            return templates["tool_use"]
        if "default" in templates:
            return templates["default"]
        raise ValueError(f"this model has several chat templates and no default: {sorted(templates)}")
    if templates is None:
        raise ValueError("this model's tokenizer has no chat template")
    return templates


def render_chat(
    template: str,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    continue_final_message: bool = False,
    **variables: Any,
) -> str:
    """`messages` through `template`; `variables` are the template's other names (special tokens, switches).
    With continue_final_message the prompt ends inside the last message, to be continued."""
    if not messages:
        raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt are not compatible")
    chat = _aliased_reasoning([{k: v for k, v in m.items() if v is not None} for m in copy.deepcopy(messages)])
    final = _tag_final_message(template, chat) if continue_final_message else None
    rendered = compiled(template).render(
        messages=chat, tools=tools, documents=None, add_generation_prompt=add_generation_prompt, **variables
    )
    return rendered if final is None else _cut_at_tag(rendered, final)


def _aliased_reasoning(chat: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A message's reasoning under every name templates read it by (gpt-oss templates read `thinking`)."""
    aliased = []
    for message in chat:
        reasoning = next((message[key] for key in REASONING_FIELDS if message.get(key) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        aliased.append(message)
    return aliased


def _tag_final_message(template: str, chat: list[dict[str, Any]]) -> str:
    """Marks where the last message's content ends; returns that content (its last text part's text)."""
    final = chat[-1].get("content")
    if final is None:
        raise ValueError('continue_final_message is set but the final message has no "content" to continue!')
    if "content" not in template:
        raise ValueError("continue_final_message is set but the chat template never reads a message's content")
    if isinstance(final, (list, tuple)):
        for part in reversed(final):
            if "text" in part:
                text: str = part["text"]
                part["text"] = text + CONTINUE_TAG
                return text
        raise ValueError("continue_final_message is set but the final message has no text to continue")
    chat[-1]["content"] = final + CONTINUE_TAG
    return str(final)


def _cut_at_tag(rendered: str, final: str) -> str:
    if final.strip() not in rendered or CONTINUE_TAG.strip() not in rendered:
        raise ValueError(
            "continue_final_message is set but the final message does not appear in the chat after applying the "
            "chat template: the template changes the final message"
        )
    at = rendered.rindex(CONTINUE_TAG.strip())
    if rendered[at : at + len(CONTINUE_TAG)] == CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()  # the template trimmed the message's trailing space


class _GenerationBlocks(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (templates that mark the assistant's tokens): the body as is."""

    tags = {"generation"}  # noqa: RUF012  (jinja's own declaration)

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja's namespace() without underscore names: nothing of CPython's internals is reachable through it."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attributes = dict(*args, **kwargs)
        for name in attributes:
            _check_name(name)
        jinja2.utils.Namespace.__init__(self, attributes)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _check_name(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"chat templates cannot store underscore-prefixed attributes: {name!r}")


class _TemplateDict:
    """dict() and dict.fromkeys() for templates, without the type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    """jinja's own tojson escapes HTML characters, which no prompt wants."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@functools.lru_cache(maxsize=16)
def compiled(template: str) -> jinja2.Template:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlocks, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    globals_: Mapping[str, Any] = {
        "raise_exception": _raise_exception,
        "strftime_now": _strftime_now,
        "dict": _TemplateDict(),
        "namespace": _TemplateNamespace,
    }
    environment.globals.update(globals_)
    return environment.from_string(template)
