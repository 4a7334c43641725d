"""Load shedding at the door (server/door.py, server/http_protocol.py): a generation request refused while its
headers are parsed gets the answer, the request-log line and the metrics the app would give, its body is dropped
and its connection serves on; a request the door is unsure of goes to the app; a place reserved at the door is
always given back."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn
from uvicorn.server import ServerState

from pagedserve.engine import EngineConfig, QueueFullError
from pagedserve.engine.client.async_engine import AsyncEngine
from pagedserve.engine.client.async_stream import Reservation
from pagedserve.engine.worker.model_loader import LoadedModel
from pagedserve.server import ServerSettings, create_app
from pagedserve.server.door import Door, Headers, Refusal
from pagedserve.server.http_protocol import guarded_protocol
from tests.background import BackgroundServer
from tests.raw_http import connect, http_series, read_response, read_responses, request_bytes
from tests.servers import running_engine

MODEL = "tiny"
KEY = "s3cret"
ORIGIN = "https://chat.example"
MAX_BODY = 2000
CONFIG = EngineConfig(num_kv_blocks=64, max_num_seqs=2, max_queue_len=2)
ROUTE = "/v1/chat/completions"
CHAT = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}).encode()


class CountingDoor(Door):
    """The server's door, counting the refusals it wrote itself."""

    refused = 0

    def admit(self, method: str, path: str, full_path: str, headers: Headers, state: dict[str, Any]) -> Refusal | None:
        refusal = super().admit(method, path, full_path, headers, state)
        self.refused += refusal is not None
        return refusal


@pytest.fixture(scope="module")
def engine(tiny_llama_loaded: LoadedModel) -> Iterator[AsyncEngine]:
    with running_engine(CONFIG, tiny_llama_loaded) as engine:
        yield engine


@contextlib.contextmanager
def server(engine: AsyncEngine, settings: ServerSettings) -> Iterator[tuple[str, CountingDoor]]:
    app = create_app(engine, settings)
    door = CountingDoor(app.state.serving)
    with BackgroundServer(app, http=guarded_protocol(10.0, 64, door)) as background:
        yield background.url, door


@pytest.fixture(scope="module")
def served(engine: AsyncEngine) -> Iterator[tuple[str, CountingDoor]]:
    with server(engine, ServerSettings([MODEL], max_request_bytes=MAX_BODY)) as served:
        yield served


def fill_queue(engine: AsyncEngine, leave: int = 0) -> list[Reservation]:
    """Reserves every free place in the waiting queue but `leave`."""
    held = []
    with contextlib.suppress(QueueFullError):
        while True:
            held.append(engine.reserve_place())
    for reservation in held[len(held) - leave :] if leave else []:
        reservation.release()
    return held[: len(held) - leave]


@contextlib.contextmanager
def full_queue(engine: AsyncEngine, leave: int = 0) -> Iterator[None]:
    held = fill_queue(engine, leave)
    try:
        yield
    finally:
        for reservation in held:
            reservation.release()


def free_places(engine: AsyncEngine) -> int:
    held = fill_queue(engine)
    for reservation in held:
        reservation.release()
    return len(held)


def wait_for_free_places(engine: AsyncEngine, expected: int, timeout: float = 10.0) -> int:
    """The free places once they are `expected` or the timeout passes: a place comes back just after the answer
    is sent, and the queue's bound follows the engine's last step."""
    deadline = time.monotonic() + timeout
    while (free := free_places(engine)) != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return free


def test_a_refusal_at_the_door_is_the_apps_refusal(
    served: tuple[str, CountingDoor], engine: AsyncEngine, caplog: pytest.LogCaptureFixture
) -> None:
    url, door = served
    caplog.set_level(logging.INFO, logger="pagedserve.requests")
    before, refused_before = http_series(url), door.refused
    with full_queue(engine), connect(url) as sock:
        sock.sendall(request_bytes("POST", ROUTE, CHAT, {"X-Request-Id": "door-1"}))
        at_door = read_response(sock)
        # The door leaves a request that closes its connection to the app, which refuses it there.
        sock.sendall(request_bytes("POST", ROUTE, CHAT, {"X-Request-Id": "app-1", "Connection": "close"}))
        in_app = read_response(sock)
    assert door.refused == refused_before + 1
    for response, request_id in ((at_door, "door-1"), (in_app, "app-1")):
        assert response.status == 503 and response.headers["retry-after"] == "1"
        assert response.headers["content-type"] == "application/json"
        assert response.headers["x-request-id"] == request_id
        assert response.json()["error"]["code"] == "queue_full"
    assert at_door.json() == in_app.json()
    after = http_series(url)
    assert after[ROUTE, "POST", "503"] == before.get((ROUTE, "POST", "503"), 0) + 2
    lines = {line["request_id"]: line for line in (getattr(r, "fields", {}) for r in caplog.records) if line}
    for request_id in ("door-1", "app-1"):
        assert (lines[request_id]["status"], lines[request_id]["error"]) == (503, "queue_full")
        assert (lines[request_id]["method"], lines[request_id]["path"]) == ("POST", ROUTE)


