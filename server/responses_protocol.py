"""OpenAI's Responses API (`POST /v1/responses`): the request body, the Response object and its stream events.

The server is stateless: nothing is stored, so everything that needs a stored response, conversation or prompt
template is refused, like tools and structured output, which are not built yet. Fields that would change the
output and that pagedserve lacks are refused with 400 unsupported_parameter, never ignored; fields that change
nothing are accepted (RESPONSES_ACCEPTED). The sampling extensions chat completions take (`top_k`, `seed`,
`stop`, penalties, ...) are honoured here too.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, Field, field_validator
from pydantic_core import PydanticCustomError

from pagedserve.engine import SamplingParams
from pagedserve.server import fields
from pagedserve.server.fields import Refusal
from pagedserve.server.protocol import (
    MAX_MESSAGES,
    RequestBody,
    SamplingRequest,
    TopLogprobs,
    unsupported,
)
from pagedserve.server.responses import ChatTokenLogprob

OUTPUT_LOGPROBS = "message.output_text.logprobs"  # the `include` value that asks for the output's logprobs
MAX_METADATA = 16  # OpenAI's limit on metadata pairs

_STATELESS = "this server is stateless and stores nothing: send the whole conversation as input"
_TOOLS = "tool calling is not built yet"
_ITEM_REFUSALS = {"item_reference": _STATELESS, "reasoning": "reasoning is not supported by this server"}

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
    "tools": (([],), _TOOLS),
    # Chat completions' names for what this API spells differently.
    "n": ((1,), "a response has one output; send several requests"),
    "max_tokens": ((), "use max_output_tokens"),
    "max_completion_tokens": ((), "use max_output_tokens"),
    "logprobs": ((False,), f"use include ['{OUTPUT_LOGPROBS}'] and top_logprobs"),
    "response_format": ((), "use text.format"),
    "prompt_logprobs": ((), "prompt logprobs are not supported on responses"),
}


# ---- request -------------------------------------------------------------------------------------------


class InputText(RequestBody):
    """A message's text part: `input_text`, or `output_text` in an earlier assistant turn sent back."""

    type: Literal["input_text", "output_text"]
    text: str


