"""Tool calling for chat completions: what `tools` and `tool_choice` ask of the engine, and the calls read back.

- `none`: tools are shown to the model (the chat template renders them) and the reply is plain content.
- `auto`: the model chooses; its calls are read back by the parser for its format (server/tool_parsers/). Only
  calls to the request's tools count: a call to any other name stays content, like a malformed one.
- `required`: a grammar forces a JSON array of one call or more (one when parallel_tool_calls is false), each
  `{"name": <a tool's name>, "parameters": <arguments matching its schema>}`, as vLLM does.
- a named function: a grammar forces the arguments of that function, which are the whole reply.
Forced calls always parse and match their schema, unless max_tokens cuts them short: then the reply has no
tool_calls, its text is the content and finish_reason is "length" (vLLM's answer), streamed or not. Parameter
schemas are checked like response formats (server/schema_checks.py): their depth, and $ref loops no finite value
gets through.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict
from pydantic_core import PydanticCustomError

from pagedserve.engine import StructuredOutput
from pagedserve.server.errors import FieldError
from pagedserve.server.schema_checks import check_schema
from pagedserve.server.tool_parsers import PARSERS
from pagedserve.server.tool_parsers.base import (
    ContentDelta,
    ParsedReply,
    ParsedToolCall,
    StreamEvent,
    ToolArgumentsDelta,
    ToolCallStart,
    ToolCallStream,
    ToolParser,
)

MAX_TOOLS = 128
FUNCTION_NAME = re.compile(r"^[a-zA-Z0-9_.\-]{1,64}$")
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
ToolMode = Literal["none", "auto", "required", "named"]
CHAT_PARAMETERS = "tools.{index}.function.parameters"  # where a tool's parameters are, for errors that name them


def _valid_name(name: str) -> str:
    if not FUNCTION_NAME.match(name):
        message = "function names are 1 to 64 letters, digits, '_', '.' or '-', got {name}"
        raise PydanticCustomError("invalid_value", message, {"name": name})
    return name


def _valid_parameters(parameters: dict[str, Any] | None) -> dict[str, Any] | None:
    if parameters is not None:
        check_schema(parameters)
    return parameters


FunctionName = Annotated[str, AfterValidator(_valid_name)]
Parameters = Annotated[dict[str, Any] | None, AfterValidator(_valid_parameters)]


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: FunctionName
    description: str | None = None
    parameters: Parameters = None
    strict: bool | None = None  # forced calls always match their schema


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: FunctionDefinition

    def for_template(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


@dataclass
class ToolPlan:
    """How one request's tools shape its generation and its reply."""

    mode: ToolMode
    constraint: StructuredOutput | None = None
    parser: ToolParser | None = None  # reads calls back (auto, required)
    function_name: str | None = None  # the named function
    param: str | None = None  # the field the constraint comes from, for its compile errors

    @property
    def calls_tools(self) -> bool:
        return self.mode != "none"

    @property
    def forces_calls(self) -> bool:
        return self.mode in ("required", "named")


def plan_tools(
    tools: list[ToolDefinition] | None,
    choice: ToolChoice | None,
    parallel: bool,
    parser_name: str,
    parameters_param: str = CHAT_PARAMETERS,
) -> ToolPlan:
    """FieldError when the choice names no given tool. `parameters_param` is where the endpoint's requests put
    a tool's parameters (formatted with its index)."""
    if not tools:
        if choice not in (None, "none", "auto"):  # auto is the Responses API's default, tools or not
            raise FieldError(f"tool_choice {_described(choice)} needs tools; the request gives none", "tool_choice")
        return ToolPlan("none")
    choice = "auto" if choice is None else choice
    if choice == "none":
        return ToolPlan("none")
    if choice == "auto":
        return ToolPlan("auto", parser=PARSERS[parser_name](tool.function.name for tool in tools))
    if choice == "required":
        constraint = StructuredOutput.json_schema(_calls_schema(tools, parallel))
        param = parameters_param.format(index=0) if len(tools) == 1 else "tools"
        return ToolPlan("required", constraint, PARSERS["json_array"](), param=param)
    assert isinstance(choice, NamedToolChoice)
    index = next((i for i, tool in enumerate(tools) if tool.function.name == choice.function.name), None)
    if index is None:
        message = f"tool_choice names function {choice.function.name!r}, which is not among the tools"
        raise FieldError(message, "tool_choice")
    named = tools[index].function
    constraint = StructuredOutput.json_schema(named.parameters or EMPTY_PARAMETERS)
    return ToolPlan("named", constraint, function_name=named.name, param=parameters_param.format(index=index))


def _described(choice: ToolChoice | None) -> str:
    return f"naming function {choice.function.name!r}" if isinstance(choice, NamedToolChoice) else repr(choice)


