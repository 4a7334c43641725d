"""The chat and status page at `/`: static files shipped in the package, served from memory.

The page uses relative URLs only, so a proxy that serves the API under a prefix serves the page there too.
Behind `--root-path`, the page gets a `<base href>` naming the prefix, so that `/prefix` (no trailing
slash) still resolves `v1/...` under the prefix.
"""

from __future__ import annotations

import html
from importlib import resources
from typing import TYPE_CHECKING

from fastapi import APIRouter, HTTPException, Request
from starlette.responses import Response

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

PAGE_PATH = "/"
ASSET_PREFIX = "/web/"
_MEDIA_TYPES = {".js": "text/javascript", ".css": "text/css", ".svg": "image/svg+xml"}
_BASE_MARKER = "<!-- base -->"
# A few small files, fetched afresh on each load: an upgraded server never runs an old page from a cache.
_HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}
_PAGE_HEADERS = {
    **_HEADERS,
    # Everything the page loads comes from this server; model output can never bring in a script.
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'self'",
    "X-Frame-Options": "DENY",
}


def _web_folder() -> Traversable:
    return resources.files("pagedserve.server") / "web"


def _read_assets() -> dict[str, bytes]:
    """The files the page loads, by name (index.html is the page itself, not an asset)."""
    entries = _web_folder().iterdir()
    return {entry.name: entry.read_bytes() for entry in entries if entry.name.endswith(tuple(_MEDIA_TYPES))}


def _media_type(name: str) -> str:
    return _MEDIA_TYPES["." + name.rpartition(".")[2]]


def page_paths() -> frozenset[str]:
    """Every path the page serves: they carry no API key (the page asks for it, then sends it to the API)."""
    return frozenset({PAGE_PATH, *(ASSET_PREFIX + name for name in _read_assets())})


def page_html(template: str, root_path: str) -> str:
    """The page, with a <base href> naming the root path when the server has one."""
    base = f'<base href="{html.escape(root_path.rstrip("/"), quote=True)}/">' if root_path else ""
    return template.replace(_BASE_MARKER, base, 1)


def web_page_router() -> APIRouter:
    """GET / and GET /web/<file>; the files are read once, here."""
    router = APIRouter(include_in_schema=False)
    assets = _read_assets()
    template = (_web_folder() / "index.html").read_text(encoding="utf-8")

    @router.get(PAGE_PATH)
    async def page(request: Request) -> Response:
        body = page_html(template, request.scope.get("root_path", ""))
        return Response(body, media_type="text/html; charset=utf-8", headers=_PAGE_HEADERS)

    @router.get(ASSET_PREFIX + "{name}")
    async def asset(name: str) -> Response:
        if name not in assets:
            raise HTTPException(404, "Not Found")
        return Response(assets[name], media_type=_media_type(name), headers=_HEADERS)

    return router
