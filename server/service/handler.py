"""Everything but generation and tokenizing: models, probes, version, the prefix cache, metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import Response

from pagedserve.server.context import VERSION, serving
from pagedserve.server.service.protocol import ModelCard, ModelList

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


@router.post("/reset_prefix_cache", tags=["admin"])
async def reset_prefix_cache(request: Request) -> dict[str, int]:
    """Drops every cached prefix block (e.g. between benchmark runs); requests in flight carry on unaffected."""
    forgotten = await serving(request).ready_engine().reset_prefix_cache()
    return {"forgotten_blocks": forgotten}


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    return Response(serving(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)
