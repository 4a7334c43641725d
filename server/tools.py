"""Tool calling for chat completions: what `tools` and `tool_choice` ask of the engine, and the calls read back.

- `none`: tools are shown to the model (the chat template renders them) and the reply is plain content.
- `auto`: the model chooses; its calls are read back by the parser for its format (server/tool_parsers/).
- `required`: a grammar forces a JSON array of one call or more (one when parallel_tool_calls is false), each
  `{"name": <a tool's name>, "parameters": <arguments matching its schema>}`, as vLLM does.
- a named function: a grammar forces the arguments of that function, which are the whole reply.
Forced calls always parse and match their schema.
"""

from __future__ import annotations

import copy
import re
import secrets
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, field_validator
from pydantic_core import PydanticCustomError

from pagedserve.engine import StructuredOutput
from pagedserve.server.errors import FieldError
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
AUTO_TOOL_PARSERS = tuple(name for name in PARSERS if name != "json_array")  # formats models write by themselves


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # forced calls always match their schema

    @field_validator("name")
    @classmethod
    def _valid_name(cls, name: str) -> str:
        if not FUNCTION_NAME.match(name):
            message = "function names are 1 to 64 letters, digits, '_', '.' or '-', got {name}"
            raise PydanticCustomError("invalid_value", message, {"name": name})
        return name


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

    @property
    def calls_tools(self) -> bool:
        return self.mode != "none"


def plan_tools(
    tools: list[ToolDefinition] | None, choice: ToolChoice | None, parallel: bool, parser_name: str
) -> ToolPlan:
    """FieldError when the choice names no given tool."""
    if not tools:
        if choice not in (None, "none", "auto"):  # auto is the Responses API's default, tools or not
            raise FieldError(f"tool_choice {choice!r} needs tools", "tool_choice")
        return ToolPlan("none")
    choice = "auto" if choice is None else choice
    if choice == "none":
        return ToolPlan("none")
    if choice == "auto":
        return ToolPlan("auto", parser=PARSERS[parser_name]())
    if choice == "required":
        return ToolPlan(
            "required", StructuredOutput.json_schema(_calls_schema(tools, parallel)), PARSERS["json_array"]()
        )
    named = next((tool for tool in tools if tool.function.name == choice.function.name), None)
    if named is None:
        message = f"tool_choice names function {choice.function.name!r}, which is not among the tools"
        raise FieldError(message, "tool_choice")
    parameters = named.function.parameters or EMPTY_PARAMETERS
    return ToolPlan("named", StructuredOutput.json_schema(parameters), function_name=named.function.name)


def _calls_schema(tools: list[ToolDefinition], parallel: bool) -> dict[str, Any]:
    """A JSON array of calls, each naming one of the tools with arguments that match its parameters."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": tool.function.name},
                "parameters": copy.deepcopy(tool.function.parameters or EMPTY_PARAMETERS),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def tool_call_object(call: ParsedToolCall) -> dict[str, Any]:
    return {"id": new_call_id(), "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def read_reply(plan: ToolPlan, text: str) -> ParsedReply:
    """The content and calls of a whole reply."""
    if plan.mode == "named":
        assert plan.function_name is not None
        return ParsedReply(None, [ParsedToolCall(plan.function_name, text)])
    if plan.parser is None:
        return ParsedReply(text)
    return plan.parser.parse(text)


class ReplyStream:
    """One streamed choice's text turned into chat delta objects: content, then tool calls as OpenAI streams
    them (index, id, type and name first, then argument fragments)."""

    def __init__(self, plan: ToolPlan) -> None:
        self._plan = plan
        self._calls: ToolCallStream | None = plan.parser.stream() if plan.parser is not None else None
        self.num_calls = 0

    def feed(self, text: str) -> list[dict[str, Any]]:
        if self._plan.mode == "named":
            return self._named(text)
        if self._calls is None:
            return [{"content": text}] if text else []
        return self._deltas(self._calls.feed(text))

    def finish(self) -> list[dict[str, Any]]:
        return [] if self._calls is None else self._deltas(self._calls.finish())

    def _named(self, text: str) -> list[dict[str, Any]]:
        deltas = []
        if self.num_calls == 0:
            assert self._plan.function_name is not None
            deltas += self._deltas([ToolCallStart(0, self._plan.function_name)])
        if text:
            deltas += self._deltas([ToolArgumentsDelta(0, text)])
        return deltas

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