class InputMessage(RequestBody):
    """One message item; `type` may be left out. Other item fields (`id`, `status`) are ignored."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: list[InputText]

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content: Any) -> Any:
        if isinstance(content, str):
            return [{"type": "input_text", "text": content}]
        if not isinstance(content, list):
            raise PydanticCustomError("invalid_type", "content must be a string or a list of text parts")
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind not in ("input_text", "output_text"):
                message = "only text content parts (input_text, output_text) are supported, got '{kind}'"
                raise PydanticCustomError("invalid_value", message, {"kind": str(kind)})
        return content

    def for_template(self) -> dict[str, str]:
        """The {"role", "content"} dict chat templates expect; developer is OpenAI's new system."""
        text = "\n".join(part.text for part in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class TextFormat(RequestBody):
    type: Literal["text"]


class TextConfig(RequestBody):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # OpenAI's default; other levels are refused

    @field_validator("format", mode="before")
    @classmethod
    def _plain_text(cls, value: Any) -> Any:
        kind = value.get("type") if isinstance(value, dict) else None
        if kind is not None and kind != "text":
            raise unsupported(f"{kind!r} is not supported (structured output is not built yet); only 'text' is")
        return value

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

    input: list[InputMessage]
    instructions: str | None = None  # a system message ahead of the input
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None  # clamped to the room left in the context
    include: list[str] | None = None  # OUTPUT_LOGPROBS is honoured; the rest name items this server never makes
    top_logprobs: TopLogprobs | None = None
    text: TextConfig | None = None
    tool_choice: Literal["none", "auto"] = "auto"  # without tools, both mean a plain message
    parallel_tool_calls: bool = True  # echoed: no tools, so nothing to call in parallel
    metadata: Metadata | None = None  # echoed
    prompt_cache_options: PromptCacheOptions | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _messages(cls, value: Any) -> Any:
        """A string is one user message; a list holds message items only (tool calls are not built yet)."""
        if isinstance(value, str):
            return [{"role": "user", "content": value}]
        if not isinstance(value, list):
            raise PydanticCustomError("invalid_type", "input must be a string or a list of message items")
        if not value:
            raise PydanticCustomError("empty_array", "input must hold at least one message")
        if len(value) > MAX_MESSAGES:
            raise PydanticCustomError("invalid_value", f"input takes at most {MAX_MESSAGES} items")
        for index, item in enumerate(value):
            kind = str(item.get("type", "message")) if isinstance(item, dict) else "message"
            if kind != "message":
                why = _ITEM_REFUSALS.get(kind) or (_TOOLS if "call" in kind else "only message items are supported")
                message = "item {index} has type '{kind}', which is not supported ({why})"
                raise PydanticCustomError("unsupported_parameter", message, {"index": index, "kind": kind, "why": why})
        return value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _no_tool_choice(cls, choice: Any) -> Any:
        if choice not in ("none", "auto"):
            raise unsupported(f"only 'none' and 'auto' are supported: {_TOOLS}")
        return choice

    @property
    def wants_logprobs(self) -> bool:
        """Asked for with include, as OpenAI does, or by setting top_logprobs (never silently dropped)."""
        return OUTPUT_LOGPROBS in (self.include or []) or self.top_logprobs is not None

    def sampling_params(self) -> SamplingParams:
        logprobs = (self.top_logprobs or 0) if self.wants_logprobs else None
        return self.build_sampling_params(self.max_output_tokens, logprobs, None, None)

    def template_messages(self) -> list[dict[str, str]]:
        system = [] if self.instructions is None else [{"role": "system", "content": self.instructions}]
        return system + [message.for_template() for message in self.input]


def _accepted() -> tuple[str, ...]:
    extra = ("max_tool_calls", "access_programs", "image")  # no tools and no images: they change nothing
    declared = ResponsesRequest.model_fields
    return tuple(name for name in (*fields.ACCEPTED, *extra) if name not in declared)


# Defined by OpenAI and accepted: none of them changes the output.
RESPONSES_ACCEPTED = _accepted()


# ---- response ------------------------------------------------------------------------------------------

Status = Literal["in_progress", "completed", "incomplete", "failed", "cancelled"]
ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[ChatTokenLogprob] = Field(default_factory=list)  # filled only when asked for


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: ItemStatus
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class InputTokensDetails(BaseModel):
    cached_tokens: int


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    code: str | None
    message: str


class TextFormatOut(BaseModel):
    type: Literal["text"] = "text"


class TextConfigOut(BaseModel):
    format: TextFormatOut = Field(default_factory=TextFormatOut)


class ResponseObject(BaseModel):
    """OpenAI's Response, with the request's settings echoed as OpenAI does."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    completed_at: int | None = None
    status: Status
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    model: str
    output: list[OutputMessage]
    usage: ResponseUsage | None = None
    instructions: str | None
    max_output_tokens: int | None
    temperature: float
    top_p: float
    top_logprobs: int | None
    metadata: dict[str, str]
    parallel_tool_calls: bool
    tool_choice: Literal["none", "auto"]
    tools: list[Any] = Field(default_factory=list)
    text: TextConfigOut = Field(default_factory=TextConfigOut)
    truncation: Literal["disabled"] = "disabled"
    reasoning: None = None
    previous_response_id: None = None
    store: Literal[False] = False
    background: Literal[False] = False
    user: str | None


# ---- stream events -------------------------------------------------------------------------------------


class StreamEvent(BaseModel):
    type: str
    sequence_number: int


class LifecycleEvent(StreamEvent):
    """response.created, .in_progress, .completed, .incomplete, .failed."""

    response: ResponseObject


class OutputItemEvent(StreamEvent):
    output_index: int
    item: OutputMessage


class ContentPartEvent(StreamEvent):
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class TextDeltaEvent(StreamEvent):
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[ChatTokenLogprob]


class TextDoneEvent(StreamEvent):
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[ChatTokenLogprob]


class ErrorEvent(StreamEvent):
    code: str | None
    message: str
    param: str | None
