"""POST /tokenize, POST /detokenize (vLLM's and llama.cpp's forms) and GET /tokenizer_info (vLLM's)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from pagedserve.engine.client.async_engine import AsyncEngine
from pagedserve.server.context import serving
from pagedserve.server.errors import invalid_request, to_api_error
from pagedserve.server.tokenization.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    TokenPiece,
)

router = APIRouter(tags=["tokenizer"])


@router.post("/tokenize", response_model=TokenizeResponse)
async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
    engine = serving(request).engine_for(body.model)
    try:
        tokens = await _token_ids(engine, body)
    except ValueError as exc:
        raise to_api_error(exc, "messages" if body.messages is not None else "prompt") from exc
    tokenizer = engine.tokenizer
    listed: list[int] | list[TokenPiece] = tokens
    if body.with_pieces:
        listed = [TokenPiece(id=token, piece=tokenizer.token_text(token)) for token in tokens]
    return TokenizeResponse(
        tokens=listed,
        count=len(tokens),
        max_model_len=engine.limits.max_model_len,
        token_strs=tokenizer.token_strings(tokens) if body.return_token_strs else None,
    )


async def _token_ids(engine: AsyncEngine, body: TokenizeRequest) -> list[int]:
    if body.content is not None:  # llama.cpp's: no special tokens unless asked for
        return await engine.encode_prompt(body.content, add_special_tokens=body.add_special)
    if body.messages is None:
        add_special_tokens = True if body.add_special_tokens is None else body.add_special_tokens
        return await engine.encode_prompt(body.prompt or "", add_special_tokens=add_special_tokens)
    return await engine.encode_chat(
        body.template_messages(),
        body.add_generation_prompt,
        body.continue_final_message,
        body.template_tools(),
        body.chat_template_kwargs,
        add_special_tokens=bool(body.add_special_tokens),
    )


@router.post("/detokenize", response_model=DetokenizeResponse)
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    engine = serving(request).engine_for(body.model)
    vocab_size = engine.limits.vocab_size
    if any(not 0 <= token < vocab_size for token in body.tokens):
        raise invalid_request(f"tokens must be token ids in [0, {vocab_size})", "invalid_value", "tokens")
    text = engine.tokenizer.decode(body.tokens)
    return DetokenizeResponse(prompt=text, content=text)


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request) -> dict[str, Any]:
    """The tokenizer's class and its configuration (tokenizer_config.json's fields, the chat template and the
    added tokens included), as vLLM's endpoint gives them."""
    return serving(request).ready_engine().tokenizer.info()
