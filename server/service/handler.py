"""Everything but generation: models, probes, version, tokenizer endpoints, metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import Response

from pagedserve.server.context import VERSION, serving
from pagedserve.server.errors import invalid_request, to_api_error
from pagedserve.server.service.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)

router = APIRouter()


@router.get("/v1/models", response_model=ModelList, tags=["openai"])
async def list_models(request: Request) -> ModelList:
    ctx = serving(request)
    max_model_len = ctx.ready_engine().limits.max_model_len
    names = ctx.settings.served_model_names
    return ModelList(data=[ModelCard(id=n, created=ctx.created, max_model_len=max_model_len) for n in names])


@router.get("/v1/models/{model_id:path}", response_model=ModelCard, tags=["openai"])
async def retrieve_model(model_id: str, request: Request) -> ModelCard:
    """One served name (ids may hold slashes, like hub names), or 404 model_not_found."""
    ctx = serving(request)
    ctx.check_model(model_id)
    return ModelCard(id=model_id, created=ctx.created, max_model_len=ctx.ready_engine().limits.max_model_len)


@router.get("/health", tags=["probes"])
async def health(request: Request) -> JSONResponse:
    """Liveness: fails when the engine core has died, and while it is wedged (silent, heartbeats included, for
    --engine-heartbeat-timeout seconds; 200 again once it answers). Loading counts as alive."""
    engine = serving(request).engine
    if not engine.is_healthy:
        return JSONResponse({"status": "unhealthy", "reason": engine.unavailable_reason()}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/ready", tags=["probes"])
async def ready(request: Request) -> JSONResponse:
    """Readiness: 200 once the model is loaded, 503 while loading, draining or while the core is wedged."""
    ctx = serving(request)
    if ctx.draining or not ctx.engine.is_ready:
        reason = "the server is shutting down" if ctx.draining else ctx.engine.unavailable_reason()
        return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)
    return JSONResponse({"status": "ready"})


@router.get("/version")
async def server_version() -> dict[str, str]:
    return {"version": VERSION}


@router.post("/tokenize", response_model=TokenizeResponse)
async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
    engine = serving(request).engine_for(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise invalid_request("send exactly one of prompt and messages", "invalid_value")
    try:
        if body.messages is not None:
            tokens = await engine.encode_chat([message.for_template() for message in body.messages])
        else:
            tokens = await engine.encode_prompt(body.prompt or "", add_special_tokens=body.add_special_tokens)
    except ValueError as exc:
        raise to_api_error(exc, "messages") from exc
    return TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=engine.limits.max_model_len)


@router.post("/detokenize", response_model=DetokenizeResponse)
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    engine = serving(request).engine_for(body.model)
    vocab_size = engine.limits.vocab_size
    if any(not 0 <= token < vocab_size for token in body.tokens):
        raise invalid_request(f"tokens must be token ids in [0, {vocab_size})", "invalid_value", "tokens")
    return DetokenizeResponse(prompt=engine.tokenizer.decode(body.tokens))


@router.post("/reset_prefix_cache", tags=["admin"])
async def reset_prefix_cache(request: Request) -> dict[str, int]:
    """Drops every cached prefix block (e.g. between benchmark runs); requests in flight carry on unaffected."""
    forgotten = await serving(request).ready_engine().reset_prefix_cache()
    return {"forgotten_blocks": forgotten}


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    return Response(serving(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)
