"""OpenAI's Responses API (`POST /v1/responses`): the request body (its input items: responses/input.py; what it
answers: responses/output.py).

The server is stateless: nothing is stored, so everything that needs a stored response, conversation or prompt
template is refused. Function tools and `text.format` (JSON schema, JSON object) work as on chat completions
(server/tools.py, server/response_format.py); the hosted tools (web search, file search, ...) are refused. Fields
that would change the output and that pagedserve lacks are refused with 400 unsupported_parameter, never
ignored; fields that change nothing are accepted (RESPONSES_ACCEPTED). The sampling extensions chat completions
take (`top_k`, `seed`, `stop`, penalties, ...) are honoured here too.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from pagedserve.engine import SamplingParams, StructuredOutput
from pagedserve.server import fields
from pagedserve.server.errors import FieldError
from pagedserve.server.fields import Refusal
from pagedserve.server.protocol import (
    MAX_MESSAGES,
    RequestBody,
    SamplingRequest,
    TopLogprobs,
    unsupported,
)
from pagedserve.server.response_format import JsonSchemaFormat, constraints_given, json_constraint
from pagedserve.server.responses.input import InputItem, check_outputs_answer_calls, conversation_messages
from pagedserve.server.tools import (
    MAX_TOOLS,
    FunctionDefinition,
    FunctionName,
    NamedFunction,
    NamedToolChoice,
    Parameters,
    ToolChoice,
    ToolDefinition,
    ToolPlan,
    plan_tools,
)

OUTPUT_LOGPROBS = "message.output_text.logprobs"  # the `include` value that asks for the output's logprobs
MAX_METADATA = 16  # OpenAI's limit on metadata pairs

_STATELESS = "this server is stateless and stores nothing: send the whole conversation as input"
_HOSTED_TOOLS = "only function tools are supported: this server hosts no tools of its own"
_ITEM_REFUSALS = {"item_reference": _STATELESS, "reasoning": "reasoning is not supported by this server"}
_INPUT_ITEMS = ("message", "function_call", "function_call_output")

# field -> (values that ask for nothing besides null, why): see server/fields.py.
RESPONSES: dict[str, Refusal] = {
    **fields.SHARED,
    "store": ((False,), _STATELESS),
    "previous_response_id": ((), _STATELESS),
    "conversation": ((), _STATELESS),
    "prompt": ((), f"stored prompt templates are not supported; {_STATELESS}"),
    "background": ((False,), f"background responses are not supported; {_STATELESS}"),
    "background_options": (({},), "background responses are not supported"),
    "context_management": (([],), "context compaction is not supported"),
    "reasoning": (({},), "reasoning is not supported by this server"),
    "truncation": (("disabled",), "prompts are never truncated: a prompt over the context is refused"),
    # Chat completions' names for what this API spells differently.
    "n": ((1,), "a response has one output; send several requests"),
    "max_tokens": ((), "use max_output_tokens"),
    "max_completion_tokens": ((), "use max_output_tokens"),
    "logprobs": ((False,), f"use include ['{OUTPUT_LOGPROBS}'] and top_logprobs"),
    "response_format": ((), "use text.format"),
    "prompt_logprobs": ((), "prompt logprobs are not supported on responses"),
}


# ---- request -------------------------------------------------------------------------------------------


class FunctionTool(RequestBody):
    """The Responses API's function tool: chat completions' definition, flattened."""

    type: Literal["function"]
    name: FunctionName
    description: str | None = None
    parameters: Parameters = None
    strict: bool | None = None

    def as_chat_tool(self) -> ToolDefinition:
        function = FunctionDefinition(
            name=self.name, description=self.description, parameters=self.parameters, strict=self.strict
        )
        return ToolDefinition(type="function", function=function)


class FunctionChoice(RequestBody):
    type: Literal["function"]
    name: str


ResponsesToolChoice = Literal["none", "auto", "required"] | FunctionChoice


class TextFormat(JsonSchemaFormat):
    """`text.format`: text, json_object, or json_schema with the schema's fields beside the type."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True, serialize_by_alias=True)

    type: Literal["text", "json_object", "json_schema"]

    def constraint(self) -> StructuredOutput | None:
        if self.type == "text":
            return None
        if self.type == "json_schema" and self.schema_ is None:  # as chat's response_format: no schema, no guess
            raise ValueError("text.format json_schema needs the 'schema' beside its type")
        return json_constraint(None if self.type == "json_object" else self.schema_)


class TextConfig(RequestBody):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # OpenAI's default; other levels are refused

    @field_validator("verbosity", mode="before")
    @classmethod
    def _default_verbosity(cls, verbosity: Any) -> Any:
        if verbosity not in (None, "medium"):
            raise unsupported("only the default, 'medium', is supported")
        return verbosity


