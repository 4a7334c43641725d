"""The tokenizer endpoints' bodies, in vLLM's form and in llama.cpp's (one path serves both)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from pagedserve.server.chat.protocol import ChatPrompt, Messages
from pagedserve.server.protocol import unsupported
from pagedserve.server.tools import MAX_TOOLS, ToolDefinition


class TokenizeRequest(ChatPrompt):
    """Exactly one of vLLM's `prompt` or `messages` (tokenized with the chat template, as chat completions do)
    or llama.cpp's `content`."""

    model: str | None = None
    prompt: str | None = None
    messages: Messages | None = None
    tools: Annotated[list[ToolDefinition], Field(max_length=MAX_TOOLS)] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt; false for messages (the template's)
    return_token_strs: bool = False
    # llama.cpp's
    content: str | None = None
    add_special: bool = False
    with_pieces: bool = False
    parse_special: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        given = [name for name in ("prompt", "messages", "content") if getattr(self, name) is not None]
        if len(given) != 1:
            raise PydanticCustomError("invalid_value", "send exactly one of prompt, messages and content")
        return self

    @field_validator("parse_special")
    @classmethod
    def _special_tokens_parsed(cls, parse_special: bool) -> bool:
        if not parse_special:
            raise unsupported("parse_special false is not supported: the text of a special token is that token")
        return parse_special

    def template_messages(self) -> list[dict[str, Any]]:
        return [message.for_template() for message in self.messages or []]

    def template_tools(self) -> list[dict[str, Any]] | None:
        return None if not self.tools else [tool.for_template() for tool in self.tools]


class TokenPiece(BaseModel):
    """llama.cpp's token with `with_pieces`: its id and its text."""

    id: int
    piece: str


class TokenizeResponse(BaseModel):
    tokens: list[int] | list[TokenPiece]
    count: int
    max_model_len: int
    token_strs: list[str] | None = None  # with return_token_strs: each token's string in the vocabulary


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str  # vLLM's name
    content: str  # llama.cpp's name for the same text
