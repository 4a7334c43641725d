"""OpenAI request bodies. Unknown fields are ignored like OpenAI does; features we lack are refused clearly.

Types and size limits are checked here; value ranges are checked once, by SamplingParams, whose messages
name the field.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from pagedserve.engine import SamplingParams, StructuredOutput
from pagedserve.engine.sampling_params import MAX_TOP_LOGPROBS
from pagedserve.server import fields
from pagedserve.server.errors import FieldError
from pagedserve.server.fields import Refusal, refuse_unsupported
from pagedserve.server.response_format import ResponseFormat, VllmStructuredOutputs, constraints_given
from pagedserve.server.tools import MAX_TOOLS, ToolChoice, ToolDefinition, ToolPlan, plan_tools

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
    # Output constraints (server/structured.py): OpenAI's, vLLM's and llama.cpp's names; at most one.
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

    def output_constraint(self) -> StructuredOutput | None:
        """The constraint the request names in any of the fields servers define (ValueError: malformed, or
        several named)."""
        return constraints_given(
            {
                "response_format": (ResponseFormat.constraint, self.response_format),
                "structured_outputs": (VllmStructuredOutputs.constraint, self.structured_outputs),
                "guided_json": (StructuredOutput.json_schema, self.guided_json),
                "guided_regex": (StructuredOutput.regex, self.guided_regex),
                "guided_choice": (StructuredOutput.choice, self.guided_choice),
                "guided_grammar": (StructuredOutput.grammar, self.guided_grammar),
                "json_schema": (StructuredOutput.json_schema, self.json_schema),
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


# ---- chat ----------------------------------------------------------------------------------------------


class TextPart(RequestBody):
    type: Literal["text"]
    text: str


class CalledFunction(RequestBody):
    name: str
    arguments: str | dict[str, Any] = "{}"  # JSON text as OpenAI sends it; an object is taken too


class AssistantToolCall(RequestBody):
    """A call the assistant made in an earlier turn (agent loops send their history back)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(RequestBody):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # None only for an assistant turn that called tools
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None  # the assistant's
    tool_call_id: str | None = None  # a tool message answers this call
    reasoning_content: str | None = None  # an earlier answer's reasoning: accepted, not shown to the model again

    @model_validator(mode="after")
    def _content_where_needed(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise PydanticCustomError(
                "invalid_value", "content is required, except for an assistant turn that calls tools"
            )
        if self.tool_calls and self.role != "assistant":
            raise PydanticCustomError("invalid_value", "only assistant messages carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise PydanticCustomError("invalid_value", "a tool message needs the tool_call_id it answers")
        return self

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        if content is None:
            return content
        if not isinstance(content, (str, list)):
            raise PydanticCustomError("invalid_type", "content must be a string or a list of text parts")
        for part in content if isinstance(content, list) else []:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text":
                message = "only text content parts are supported, got '{kind}'"
                raise PydanticCustomError("invalid_value", message, {"kind": str(kind)})
        return content

    @property
    def text(self) -> str | None:
        if self.content is None or isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)

    def for_template(self) -> dict[str, Any]:
        """The dict chat templates expect (Hugging Face's convention); developer is OpenAI's new system."""
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text}
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None and self.role == "tool":
            message["name"] = self.name
        return message


Messages = Annotated[list[ChatMessage], Field(max_length=MAX_MESSAGES)]


class ChatCompletionRequest(SamplingRequest):
    REFUSED = fields.CHAT

    messages: Messages
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens; wins when both are set
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    add_generation_prompt: bool = True  # vLLM's: open the assistant's turn after the messages
    continue_final_message: bool = False  # vLLM's: the last (assistant) message is continued, left open
    tools: Annotated[list[ToolDefinition], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    functions: list[Any] | None = None  # OpenAI's deprecated form of tools
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

    @field_validator("functions", "function_call")
    @classmethod
    def _deprecated_functions(cls, value: Any) -> Any:
        if value not in (None, [], "none"):
            raise unsupported("functions and function_call are deprecated by OpenAI; use tools and tool_choice")
        return value

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

    def tool_plan(self, parser_name: str) -> ToolPlan:
        """ValueError when tool_choice names no given tool."""
        return plan_tools(self.tools, self.tool_choice, self.parallel_tool_calls, parser_name)

    def sampling_params(self, tools: ToolPlan) -> SamplingParams:
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens
        if max_tokens == 0 and self.prompt_logprobs is None:
            raise ValueError("max_tokens must be >= 1 (0, scoring the prompt only, needs prompt_logprobs)")
        constraint = self.output_constraint()
        if tools.constraint is not None and constraint is not None:
            message = (
                f"tool_choice {tools.mode!r} forces a tool call; it cannot be combined with another output constraint"
            )
            raise FieldError(message, "tool_choice")
        return self.build_sampling_params(max_tokens, logprobs, self.prompt_logprobs, tools.constraint or constraint)

    def template_messages(self) -> list[dict[str, Any]]:
        return [message.for_template() for message in self.messages]

    def template_tools(self) -> list[dict[str, Any]] | None:
        return None if not self.tools else [tool.for_template() for tool in self.tools]


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
        return self.build_sampling_params(max_tokens, self.logprobs, prompt_logprobs, self.output_constraint())


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
