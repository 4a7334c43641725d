"""Tool definitions and agent-loop history in the prompt, for any chat template.

Messages follow Hugging Face's chat-template convention: an assistant message may carry `tool_calls`
(`{"id", "type": "function", "function": {"name", "arguments"}}`, its content then possibly None), and a tool's
result is a `{"role": "tool", "tool_call_id", "content"}` message.

A template that reads the `tools` variable (Qwen2.5, Llama 3.1, Hermes, Mistral, ...) renders all of this itself:
it gets the tools and the messages as they are, with tool-call arguments as dicts, which is what those templates
expect. A template that knows only roles and content (plain ChatML, like SmolLM2's) gets the default tool template
instead, applied to the messages, so it works with any template. It is the Hermes format that Qwen2.5 uses, which
the Hermes tool-call parser reads back. The history is rewritten even when a request gives no tools, since an
agent's follow-up turn may leave them out.

The default tool template:

1. The tool definitions end the system message, after a blank line (a system message of their own when there is
none), one tool's JSON a line:

# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{"type": "function", "function": {"name": "get_weather", "parameters": {...}}}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call>

2. An assistant message's tool calls become its text: its content (if any), then one block per call, each on a
line of its own: `<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>`.

3. Tool results become a user message, `<tool_response>\n{content}\n</tool_response>`, consecutive results merged
into one user message (one block a line), as Qwen2.5's template does.
"""

from __future__ import annotations

import functools
import itertools
import json
from collections.abc import Iterable
from typing import Any

import jinja2

from pagedserve.engine.text.chat_tokens import Message

Tool = dict[str, Any]  # an OpenAI tool: {"type": "function", "function": {"name", "description", "parameters"}}

TOOLS_HEADER = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>"""

TOOLS_FOOTER = """</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call>"""

_LEXER = jinja2.Environment()  # only tokenizes templates, never renders them


def messages_and_tools_for_template(
    chat_template: str, messages: list[Message], tools: list[Tool] | None
) -> tuple[list[Message], list[Tool] | None]:
    """What to hand `chat_template`: the tools for it to render, or messages that already hold them as text."""
    if not tools and not has_tool_history(messages):
        return messages, None  # the usual chat: nothing to change
    if template_supports_tools(chat_template):
        return messages_with_parsed_tool_arguments(messages), tools or None
    return messages_with_default_tool_template(messages, tools), None


@functools.lru_cache(maxsize=8)  # a server renders with one template; lexing it for every request is wasted work
def template_supports_tools(chat_template: str) -> bool:
    """True when the template's code reads a variable named `tools`, so it renders tool definitions itself.

    Lexing rather than searching the text: the word "tools" in the template's literal text is no tool support,
    and the lexer, unlike the parser, accepts tags only transformers defines (`{% generation %}`).
    """
    return any(kind == "name" and value == "tools" for _, kind, value in _LEXER.lex(chat_template))


def has_tool_history(messages: list[Message]) -> bool:
    """True when some message is a tool call or a tool's result."""
    return any(message.get("role") == "tool" or message.get("tool_calls") for message in messages)


def messages_with_parsed_tool_arguments(messages: list[Message]) -> list[Message]:
    """The messages with every tool call's arguments as a dict: OpenAI sends a JSON string, templates want a dict."""
    return [_with_parsed_arguments(message) if message.get("tool_calls") else message for message in messages]


def messages_with_default_tool_template(messages: list[Message], tools: list[Tool] | None) -> list[Message]:
    """The conversation with tools, tool calls and tool results written as text (see the module docstring)."""
    rewritten: list[Message] = []
    for is_tool_result, group in itertools.groupby(messages, key=lambda message: message.get("role") == "tool"):
        if is_tool_result:
            rewritten.append(_tool_results_as_user_message(group))
        else:
            rewritten.extend(_tool_calls_as_text(message) for message in group)
    return _with_tool_definitions(rewritten, tools) if tools else rewritten


def default_tool_definitions(tools: list[Tool]) -> str:
    """The tools and the call format, for the system message; one tool's JSON a line, as Qwen2.5 writes them."""
    return "\n".join([TOOLS_HEADER, *(_json(tool) for tool in tools), TOOLS_FOOTER])


def tool_call_arguments(tool_call: dict[str, Any]) -> dict[str, Any]:
    """A tool call's arguments as a dict, whether given as one or as a JSON string; ValueError when invalid."""
    name = _function_name(tool_call)
    arguments = tool_call["function"].get("arguments")
    if isinstance(arguments, dict):
        return arguments
    if arguments is None or (isinstance(arguments, str) and not arguments.strip()):
        return {}  # some clients send "" (or nothing) for a function that takes no arguments
    if not isinstance(arguments, str):
        raise ValueError(f"the arguments of tool call {name!r} must be a JSON object or a string holding one")
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError as exc:
        problem = f"{exc.msg} at character {exc.pos}"
        raise ValueError(f"the arguments of tool call {name!r} are not valid JSON: {problem}") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"the arguments of tool call {name!r} must be a JSON object, not {type(parsed).__name__}")
    return parsed


def _function_name(tool_call: Any) -> str:
    function = tool_call.get("function") if isinstance(tool_call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ValueError('each tool call needs a "function" with a "name"')
    return function["name"]


def _with_parsed_arguments(message: Message) -> Message:
    return {**message, "tool_calls": [_with_parsed_call_arguments(call) for call in message["tool_calls"]]}


def _with_parsed_call_arguments(tool_call: dict[str, Any]) -> dict[str, Any]:
    arguments = tool_call_arguments(tool_call)  # first: it checks that the call has a function
    return {**tool_call, "function": {**tool_call["function"], "arguments": arguments}}


def _tool_calls_as_text(message: Message) -> Message:
    """An assistant message with tool calls as one with only text: the form the model is asked to answer in."""
    if not message.get("tool_calls"):
        return message
    content = _text(message.get("content"))
    blocks = [_tool_call_block(call) for call in message["tool_calls"]]
    without_calls = {key: value for key, value in message.items() if key != "tool_calls"}
    return {**without_calls, "content": "\n".join([content, *blocks] if content else blocks)}


def _tool_call_block(tool_call: dict[str, Any]) -> str:
    call = {"name": _function_name(tool_call), "arguments": tool_call_arguments(tool_call)}
    return f"<tool_call>\n{_json(call)}\n</tool_call>"


def _tool_results_as_user_message(tool_messages: Iterable[Message]) -> Message:
    """Consecutive tool results as one user turn: templates without a tool role accept user turns."""
    blocks = [f"<tool_response>\n{_text(message.get('content'))}\n</tool_response>" for message in tool_messages]
    return {"role": "user", "content": "\n".join(blocks)}


def _with_tool_definitions(messages: list[Message], tools: list[Tool]) -> list[Message]:
    definitions = default_tool_definitions(tools)
    if messages and messages[0].get("role") == "system":
        system = messages[0]
        instructions = _text(system.get("content"))
        content = f"{instructions}\n\n{definitions}" if instructions else definitions
        return [{**system, "content": content}, *messages[1:]]
    return [{"role": "system", "content": definitions}, *messages]


def _text(content: Any) -> str:
    """A message's content as text: a string, None, or a list of content parts (their text parts joined)."""
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(part["text"] for part in content if isinstance(part, dict) and isinstance(part.get("text"), str))
    return str(content)


def _json(value: Any) -> str:
    # ensure_ascii=False as transformers' `tojson`: text stays readable (and short in tokens) for the model
    return json.dumps(value, ensure_ascii=False)
