"""OpenAI response bodies, field for field (null fields included, as OpenAI sends them)."""

from __future__ import annotations

from typing import Any, Literal, TypedDict

from pydantic import BaseModel


class Envelope(TypedDict):
    """The fields every chat and completions object (and chunk) of one answer repeats."""

    id: str
    created: int
    model: str
    system_fingerprint: str


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


# ---- logprobs ------------------------------------------------------------------------------------------


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]  # None for an echoed prompt's first token, as OpenAI did
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptTokenLogprob(BaseModel):
    """vLLM's `prompt_logprobs` entry, keyed by token id."""

    logprob: float
    rank: int | None
    decoded_token: str


PromptLogprobsOut = list[dict[str, PromptTokenLogprob] | None]


# ---- chat ----------------------------------------------------------------------------------------------


class CalledFunction(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: None = None
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None  # a reasoning model's thinking, as vLLM and DeepSeek's API send it


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobsOut | None = None  # vLLM's extension, when asked for


class ChatChunkChoice(BaseModel):
    index: int
    delta: dict[str, Any]  # {"role", "content"} first; then {"content"}, {"reasoning_content"} or {"tool_calls"};
    # {} with the finish_reason
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None  # sent (null until the last chunk) only with stream_options.include_usage


# ---- completions ---------------------------------------------------------------------------------------


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobsOut | None = None  # vLLM's extension, when asked for


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: Usage | None = None  # always set, except on streamed chunks without include_usage


# ---- other endpoints -----------------------------------------------------------------------------------


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pagedserve"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str
