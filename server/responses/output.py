"""What /v1/responses answers: the Response object (its output items, usage and status) and the events that
stream it."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from pagedserve.server.protocol import ChatTokenLogprob

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


class FunctionCallOut(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str  # JSON text
    status: ItemStatus


OutputItem = OutputMessage | FunctionCallOut


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


class TextConfigOut(BaseModel):
    format: dict[str, Any] = Field(default_factory=lambda: {"type": "text"})  # the request's, echoed


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
    output: list[OutputItem]
    usage: ResponseUsage | None = None
    instructions: str | None
    max_output_tokens: int | None
    temperature: float
    top_p: float
    top_logprobs: int | None
    metadata: dict[str, str]
    parallel_tool_calls: bool
    tool_choice: Any  # the request's, echoed
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
    item: OutputItem


class ArgumentsDeltaEvent(StreamEvent):
    """response.function_call_arguments.delta"""

    item_id: str
    output_index: int
    delta: str


class ArgumentsDoneEvent(StreamEvent):
    """response.function_call_arguments.done"""

    item_id: str
    output_index: int
    name: str
    arguments: str


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
