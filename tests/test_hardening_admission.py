"""Admission hardening, sent the way an attacker would (raw sockets): a queue place the door reserves comes back
whatever happens to its request (a duplicate Authorization header, a body that never arrives), and a JSON body
is read as JSON whatever its Content-Type says.

Against an in-process `pagedserve serve` protocol (door, header and body timeouts) on a tiny random model with
`--max-num-seqs 4 --max-queue-len 4`: 8 places in all.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from benchmarks.hostile_inputs import head_only, raw_post
from pagedserve.engine import EngineConfig, QueueFullError
from pagedserve.engine.client.async_engine import AsyncEngine
from pagedserve.engine.client.async_stream import Reservation
from pagedserve.server import ServerSettings, cli, create_app
from pagedserve.server.door import Door
from pagedserve.server.http_protocol import guarded_protocol
from tests.background import BackgroundServer
from tests.raw_http import RawResponse, connect, http_series, read_response, request_bytes
from tests.servers import Limits, engine_and_url, serving

MODEL = "tiny"
KEY = "s3cret"
CONFIG = EngineConfig(num_kv_blocks=128, max_num_seqs=4, max_queue_len=4)
PLACES = 8  # max_queue_len + the running batch's free seats
ROUTE = "/v1/chat/completions"
CHAT = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}).encode()
HEADER_TIMEOUT = 10.0
BODY_TIMEOUT = 1.0
SLACK = 3.0  # seconds: a busy 2-core machine runs the server's timers late


LIMITS = Limits(header_timeout=HEADER_TIMEOUT, max_connections=64, body_timeout=BODY_TIMEOUT)
engine, url = engine_and_url(CONFIG, ServerSettings([MODEL]), loaded="tiny_llama_loaded", limits=LIMITS)


@pytest.fixture(scope="module")
def secured_url(engine: AsyncEngine) -> Iterator[str]:
    with serving(engine, ServerSettings([MODEL], api_key=KEY), LIMITS) as url:
        yield url


def free_places(engine: AsyncEngine) -> int:
    held: list[Reservation] = []
    with contextlib.suppress(QueueFullError):
        while True:
            reservation = engine.reserve_place()
            assert reservation is not None
            held.append(reservation)
    for reservation in held:
        reservation.release()
    return len(held)


def wait_for_free_places(engine: AsyncEngine, expected: int, timeout: float = 10.0) -> int:
    """A place comes back just after its answer is sent: poll a little."""
    deadline = time.monotonic() + timeout
    while (free := free_places(engine)) != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return free


def exchange(url: str, request: bytes) -> RawResponse:
    with connect(url) as sock:
        sock.sendall(request)
        return read_response(sock)


def assert_openai_error(response: RawResponse, status: int, code: str) -> None:
    error = response.json()["error"]
    assert response.status == status, response.body
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code
    assert isinstance(error["message"], str) and error["message"]


def keyed_chat() -> bytes:
    return request_bytes("POST", ROUTE, CHAT, {"Authorization": f"Bearer {KEY}"})


# ---- 1. a duplicate Authorization header ------------------------------------------------------------------------


@pytest.mark.parametrize("order", ["wrong first", "right first"])
def test_a_duplicate_authorization_header_is_401_and_leaks_no_queue_place(
    secured_url: str, engine: AsyncEngine, order: str
) -> None:
    """The door and the key middleware read the same header the same way: two Authorization headers are refused
    once (401), whichever comes first; none of the ten keeps a queue place, so a keyed client is served after."""
    assert wait_for_free_places(engine, PLACES) == PLACES
    values = ["Bearer nope", f"Bearer {KEY}"]
    if order == "right first":
        values.reverse()
    headers = [("Content-Type", "application/json"), *(("Authorization", value) for value in values)]
    for _ in range(10):
        assert_openai_error(exchange(secured_url, raw_post(ROUTE, CHAT, headers)), 401, "invalid_api_key")
    assert wait_for_free_places(engine, PLACES) == PLACES
    answer = exchange(secured_url, keyed_chat())
    assert answer.status == 200, answer.body
    assert answer.json()["usage"]["completion_tokens"] == 2


async def answer_without_the_app(scope: dict, receive: Any, send: Any) -> None:
    """Stands for any middleware answering outside LoadSheddingMiddleware (or failing): it never sees the place."""
    if scope["type"] != "http":
        return
    if scope["path"] == "/v1/completions":
        raise RuntimeError("a bug")
    await send({"type": "http.response.start", "status": 401, "headers": [(b"content-length", b"0")]})
    await send({"type": "http.response.body", "body": b""})


def test_a_place_the_door_reserved_comes_back_whatever_answers_the_request(engine: AsyncEngine) -> None:
    """The door reserves a place for each of these; the app in front answers (or fails) without ever reaching
    LoadSheddingMiddleware: the places come back when each request's ASGI cycle ends."""
    assert wait_for_free_places(engine, PLACES) == PLACES
    door = Door(create_app(engine, ServerSettings([MODEL])).state.serving)
    protocol = guarded_protocol(HEADER_TIMEOUT, 64, door, body_timeout=BODY_TIMEOUT)
    with BackgroundServer(answer_without_the_app, http=protocol) as background:  # type: ignore[arg-type]
        for _ in range(PLACES):
            assert exchange(background.url, request_bytes("POST", ROUTE, CHAT)).status == 401
            assert exchange(background.url, request_bytes("POST", "/v1/completions", CHAT)).status == 500
        assert wait_for_free_places(engine, PLACES) == PLACES
        with connect(background.url) as sock:  # the door's answer when the places are held proves it reserved
            held = [engine.reserve_place() for _ in range(PLACES)]
            sock.sendall(request_bytes("POST", ROUTE, CHAT))
            assert read_response(sock).json()["error"]["code"] == "queue_full"
            for reservation in held:
                assert reservation is not None
                reservation.release()
    assert wait_for_free_places(engine, PLACES) == PLACES