def _calls_schema(tools: list[ToolDefinition], parallel: bool) -> dict[str, Any]:
    """A JSON array of calls, each naming one of the tools with arguments that match its parameters. Each tool's
    local $refs are rewritten to point where its schema now is: '#' meant its own root, not the array's."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": tool.function.name},
                "parameters": relocated(
                    tool.function.parameters or EMPTY_PARAMETERS, f"#/items/anyOf/{index}/properties/parameters"
                ),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for index, tool in enumerate(tools)
    ]
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


# Where subschemas are, by keyword: maps of them, lists of them, and single ones (`items` is either).
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SCHEMA_ONES = (
    *("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames", "contentSchema"),
    *("additionalProperties", "unevaluatedItems", "unevaluatedProperties"),
)


def relocated(schema: dict[str, Any], base: str) -> dict[str, Any]:
    """A copy of `schema` whose local $refs ('#', '#/...') point into it at `base`, a JSON pointer to where it is
    put in a bigger schema. Walks subschemas by keyword (a `$ref` key inside `enum` or `const` is data) and
    iteratively (its depth is checked, but a copy must not recurse either)."""
    root = dict(schema)
    root.pop("$id", None)  # refs resolve from the bigger schema's root now, where `base` starts
    todo = [root]
    while todo:
        node = todo.pop()
        ref = node.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):  # JSON pointers; anchors stay
            node["$ref"] = base + ref[1:]
        for key in _SCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                node[key] = {name: _copied(sub, todo) for name, sub in node[key].items()}
        for key in _SCHEMA_LISTS:
            if isinstance(node.get(key), list):
                node[key] = [_copied(sub, todo) for sub in node[key]]
        for key in _SCHEMA_ONES:
            if isinstance(node.get(key), dict):
                node[key] = _copied(node[key], todo)
    return root


def _copied(sub: Any, todo: list[dict[str, Any]]) -> Any:
    """A shallow copy of a subschema, queued to be walked; anything else (true, false) as it is."""
    if not isinstance(sub, dict):
        return sub
    copy = dict(sub)
    todo.append(copy)
    return copy


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def tool_call_object(call: ParsedToolCall) -> dict[str, Any]:
    return {"id": new_call_id(), "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def read_reply(plan: ToolPlan, text: str, finish_reason: str | None = None) -> ParsedReply:
    """The content and calls of a whole reply. A forced call cut short by max_tokens (finish_reason "length") is
    no call: its text is the content, as vLLM answers it, so that a client never runs a partial call."""
    if plan.forces_calls and finish_reason == "length":
        return ParsedReply(text)
    if plan.mode == "named":
        assert plan.function_name is not None
        return ParsedReply(None, [ParsedToolCall(plan.function_name, text)])
    if plan.parser is None:
        return ParsedReply(text)
    return plan.parser.parse(text)


class ReplyStream:
    """One streamed choice's text turned into chat delta objects: content, then tool calls as OpenAI streams
    them (index, id, type and name first, then argument fragments).

    A forced call (required, named) is held back until the reply ends, then sent whole: the reply may yet be cut
    by max_tokens, and a cut call is content (read_reply), streamed or not."""

    def __init__(self, plan: ToolPlan) -> None:
        self._plan = plan
        forced = plan.forces_calls
        self._calls: ToolCallStream | None = plan.parser.stream() if plan.parser is not None and not forced else None
        self._held: list[str] | None = [] if forced else None
        self.num_calls = 0

    def feed(self, text: str) -> list[dict[str, Any]]:
        if self._held is not None:
            self._held.append(text)
            return []
        if self._calls is None:
            return [{"content": text}] if text else []
        return self._deltas(self._calls.feed(text))

    def finish(self, finish_reason: str | None = None) -> list[dict[str, Any]]:
        if self._held is not None:
            return self._whole(read_reply(self._plan, "".join(self._held), finish_reason))
        return [] if self._calls is None else self._deltas(self._calls.finish())

    def _whole(self, reply: ParsedReply) -> list[dict[str, Any]]:
        events: list[StreamEvent] = [ContentDelta(reply.content)] if reply.content else []
        for index, call in enumerate(reply.tool_calls):
            events += [ToolCallStart(index, call.name), ToolArgumentsDelta(index, call.arguments)]
        return self._deltas(events)

    def _deltas(self, events: list[StreamEvent]) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        for event in events:
            if isinstance(event, ContentDelta):
                if event.text:
                    deltas.append({"content": event.text})
            elif isinstance(event, ToolCallStart):
                self.num_calls += 1
                start = {"index": event.index, "id": new_call_id(), "type": "function"}
                deltas.append({"tool_calls": [{**start, "function": {"name": event.name, "arguments": ""}}]})
            elif event.text:
                deltas.append({"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]})
        return deltas