class PromptCacheOptions(RequestBody):
    """Accepted (the prefix cache is automatic) unless it asks to warm the cache instead of answering."""

    prewarm: bool = False

    @field_validator("prewarm")
    @classmethod
    def _answer(cls, prewarm: bool) -> bool:
        if prewarm:
            raise unsupported("prewarm is not supported: every request is answered (the prefix cache is automatic)")
        return prewarm


Metadata = Annotated[dict[str, str], Field(max_length=MAX_METADATA)]


class ResponsesRequest(SamplingRequest):
    REFUSED: ClassVar[dict[str, Refusal]] = RESPONSES

    input: list[InputItem]
    instructions: str | None = None  # a system message ahead of the input
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None  # clamped to the room left in the context
    include: list[str] | None = None  # OUTPUT_LOGPROBS is honoured; the rest name items this server never makes
    top_logprobs: TopLogprobs | None = None
    text: TextConfig | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] = Field(default_factory=list)
    tool_choice: ResponsesToolChoice = "auto"
    parallel_tool_calls: bool = True
    metadata: Metadata | None = None  # echoed
    prompt_cache_options: PromptCacheOptions | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _messages(cls, value: Any) -> Any:
        """A string is one user message; a list holds message, function_call and function_call_output items."""
        if isinstance(value, str):
            return [{"type": "message", "role": "user", "content": value}]
        if not isinstance(value, list):
            raise PydanticCustomError("invalid_type", "input must be a string or a list of message items")
        if not value:
            raise PydanticCustomError("empty_array", "input must hold at least one message")
        if len(value) > MAX_MESSAGES:
            raise PydanticCustomError("invalid_value", f"input takes at most {MAX_MESSAGES} items")
        items = []
        for index, item in enumerate(value):
            kind = str(item.get("type", "message")) if isinstance(item, dict) else "message"
            if kind not in _INPUT_ITEMS:
                why = _ITEM_REFUSALS.get(kind) or (_HOSTED_TOOLS if "call" in kind else "not supported")
                message = "item {index} has type '{kind}', which is not supported ({why})"
                raise PydanticCustomError("unsupported_parameter", message, {"index": index, "kind": kind, "why": why})
            items.append({**item, "type": kind} if isinstance(item, dict) else item)
        return items

    @field_validator("input")
    @classmethod
    def _outputs_answer_calls(cls, items: list[InputItem]) -> list[InputItem]:
        check_outputs_answer_calls(items)
        return items

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, tools: Any) -> Any:
        for tool in tools if isinstance(tools, list) else []:
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise unsupported(f"tool type {kind!r} is not supported ({_HOSTED_TOOLS})")
        return tools

    @property
    def wants_logprobs(self) -> bool:
        """Asked for with include, as OpenAI does, or by setting top_logprobs (never silently dropped)."""
        return OUTPUT_LOGPROBS in (self.include or []) or self.top_logprobs is not None

    def tool_plan(self, parser_name: str) -> ToolPlan:
        choice = self.tool_choice
        if isinstance(choice, FunctionChoice):
            chat_choice: ToolChoice = NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
        else:
            chat_choice = choice
        tools = [tool.as_chat_tool() for tool in self.tools]
        return plan_tools(tools, chat_choice, self.parallel_tool_calls, parser_name, "tools.{index}.parameters")

    def sampling_params(self, tools: ToolPlan) -> SamplingParams:
        logprobs = (self.top_logprobs or 0) if self.wants_logprobs else None
        text_format = self.text.format if self.text is not None else None
        constraint = constraints_given({"text.format": (TextFormat.constraint, text_format)})
        if tools.constraint is not None and constraint is not None:
            raise FieldError(
                f"tool_choice {tools.mode!r} forces a tool call; it cannot be combined with text.format", "text.format"
            )
        return self.build_sampling_params(self.max_output_tokens, logprobs, None, tools.constraint or constraint)

    def constraint_param(self, tools: ToolPlan) -> str | None:
        """The field the output constraint comes from, named by its compile errors."""
        if tools.constraint is not None:
            return tools.param
        text_format = self.text.format if self.text is not None else None
        return None if text_format is None or text_format.type == "text" else "text.format"

    def template_messages(self) -> list[dict[str, Any]]:
        system = [] if self.instructions is None else [{"role": "system", "content": self.instructions}]
        return system + conversation_messages(self.input)

    def template_tools(self) -> list[dict[str, Any]] | None:
        return [tool.as_chat_tool().for_template() for tool in self.tools] or None


def _accepted() -> tuple[str, ...]:
    extra = ("max_tool_calls", "access_programs", "image")  # bounds and kinds of hosted tools: none is hosted
    declared = ResponsesRequest.model_fields
    return tuple(name for name in (*fields.ACCEPTED, *extra) if name not in declared)


# Defined by OpenAI and accepted: none of them changes the output.
RESPONSES_ACCEPTED = _accepted()
