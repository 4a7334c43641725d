"""What the endpoints share: request bodies' rules and sampling fields, and the answers' usage, logprob and
tool call bodies. Each endpoint's own request and answer bodies are beside its handler (chat/protocol.py,
completions/protocol.py, responses/protocol.py, service/protocol.py).

Unknown request fields are ignored like OpenAI does; features we lack are refused clearly. Types and size limits
are checked here; value ranges are checked once, by SamplingParams, whose messages name the field. Answers are
OpenAI's field for field (null fields included, as OpenAI sends them).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError
from typing_extensions import TypedDict  # pydantic reads typing's only from Python 3.12

from pagedserve.engine import SamplingParams, StructuredOutput
from pagedserve.engine.sampling_params import MAX_TOP_LOGPROBS
from pagedserve.server.fields import Refusal, refuse_unsupported
from pagedserve.server.response_format import (
    ResponseFormat,
    VllmStructuredOutputs,
    constraints_given,
    schema_constraint,
)

MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256  # characters
MAX_LOGIT_BIAS = 300  # entries, OpenAI's limit: each one costs every step of the request
MAX_STOP_TOKEN_IDS = 256  # each one is checked at every token of the request
MAX_MESSAGES = 4096  # each one costs the chat template a render
MAX_TIMEOUT_SECONDS = 86400.0


def _not_the_whole_vocabulary(count: Any) -> Any:
    """vLLM's -1 asks for every token's logprob (tens of thousands per position): refused, not cut silently."""
    if count == -1 and not isinstance(count, bool):
        message = "-1 (the whole vocabulary) is not supported: ask for at most {most}"
        raise PydanticCustomError("unsupported_parameter", message, {"most": MAX_TOP_LOGPROBS})
    return count


TopLogprobs = Annotated[int, BeforeValidator(_not_the_whole_vocabulary), Field(ge=0, le=MAX_TOP_LOGPROBS)]
Seconds = Annotated[float, Field(gt=0, le=MAX_TIMEOUT_SECONDS, allow_inf_nan=False)]

# Fields passed to SamplingParams as they are, when the client sets them.
_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "allowed_token_ids",
    "ignore_eos",
    "min_tokens",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "speculative",
)


def unsupported(message: str) -> PydanticCustomError:
    return PydanticCustomError("unsupported_parameter", message)


class RequestBody(BaseModel):
    """Every request body's rules: unknown fields are ignored and null means "the default", as with OpenAI."""

    model_config = ConfigDict(extra="ignore")  # pydantic's default, stated

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items() if v is not None or k not in fields or fields[k].is_required()}


class StreamOptions(RequestBody):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, the usage so far in every chunk too


class SamplingRequest(RequestBody):
    """What chat and completions requests share. Fields other servers define that would change the output and
    that pagedserve lacks are refused (server/fields.py), never ignored."""

    REFUSED: ClassVar[dict[str, Refusal]] = {}

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        refuse_unsupported(data, cls.REFUSED)
        return data

    model: str
    n: int = 1
    max_tokens: int | None = None  # clamped by the engine to the room left in the context
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: Annotated[list[int], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None  # vLLM's: only these tokens may be sampled
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    skip_special_tokens: bool | None = None  # vLLM's: special tokens left out of the text (default true)
    include_stop_str_in_output: bool | None = None  # vLLM's: the matched stop string kept in the text
    speculative: bool | None = None  # pagedserve's: speculative decoding for this request (default: the server's)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored
    timeout: Seconds | None = None  # the longest this request may wait to be scheduled (then 408)
    prompt_logprobs: TopLogprobs | None = None  # vLLM's: logprobs of the prompt's tokens, with the top k
    return_token_ids: bool = False  # vLLM's: the prompt's and the choices' token ids in the answer
    # Output constraints (server/response_format.py): OpenAI's, vLLM's and llama.cpp's names; at most one.
    response_format: ResponseFormat | None = None
    structured_outputs: VllmStructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    json_schema: dict[str, Any] | None = None  # llama.cpp's
    grammar: str | None = None  # llama.cpp's (GBNF)

    @field_validator("stop")
    @classmethod
    def _few_short_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOP_STRINGS:
            raise PydanticCustomError("invalid_value", f"stop takes at most {MAX_STOP_STRINGS} strings")
        if any(len(s) > MAX_STOP_LENGTH for s in stops):
            raise PydanticCustomError("invalid_value", f"stop strings must be at most {MAX_STOP_LENGTH} characters")
        return stop

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, options: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if options is not None and not info.data.get("stream"):
            raise PydanticCustomError("invalid_value", "stream_options is only allowed when stream is true")
        return options

    @field_validator("logit_bias")
    @classmethod
    def _bounded_logit_bias(cls, bias: dict[int, float] | None) -> dict[int, float] | None:
        if bias is not None and len(bias) > MAX_LOGIT_BIAS:
            raise PydanticCustomError("invalid_value", f"logit_bias takes at most {MAX_LOGIT_BIAS} entries")
        return bias

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options is not None and self.stream_options.continuous_usage_stats

    def output_constraint(self) -> StructuredOutput | None:
        """The constraint the request names in any of the fields servers define (ValueError: malformed, or
        several named)."""
        return constraints_given(
            {
                "response_format": (ResponseFormat.constraint, self.response_format),
                "structured_outputs": (VllmStructuredOutputs.constraint, self.structured_outputs),
                "guided_json": (schema_constraint, self.guided_json),
                "guided_regex": (StructuredOutput.regex, self.guided_regex),
                "guided_choice": (StructuredOutput.choice, self.guided_choice),
                "guided_grammar": (StructuredOutput.grammar, self.guided_grammar),
                "json_schema": (schema_constraint, self.json_schema),
                "grammar": (StructuredOutput.grammar, self.grammar),
            }
        )

    def build_sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None,
        structured_output: StructuredOutput | None,
    ) -> SamplingParams:
        """Raises ValueError, naming the field, for out-of-range values."""
        chosen = {name: getattr(self, name) for name in _SAMPLING_FIELDS if getattr(self, name) is not None}
        return SamplingParams(
            n=self.n,
            max_tokens=max_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            structured_output=structured_output,
            **chosen,
        )


# ---- answers -------------------------------------------------------------------------------------------


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


# A dict, not a model: a 3,000-token prompt with its top 20 is 63,000 of them, which as models held the event loop
# for a second (~10x the dicts' cost, validation and serialization included).
class PromptTokenLogprob(TypedDict):
    """vLLM's `prompt_logprobs` entry, keyed by token id."""

    logprob: float
    rank: int | None
    decoded_token: str


PromptLogprobsOut = list[dict[str, PromptTokenLogprob] | None]


# ---- tool calls (as answers carry them) ----------------------------------------------------------------


class CalledFunction(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction
