"""OpenAI request bodies. Unknown fields are ignored like OpenAI does; features we lack are refused clearly.

Types and size limits are checked here; value ranges are checked once, by SamplingParams, whose messages
name the field.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from pagedserve.engine import SamplingParams
from pagedserve.engine.sampling_params import MAX_TOP_LOGPROBS
from pagedserve.server import fields
from pagedserve.server.fields import Refusal, refuse_unsupported

MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256  # characters
MAX_LOGIT_BIAS = 300  # entries, OpenAI's limit: each one costs every step of the request
MAX_STOP_TOKEN_IDS = 256  # each one is checked at every token of the request
MAX_MESSAGES = 4096  # each one costs the chat template a render
MAX_TIMEOUT_SECONDS = 86400.0

TopLogprobs = Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]
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
    "ignore_eos",
    "min_tokens",
    "skip_special_tokens",
    "include_stop_str_in_output",
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
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    skip_special_tokens: bool | None = None  # vLLM's: special tokens left out of the text (default true)
    include_stop_str_in_output: bool | None = None  # vLLM's: the matched stop string kept in the text
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored
    timeout: Seconds | None = None  # the longest this request may wait to be scheduled (then 408)
    prompt_logprobs: TopLogprobs | None = None  # vLLM's: logprobs of the prompt's tokens, with the top k

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

    def build_sampling_params(
        self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None
    ) -> SamplingParams:
        """Raises ValueError, naming the field, for out-of-range values."""
        chosen = {name: getattr(self, name) for name in _SAMPLING_FIELDS if getattr(self, name) is not None}
        return SamplingParams(
            n=self.n, max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs, **chosen
        )


# ---- chat ----------------------------------------------------------------------------------------------


class TextPart(RequestBody):
    type: Literal["text"]
    text: str


class ChatMessage(RequestBody):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        if not isinstance(content, (str, list)):
            raise PydanticCustomError("invalid_type", "content must be a string or a list of text parts")
        for part in content if isinstance(content, list) else []:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text":
                message = "only text content parts are supported, got '{kind}'"
                raise PydanticCustomError("invalid_value", message, {"kind": str(kind)})
        return content

    def for_template(self) -> dict[str, str]:
        """The plain {"role", "content"} dict chat templates expect; developer is OpenAI's new system."""
        text = self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


Messages = Annotated[list[ChatMessage], Field(max_length=MAX_MESSAGES)]


class ResponseFormat(RequestBody):
    type: str

    @field_validator("type")
    @classmethod
    def _text_only(cls, kind: str) -> str:
        if kind != "text":
            raise unsupported(f"response_format {kind!r} is not supported; only 'text' is")
        return kind


class ChatCompletionRequest(SamplingRequest):
    REFUSED = fields.CHAT

    messages: Messages
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens; wins when both are set
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    response_format: ResponseFormat | None = None
    add_generation_prompt: bool = True  # vLLM's: open the assistant's turn after the messages
    continue_final_message: bool = False  # vLLM's: the last (assistant) message is continued, left open
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
        if not messages:
            raise PydanticCustomError("empty_array", "messages must hold at least one message")
        return messages

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, top_logprobs: int | None, info: ValidationInfo) -> int | None:
        if top_logprobs is not None and not info.data.get("logprobs"):
            raise PydanticCustomError("invalid_value", "top_logprobs requires logprobs to be true")
        return top_logprobs

    @field_validator("tools", "functions")
    @classmethod
    def _no_tools(cls, tools: list[Any] | None) -> list[Any] | None:
        if tools:
            raise unsupported("tool and function calling are not supported by this server")
        return tools

    @field_validator("tool_choice", "function_call")
    @classmethod
    def _no_tool_choice(cls, choice: Any) -> Any:
        if choice not in (None, "none"):
            raise unsupported("tool and function calling are not supported by this server")
        return choice

    @field_validator("continue_final_message")
    @classmethod
    def _continues_an_assistant_turn(cls, continues: bool, info: ValidationInfo) -> bool:
        if not continues:
            return continues
        if info.data.get("add_generation_prompt", True):
            message = "continue_final_message needs add_generation_prompt false: a turn is either continued or opened"
            raise PydanticCustomError("invalid_value", message)
        messages = info.data.get("messages") or []
        if messages and messages[-1].role != "assistant":
            raise PydanticCustomError(
                "invalid_value", "continue_final_message needs the last message to be the assistant's"
            )
        return continues

    @field_validator("prompt_logprobs")
    @classmethod
    def _not_streamed(cls, prompt_logprobs: int | None, info: ValidationInfo) -> int | None:
        if prompt_logprobs is not None and info.data.get("stream"):
            raise unsupported("prompt_logprobs is not supported with stream on chat completions")
        return prompt_logprobs

    def sampling_params(self) -> SamplingParams:
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens
        if max_tokens == 0 and self.prompt_logprobs is None:
            raise ValueError("max_tokens must be >= 1 (0, scoring the prompt only, needs prompt_logprobs)")
        return self.build_sampling_params(max_tokens, logprobs, self.prompt_logprobs)

    def template_messages(self) -> list[dict[str, str]]:
        return [message.for_template() for message in self.messages]


# ---- completions ---------------------------------------------------------------------------------------

Prompt = str | list[str] | list[int] | list[list[int]]

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for this endpoint (chat runs to the context's end)


class CompletionRequest(SamplingRequest):
    REFUSED = fields.COMPLETIONS

    prompt: Prompt
    echo: bool = False
    logprobs: TopLogprobs | None = None
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_of_four_forms(cls, prompt: Any) -> Any:
        """A clear message instead of pydantic's one error per member of the Prompt union."""
        if not _is_prompt(prompt):
            message = "prompt must be a string, a list of strings, token ids, or a list of token id lists"
            raise PydanticCustomError("invalid_type", message)
        if not prompt or any(isinstance(p, (str, list)) and not p for p in prompt):
            raise PydanticCustomError("empty_array", "prompt must not be empty")
        return prompt

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: str | None) -> str | None:
        if suffix:
            raise unsupported("suffix (fill-in-the-middle) is not supported by this server")
        return suffix

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, best_of: int | None) -> int | None:
        if best_of not in (None, 1):
            raise unsupported("best_of is not supported; use n")
        return best_of

    @property
    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt, whichever of the four OpenAI forms was sent."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [cast(str | list[int], self.prompt)]
        return cast(list[str | list[int]], self.prompt)

    @property
    def echoes_logprobs(self) -> bool:
        """echo with logprobs: the echoed prompt's tokens come with their logprobs, as OpenAI's scoring did."""
        return self.echo and self.logprobs is not None

    def sampling_params(self) -> SamplingParams:
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if self.max_tokens is None else self.max_tokens
        prompt_logprobs = self.prompt_logprobs
        if self.echoes_logprobs:
            prompt_logprobs = max(self.logprobs or 0, prompt_logprobs or 0)
        return self.build_sampling_params(max_tokens, self.logprobs, prompt_logprobs)


def _is_prompt(value: Any) -> bool:
    def token_ids(items: Any) -> bool:
        return isinstance(items, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in items)

    if isinstance(value, str) or token_ids(value):
        return True
    if not isinstance(value, list):
        return False
    return all(isinstance(p, str) for p in value) or all(map(token_ids, value))


# ---- tokenizer endpoints -------------------------------------------------------------------------------


class TokenizeRequest(RequestBody):
    """Either a prompt or chat messages (tokenized with the chat template, as chat completions do)."""

    model: str | None = None
    prompt: str | None = None
    messages: Messages | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[int]