def test_a_refused_requests_body_is_dropped_and_its_connection_serves_on(
    served: tuple[str, CountingDoor], engine: AsyncEngine
) -> None:
    url, door = served
    refused_before = door.refused
    with full_queue(engine), connect(url) as sock:
        head, _, body = request_bytes("POST", ROUTE, CHAT).partition(b"\r\n\r\n")
        sock.sendall(head + b"\r\n\r\n")
        assert read_response(sock).status == 503  # answered before its body was sent
        sock.sendall(body[:10])
        sock.sendall(body[10:] + request_bytes("GET", "/health"))
        assert read_response(sock).status == 200
        # Pipelined: a refused request and the next one in one write.
        sock.sendall(request_bytes("POST", ROUTE, CHAT) + request_bytes("GET", "/v1/models"))
        refused, models = read_responses(sock, 2)
        assert refused.status == 503 and models.json()["data"][0]["id"] == MODEL
    assert door.refused == refused_before + 2


class RefuseEveryPost(Door):
    def __init__(self) -> None:  # no engine: every POST is refused
        pass

    def admit(self, method: str, path: str, full_path: str, headers: Headers, state: dict[str, Any]) -> Refusal | None:
        return Refusal(503, [(b"content-length", b"0")], b"") if method == "POST" else None


class Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.written, self.closed = b"", False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not self.closed:  # a closed socket sends nothing more
            self.written += bytes(data)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 8000) if name in ("peername", "sockname") else default

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def test_a_request_behind_a_refusal_in_the_same_chunk_outlives_the_keep_alive_timeout() -> None:
    """A refusal's end arms uvicorn's keep-alive timer mid-chunk; the request that follows must disarm it."""

    async def slow_app(scope: dict, receive: Any, send: Any) -> None:
        await asyncio.sleep(0.3)  # longer than the keep-alive timeout
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    async def serve() -> Transport:
        config = uvicorn.Config(slow_app, http=guarded_protocol(10.0, 64, RefuseEveryPost()), timeout_keep_alive=0.1)
        config.load()
        protocol = config.http_protocol_class(config=config, server_state=ServerState(), app_state={})
        transport = Transport()
        protocol.connection_made(transport)
        protocol.data_received(request_bytes("POST", ROUTE, b"{}") + request_bytes("GET", "/slow"))
        await asyncio.sleep(0.6)  # the answer, then the idle connection's keep-alive timeout
        return transport

    transport = asyncio.run(serve())
    assert transport.written.count(b"HTTP/1.1 ") == 2 and transport.written.endswith(b"ok")


def test_requests_the_door_is_unsure_of_go_to_the_app(engine: AsyncEngine) -> None:
    settings = ServerSettings([MODEL], api_key=KEY, cors_allowed_origins=[ORIGIN])
    with server(engine, settings) as (url, door), full_queue(engine):
        wrong = httpx.post(f"{url}{ROUTE}", content=CHAT, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and door.refused == 0
        headers = {"Authorization": f"Bearer {KEY}", "Origin": ORIGIN}
        from_origin = httpx.post(f"{url}{ROUTE}", content=CHAT, headers=headers)
        assert from_origin.status_code == 503 and from_origin.headers["access-control-allow-origin"] == ORIGIN
        assert door.refused == 0
        right = httpx.post(f"{url}{ROUTE}", content=CHAT, headers={"Authorization": f"bearer {KEY}"})
        assert right.status_code == 503 and door.refused == 1


def test_places_reserved_at_the_door_are_given_back(served: tuple[str, CountingDoor], engine: AsyncEngine) -> None:
    url, _ = served
    places = free_places(engine)
    with full_queue(engine, leave=1), httpx.Client(base_url=url, timeout=60) as client:
        too_big = client.post(ROUTE, content=b" " * (MAX_BODY + 1), headers={"Content-Type": "application/json"})
        assert too_big.status_code == 413
        assert client.post(ROUTE, content=b"{not json", headers={"Content-Type": "application/json"}).status_code == 400
        assert client.post(ROUTE, json={"model": "nope", "messages": []}).status_code in (400, 404)
        assert wait_for_free_places(engine, 1) == 1
        answer = client.post(ROUTE, content=CHAT, headers={"Content-Type": "application/json"})
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 2
    assert wait_for_free_places(engine, places) == places