def test_a_single_authorization_header_still_decides(secured_url: str) -> None:
    assert_openai_error(exchange(secured_url, request_bytes("POST", ROUTE, CHAT)), 401, "invalid_api_key")
    wrong = request_bytes("POST", ROUTE, CHAT, {"Authorization": "Bearer nope"})
    assert_openai_error(exchange(secured_url, wrong), 401, "invalid_api_key")
    assert exchange(secured_url, keyed_chat()).status == 200


# ---- 2. a body that never arrives -------------------------------------------------------------------------------


def closed_after_answer(sock: socket.socket) -> bool:
    """Whether the server closed the connection once its answer was read."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_bodies_that_never_arrive_are_408_and_give_their_places_back(url: str, engine: AsyncEngine) -> None:
    """Eight connections send whole headers and `Content-Length: 100`, then nothing: they hold every place only
    until the body timeout, when each gets an OpenAI-shaped 408 and is closed, and the places come back."""
    assert wait_for_free_places(engine, PLACES) == PLACES
    before = http_series(url)
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(connect(url, timeout=BODY_TIMEOUT + SLACK + 5)) for _ in range(PLACES)]
        started = time.monotonic()
        for sock in socks:
            sock.sendall(head_only(ROUTE))
        assert wait_for_free_places(engine, 0, timeout=SLACK) == 0  # every place held while the bodies are due
        for sock in socks:
            response = read_response(sock)
            assert_openai_error(response, 408, "body_timeout")
            assert response.headers["connection"] == "close"
            assert closed_after_answer(sock)
        assert time.monotonic() - started < BODY_TIMEOUT + SLACK
    assert wait_for_free_places(engine, PLACES) == PLACES
    with connect(url) as sock:
        sock.sendall(request_bytes("POST", ROUTE, CHAT))
        assert read_response(sock).status == 200
    after = http_series(url)
    assert after[ROUTE, "POST", "408"] == before.get((ROUTE, "POST", "408"), 0) + PLACES


def test_a_body_cut_short_is_408_too(url: str, engine: AsyncEngine) -> None:
    with connect(url, timeout=BODY_TIMEOUT + SLACK + 5) as sock:
        sock.sendall(head_only(ROUTE, len(CHAT)) + CHAT[:-5])
        assert_openai_error(read_response(sock), 408, "body_timeout")
        assert closed_after_answer(sock)
    assert wait_for_free_places(engine, PLACES) == PLACES


def test_a_large_first_read_or_a_pipelined_request_with_a_missing_body_is_408_too(
    url: str, engine: AsyncEngine
) -> None:
    """More than uvicorn buffers before it pauses reading, then nothing; and a request pipelined behind another
    whose body never comes: both are under the clock."""
    with connect(url, timeout=BODY_TIMEOUT + SLACK + 5) as sock:
        sock.sendall(head_only(ROUTE, 200_000) + b" " * 100_000)
        assert_openai_error(read_response(sock), 408, "body_timeout")
        assert closed_after_answer(sock)
    with connect(url, timeout=BODY_TIMEOUT + SLACK + 5) as sock:
        sock.sendall(request_bytes("POST", ROUTE, CHAT) + head_only(ROUTE))
        assert read_response(sock).status == 200
        assert_openai_error(read_response(sock), 408, "body_timeout")
        assert closed_after_answer(sock)
    assert wait_for_free_places(engine, PLACES) == PLACES


def test_a_body_sent_slowly_within_the_timeout_is_served_and_keep_alive_resets_the_clock(url: str) -> None:
    with connect(url) as sock:
        for _ in range(2):  # two requests on one connection: each body has its own clock
            sock.sendall(head_only(ROUTE, len(CHAT)))
            for piece in (CHAT[:10], CHAT[10:20], CHAT[20:]):
                time.sleep(BODY_TIMEOUT / 4)
                sock.sendall(piece)
            assert read_response(sock).status == 200
        time.sleep(BODY_TIMEOUT + 0.5)  # idle between requests: the header timeout's business, not the body's
        sock.sendall(request_bytes("GET", "/health"))
        assert read_response(sock).status == 200


# ---- 3. a JSON body under another content type ------------------------------------------------------------------


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_a_json_body_is_json_whatever_its_content_type(url: str, content_type: str | None) -> None:
    headers = [("Content-Type", content_type)] if content_type else []
    answer = exchange(url, raw_post(ROUTE, CHAT, headers))
    assert answer.status == 200, answer.body
    assert answer.json()["usage"]["completion_tokens"] == 2


def test_a_body_that_is_not_json_is_400_invalid_json_whatever_its_content_type(url: str) -> None:
    for headers in ([], [("Content-Type", "text/plain")]):
        response = exchange(url, raw_post(ROUTE, b"model=tiny", headers))
        assert response.status == 400 and response.json()["error"]["message"] == "the request body is not valid JSON"


def test_the_body_timeout_flag() -> None:
    assert cli.build_parser().parse_args(["serve"]).body_timeout == 10.0
    assert cli.build_parser().parse_args(["serve", "--body-timeout", "2.5"]).body_timeout == 2.5
    for bad in ("0", "-1", "nan"):
        with pytest.raises(SystemExit):
            cli.build_parser().parse_args(["serve", "--body-timeout", bad])
