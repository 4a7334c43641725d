"""The caller's side of tokenization: prompts, chat templates and token texts, off the event loop.

It works on a TextTokenizer (tokenizers + jinja2): the API process never imports transformers, nor the torch
that transformers brings. A transformers tokenizer given instead is described once and read the same way.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import json
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import jinja2

from pagedserve.engine.text.chat_tokens import Message, MessageTextGuard
from pagedserve.engine.text.system_prompt import system_folded_into_first_user
from pagedserve.engine.text.text_tokenizer import TextTokenizer, TokenizerSpec, json_safe
from pagedserve.engine.text.tool_template import Tool, messages_and_tools_for_template

T = TypeVar("T")
TemplateKwargs = dict[str, Any]  # a chat template's own switches: {"enable_thinking": False}
# apply_chat_template's parameters and the names it gives the template itself: never a client's to set.
RESERVED_TEMPLATE_NAMES = frozenset(
    {
        *("conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt"),
        *("continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors"),
        *("return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "raise_exception", "strftime_now"),
    }
)
INLINE_MAX_CHARS = 4096
TOKEN_TEXT_CACHE = 1 << 16  # token texts kept: the same few thousand tokens come back all the time
MESSAGE_WEIGHT_CHARS = 64  # a message's cost to render, counted as this many characters of text
WRAPPING_PROBE = "hello"


def apply_chat_template(
    tokenizer: Any,
    messages: list[Message],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[Tool] | None = None,
    template_kwargs: TemplateKwargs | None = None,
) -> str:
    """The prompt for `messages`; with continue_final_message, the last message is left open to be continued.

    `tools` (OpenAI tool definitions) go to templates that render tools; other templates get them, and any tool
    calls and results in the history, as text in the messages (tool_template). `template_kwargs` are the
    template's own switches (`enable_thinking`, ...), checked by `check_template_kwargs`. `tokenizer` is a
    TextTokenizer or transformers' own: they render alike (tests/test_text_tokenizer.py).
    """
    if not tokenizer.chat_template:
        raise ValueError("this model's tokenizer has no chat template; use the completions API instead")
    chat_template = tokenizer.get_chat_template(tools=tools or None)  # a model may keep a template for tool use
    template_messages, template_tools = messages_and_tools_for_template(chat_template, messages, tools)
    kwargs = check_template_kwargs(tokenizer, template_kwargs or {})
    render = functools.partial(_render, tokenizer, tools=template_tools, template_kwargs=kwargs)
    try:
        text = render(template_messages, add_generation_prompt, continue_final_message)
    except jinja2.TemplateError as exc:  # the template's own raise_exception: a role it does not know, ...
        refused = ValueError(f"this model's chat template refused the messages: {exc}")
        folded = system_folded_into_first_user(template_messages)  # a template with no system role (Gemma 2)
        if folded is None:
            raise refused from None
        try:
            text = render(folded, add_generation_prompt, continue_final_message)
        except jinja2.TemplateError:
            raise refused from None
    assert isinstance(text, str)
    return text


def _render(
    tokenizer: Any,
    messages: list[Message],
    add_generation_prompt: bool,
    continue_final_message: bool,
    tools: list[Tool] | None,
    template_kwargs: TemplateKwargs,
) -> Any:
    return tokenizer.apply_chat_template(
        messages,
        tools=tools,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        **template_kwargs,
    )


def check_template_kwargs(tokenizer: Any, kwargs: TemplateKwargs) -> TemplateKwargs:
    """`kwargs` as they may reach a chat template, or ValueError: a name that is one of apply_chat_template's own
    parameters (the request has a field for each) or one of the tokenizer's special tokens (the template's
    `bos_token` is the tokenizer's, not a client's) is refused. Names the template never reads change nothing."""
    reserved = RESERVED_TEMPLATE_NAMES | set(tokenizer.special_tokens_map)
    taken = sorted(name for name in kwargs if name in reserved or not name.isidentifier())
    if taken:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(map(repr, taken))}: it is not a template switch")
    return kwargs


class PromptTokenizer:
    """Tokenization on the caller's side of the engine, with a small pool to run it off an event loop.

    The tokenizers library releases the GIL while it encodes, so a 1 MB prompt on a pool thread leaves the
    event loop free to answer other requests meanwhile. Short texts encode in place: that takes well under a
    millisecond, less than the hop to a pool thread and back (which waits for the GIL on a busy process).

    The server uses the tokenizer through this class only (decode, token_text, chat_template), never through
    the TextTokenizer in `tokenizer`.
    """

    def __init__(
        self, tokenizer: TextTokenizer | Any, max_workers: int = 2, trust_message_special_tokens: bool = False
    ) -> None:
        if not isinstance(tokenizer, TextTokenizer):  # transformers' (tests, benchmarks): read as the API reads it
            tokenizer = TextTokenizer(TokenizerSpec.of(tokenizer))
        self.tokenizer = tokenizer
        self._guard = None if trust_message_special_tokens else MessageTextGuard(tokenizer)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers, thread_name_prefix="pagedserve-tokenizer")
        self._token_texts = functools.lru_cache(maxsize=TOKEN_TEXT_CACHE)(self._one_token_text)

    @classmethod
    def from_spec(cls, spec: TokenizerSpec, trust_message_special_tokens: bool = False) -> PromptTokenizer:
        """The tokenizer the engine core described (EngineInfo.tokenizer)."""
        return cls(TextTokenizer(spec), trust_message_special_tokens=trust_message_special_tokens)

    @property
    def chat_template(self) -> str | None:
        """The model's chat template (its default one, where it names several; None: it has none)."""
        templates = self.tokenizer.chat_template
        return templates.get("default") if isinstance(templates, dict) else templates

    def decode(self, token_ids: Sequence[int]) -> str:
        """The text of `token_ids`, special tokens included."""
        text = self.tokenizer.decode(list(token_ids))
        assert isinstance(text, str)  # a list comes back only for batched input
        return text

    def token_text(self, token_id: int) -> str:
        """One token's text, as decode gives it (cached)."""
        return self._token_texts(token_id)

    def token_strings(self, token_ids: Sequence[int]) -> list[str]:
        """The tokens' own strings in the vocabulary (byte-level pieces like 'Ġworld'), not their text."""
        strings: list[Any] = self.tokenizer.convert_ids_to_tokens(list(token_ids))  # None: an id past the vocabulary
        return strings

    def info(self) -> dict[str, Any]:
        """The tokenizer's class and configuration as JSON (vLLM's /tokenizer_info); local file paths left out."""
        config = {k: v for k, v in self.tokenizer.init_kwargs.items() if not k.endswith(("_file", "name_or_path"))}
        added = {str(index): vars_of(token) for index, token in self.tokenizer.added_tokens_decoder.items()}
        info = {"tokenizer_class": self.tokenizer.spec.class_name, **config, "added_tokens_decoder": added}
        info["chat_template"] = self.tokenizer.chat_template
        info["model_max_length"] = self.tokenizer.model_max_length
        return json_safe(info)

    def _one_token_text(self, token_id: int) -> str:
        return self.decode([token_id])

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        with _invalid_text_as_value_error(text):
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def render_chat(
        self,
        messages: list[Message],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[Tool] | None = None,
        template_kwargs: TemplateKwargs | None = None,
    ) -> str:
        """The prompt's text, as encode_chat renders it (llama.cpp's /apply-template)."""
        return apply_chat_template(
            self.tokenizer, messages, add_generation_prompt, continue_final_message, tools, template_kwargs
        )

    def encode_chat(
        self,
        messages: list[Message],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[Tool] | None = None,
        template_kwargs: TemplateKwargs | None = None,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """The chat template applied, then tokenized; special tokens typed in messages (or in the strings of
        `template_kwargs`) stay text (chat_tokens). The template places the special tokens; `add_special_tokens`
        adds the tokenizer's own around them too, as `encode(prompt, add_special_tokens=True)` does."""

        def render(messages: list[Message], template_kwargs: TemplateKwargs) -> str:
            return apply_chat_template(
                self.tokenizer, messages, add_generation_prompt, continue_final_message, tools, template_kwargs
            )

        kwargs = template_kwargs or {}
        text = render(messages, kwargs)
        with _invalid_text_as_value_error(text):
            if self._guard is not None and self._guard.is_needed(messages, kwargs):
                ids = self._guard.encode(messages, kwargs, text, render)
            else:
                ids = self.tokenizer.encode(text, add_special_tokens=False)
        if add_special_tokens:
            prefix, suffix = self._special_wrapping
            ids = [*prefix, *ids, *suffix]
        return ids

    @functools.cached_property
    def _special_wrapping(self) -> tuple[list[int], list[int]]:
        """The ids the tokenizer puts before and after a text's own when asked for its special tokens (a BOS,
        usually): found around a one-word text, as they do not depend on the text."""
        plain = self.tokenizer.encode(WRAPPING_PROBE, add_special_tokens=False)
        wrapped = self.tokenizer.encode(WRAPPING_PROBE, add_special_tokens=True)
        for start in range(len(wrapped) - len(plain) + 1):
            if wrapped[start : start + len(plain)] == plain:
                return wrapped[:start], wrapped[start + len(plain) :]
        return [], []

    async def encode_async(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self._off_loop(len(text), self.encode, text, add_special_tokens)

    async def encode_chat_async(
        self,
        messages: list[Message],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[Tool] | None = None,
        template_kwargs: TemplateKwargs | None = None,
        add_special_tokens: bool = False,
    ) -> list[int]:
        size = sum(len(str(message.get("content") or "")) + MESSAGE_WEIGHT_CHARS for message in messages)
        size += len(json.dumps(tools)) if tools else 0  # tool definitions are prompt text too, often kilobytes
        size += len(json.dumps(template_kwargs)) if template_kwargs else 0
        return await self._off_loop(
            size,
            self.encode_chat,
            messages,
            add_generation_prompt,
            continue_final_message,
            tools,
            template_kwargs,
            add_special_tokens,
        )

    async def _off_loop(self, num_chars: int, function: Callable[..., T], *args: Any) -> T:
        if num_chars <= INLINE_MAX_CHARS:
            return function(*args)
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(function, *args))


def vars_of(token: Any) -> dict[str, Any]:
    """An added token's fields (content, special, lstrip, ...)."""
    state = token.__getstate__()
    return dict(state) if isinstance(state, dict) else {"content": str(token)}


@contextlib.contextmanager
def _invalid_text_as_value_error(text: str) -> Iterator[None]:
    """tokenizers refuses text that is not valid Unicode (a lone surrogate) with an obscure TypeError."""
    try:
        yield
    except TypeError:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"the prompt is not valid Unicode text: {exc.reason} at character {exc.start}") from None
        raise
