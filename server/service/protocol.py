"""The other endpoints' bodies: the model cards of /v1/models, and /tokenize and /detokenize."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

from pagedserve.server.chat.protocol import Messages
from pagedserve.server.protocol import RequestBody


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pagedserve"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ---- tokenizer endpoints -------------------------------------------------------------------------------


class TokenizeRequest(RequestBody):
    """Either a prompt or chat messages (tokenized with the chat template, as chat completions do)."""

    model: str | None = None
    prompt: str | None = None
    messages: Messages | None = None
    add_special_tokens: bool = True


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str
