"""/v1/chat/completions' request body and answers (whole, and streamed as chunks)."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from pagedserve.engine import SamplingParams
from pagedserve.server import fields
from pagedserve.server.errors import FieldError
from pagedserve.server.protocol import (
    MAX_MESSAGES,
    ChatLogprobs,
    PromptLogprobsOut,
    RequestBody,
    SamplingRequest,
    ToolCall,
    TopLogprobs,
    Usage,
    unsupported,
)
from pagedserve.server.response_format import constraint_field
from pagedserve.server.tools import MAX_TOOLS, ToolChoice, ToolDefinition, ToolPlan, plan_tools

# ---- request -------------------------------------------------------------------------------------------


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


STANDARD_ROLES = ("system", "developer", "user", "assistant", "tool")
# Other role names go to the chat template as they are (a template may know "ipython" or "observation"); they are
# words, so no role can carry the text of a special token into the prompt.
CUSTOM_ROLE = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,31}$")


def _known_or_custom_role(role: str) -> str:
    if role not in STANDARD_ROLES and not CUSTOM_ROLE.match(role):
        message = "role must be one of {standard} or a custom role name (a letter, then letters, digits, '_' or '-')"
        raise PydanticCustomError("invalid_value", message, {"standard": ", ".join(STANDARD_ROLES)})
    return role


Role = Annotated[str, AfterValidator(_known_or_custom_role)]


class ChatMessage(RequestBody):
    role: Role
    content: str | list[TextPart] | None = None  # None only for an assistant turn that called tools
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None  # the assistant's
    tool_call_id: str | None = None  # a tool message answers this call
    reasoning_content: str | None = None  # an earlier answer's reasoning: accepted, not shown to the model again
    reasoning: str | None = None  # the same, under vLLM's newer name

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


MAX_TEMPLATE_KWARGS = 64


class ChatPrompt(RequestBody):
    """How messages become a prompt (vLLM's fields), shared by chat completions and /tokenize."""

    add_generation_prompt: bool = True  # open the assistant's turn after the messages
    continue_final_message: bool = False  # the last (assistant) message is continued, left open
    # The template's own switches (enable_thinking, ...); strings in them are text, like messages'.
    chat_template_kwargs: Annotated[dict[str, Any], Field(max_length=MAX_TEMPLATE_KWARGS)] | None = None

    @model_validator(mode="after")
    def _continues_an_assistant_turn(self) -> ChatPrompt:
        if not self.continue_final_message:
            return self
        param = {"param": "continue_final_message"}
        if self.add_generation_prompt:
            message = "continue_final_message needs add_generation_prompt false: a turn is either continued or opened"
            raise PydanticCustomError("invalid_value", message, param)
        messages: list[ChatMessage] | None = getattr(self, "messages", None)
        if messages and messages[-1].role != "assistant":
            message = "continue_final_message needs the last message to be the assistant's"
            raise PydanticCustomError("invalid_value", message, param)
        return self


class ChatCompletionRequest(SamplingRequest, ChatPrompt):
    REFUSED = fields.CHAT

    messages: Messages
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens; wins when both are set
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    add_special_tokens: bool = False  # vLLM's: the tokenizer's own (a BOS) too, before the template's
    echo: bool = False  # vLLM's: a reply to a final assistant message starts with that message's text
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

    def constraint_param(self, tools: ToolPlan) -> str | None:
        """The field the output constraint comes from, named by its compile errors."""
        return tools.param if tools.constraint is not None else constraint_field(self)

    def template_messages(self) -> list[dict[str, Any]]:
        return [message.for_template() for message in self.messages]

    @property
    def echoed(self) -> str:
        """What each reply starts with: with echo, the final message's text when it is the assistant's."""
        last = self.messages[-1]
        return (last.text or "") if self.echo and last.role == "assistant" else ""

    def template_tools(self) -> list[dict[str, Any]] | None:
        return None if not self.tools else [tool.for_template() for tool in self.tools]


# ---- answers -------------------------------------------------------------------------------------------

# With vLLM's return_token_ids, answers carry `prompt_token_ids` and their choices `token_ids`: set as extra fields
# only then, so that no other answer shows them (vLLM's streams send prompt_token_ids in the first chunk only).
TOKEN_IDS_EXTRA = ConfigDict(extra="allow")


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: None = None
    tool_calls: list[ToolCall] | None = None
    # A reasoning model's thinking, under both names servers use: DeepSeek's API's and older vLLM's
    # `reasoning_content`, and vLLM's newer `reasoning`.
    reasoning_content: str | None = None
    reasoning: str | None = None


class ChatChoice(BaseModel):
    model_config = TOKEN_IDS_EXTRA

    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletion(BaseModel):
    model_config = TOKEN_IDS_EXTRA

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobsOut | None = None  # vLLM's extension, when asked for


class ChatChunkChoice(BaseModel):
    model_config = TOKEN_IDS_EXTRA

    index: int
    delta: dict[str, Any]  # {"role", "content"} first; then {"content"}, {"reasoning_content", "reasoning"} or
    # {"tool_calls"};
    # {} with the finish_reason
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    model_config = TOKEN_IDS_EXTRA

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None  # sent (null until the last chunk) only with stream_options.include_usage
