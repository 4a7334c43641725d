"""HTTP-layer hardening: log injection, metric labels, unexpected 500s, lone surrogates, bodies cut short, the
auth scheme's case, and slow or idle connections (header timeout, connection cap).

Most run against an in-process server on a tiny random model; the log format and the connection guards are the
`pagedserve serve` command's, so those run against a subprocess started with `--header-timeout 1
--max-connections 4 --log-format text`.
"""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from pagedserve.engine import EngineConfig
from pagedserve.engine.client.async_engine import AsyncEngine
from pagedserve.server import ServerSettings, cli
from tests.raw_http import RawResponse, connect, http_series, read_response, request_bytes
from tests.servers import engine_and_url, free_port, server_process, serving

MODEL = "tiny"
KEY = "s3cret"
CONFIG = EngineConfig(num_kv_blocks=256, max_num_seqs=4)
HEADER_TIMEOUT = 1.0
MAX_CONNECTIONS = 4
SLACK = 3.0  # seconds: a busy 2-core machine runs the server's timers late
STARTUP_SECONDS = 180
LONE_HIGH, LONE_LOW = "\ud800", "\udfff"


# ---- servers and a raw HTTP/1.1 client -------------------------------------------------------------------------


engine, url = engine_and_url(CONFIG, ServerSettings([MODEL]), loaded="tiny_llama_loaded")


@pytest.fixture(scope="module")
def secured_url(engine: AsyncEngine) -> Iterator[str]:
    with serving(engine, ServerSettings([MODEL], api_key=KEY)) as url:
        yield url


@dataclass
class Served:
    process: subprocess.Popen
    url: str
    log: Path


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Callable[[str], Path]) -> Iterator[Served]:
    """`pagedserve serve` with text logs, a 1 s header timeout and room for 4 connections."""
    port = free_port()
    log = tmp_path_factory.mktemp("hardening") / "serve.log"
    command = [
        sys.executable, "-m", "pagedserve.server.cli", "serve", str(tiny_model_dir("llama")),
        "--served-model-name", MODEL, "--port", str(port), "--log-format", "text",
        "--header-timeout", str(HEADER_TIMEOUT), "--max-connections", str(MAX_CONNECTIONS),
        "--num-kv-blocks", "256", "--num-threads", "1",
    ]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    with server_process(command, url, log, STARTUP_SECONDS) as process:
        yield Served(process, url, log)


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes `sock` within `seconds` (reading and discarding whatever it sends)."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            if not sock.recv(65536):
                return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except TimeoutError:
            return False
    return False


def assert_openai_error(response: httpx.Response | RawResponse, status: int, code: str) -> dict:
    assert response.status_code == status if isinstance(response, httpx.Response) else response.status == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["code"] == code and error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    return error


# ---- 1. log injection ------------------------------------------------------------------------------------------


def wait_for_log(served: Served, needle: str, timeout: float = 10.0) -> str:
    """The log once `needle` is in it: the request log is written after the answer was sent."""
    deadline = time.monotonic() + timeout
    while needle not in (text := served.log.read_text()):
        assert time.monotonic() < deadline, f"{needle!r} never logged:\n{text[-3000:]}"
        time.sleep(0.1)
    return text


def test_client_text_cannot_forge_log_lines(served: Served) -> None:
    with connect(served.url) as sock:
        for path in ("/v1/x%0D%0Aforged", "/v1/y%1B[31mred"):
            sock.sendall(request_bytes("GET", path))
            assert read_response(sock).status == 404
    # The request log shows the path's characters as escapes; uvicorn's access log quotes it.
    wait_for_log(served, "GET /v1/x\\r\\nforged 404")
    text = wait_for_log(served, "GET /v1/y\\x1b[31mred 404")
    assert "/v1/x%0D%0Aforged" in text
    assert not any(line.startswith("forged") for line in text.split("\n")), text[-3000:]
    assert "\r" not in text and "\x1b" not in text


# ---- 2. metric labels ------------------------------------------------------------------------------------------


# Methods the HTTP parser knows (WebDAV's, RTSP's, ...) that are none of HTTP's standard ones.
UNCOMMON_METHODS = ("PROPFIND", "PROPPATCH", "MKCOL", "COPY", "MOVE", "LOCK", "UNLOCK", "REPORT", "PURGE", "LINK")


def test_uncommon_methods_are_counted_as_other(url: str) -> None:
    before = http_series(url)
    with httpx.Client(base_url=url) as client:
        for i in range(200):
            client.request(UNCOMMON_METHODS[i % len(UNCOMMON_METHODS)], "/v1/models" if i % 2 else "/nowhere")
    after = http_series(url)
    new = set(after) - set(before)
    assert len(new) <= 3, new  # other on /v1/models and unmatched, and the first scrape's own GET /metrics
    assert {method for _, method, _ in new} <= {"other", "GET"}
    assert sum(value for (_, method, _), value in after.items() if method == "other") >= 200


def test_made_up_methods_are_400_at_the_parser_and_never_counted(url: str) -> None:
    before = http_series(url)
    with connect(url) as sock:
        sock.sendall(request_bytes("FOO1", "/v1/models"))
        assert read_response(sock).status == 400
    assert http_series(url).keys() - before.keys() <= {("/metrics", "GET", "200")}


# ---- 3. unexpected exceptions ------------------------------------------------------------------------------------


def test_an_unexpected_exception_is_an_openai_500_with_the_request_id_on_a_kept_connection(
    url: str, engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    async def broken(*args: object, **kwargs: object) -> list[int]:
        raise RuntimeError("a bug")

    monkeypatch.setattr(engine, "encode_prompt", broken)
    caplog.set_level(logging.INFO)
    uvicorn_errors = logging.getLogger("uvicorn.error")  # it does not propagate to caplog's root handler
    uvicorn_errors.addHandler(caplog.handler)
    try:
        with connect(url) as sock:
            body = json.dumps({"prompt": "Hi"}).encode()
            sock.sendall(request_bytes("POST", "/tokenize", body, {"X-Request-Id": "boom-1"}))
            failed = read_response(sock)
            sock.sendall(request_bytes("GET", "/health"))
            after = read_response(sock)  # the same connection serves on
    finally:
        uvicorn_errors.removeHandler(caplog.handler)
    error = assert_openai_error(failed, 500, "internal_error")
    assert (error["message"], error["param"]) == ("internal server error", None)
    assert failed.headers["x-request-id"] == "boom-1" and "close" not in failed.headers.get("connection", "")
    assert after.status == 200
    tracebacks = [record for record in caplog.records if record.exc_info]
    assert len(tracebacks) == 1 and "boom-1" in tracebacks[0].getMessage()
    logged = [getattr(record, "fields", {}) for record in caplog.records if record.name == "pagedserve.requests"]
    assert [(line["status"], line["error"]) for line in logged if line["request_id"] == "boom-1"] == [
        (500, "internal_error")
    ]


# ---- 4. lone surrogates ------------------------------------------------------------------------------------------


def post_json(url: str, path: str, body: object) -> httpx.Response:
    """json.dumps writes a lone surrogate as a \\uXXXX escape, and a pair as two: what clients send."""
    content = json.dumps(body).encode()
    return httpx.post(f"{url}{path}", content=content, headers={"content-type": "application/json"}, timeout=60)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": f"a{LONE_HIGH}b"}]}),
        ("/v1/completions", {"model": MODEL, "prompt": LONE_LOW, "max_tokens": 1}),
        ("/v1/completions", {"model": MODEL, "prompt": ["ok", f"{LONE_LOW}{LONE_HIGH}"], "max_tokens": 1}),
        ("/tokenize", {"prompt": f"x{LONE_HIGH}"}),
        ("/tokenize", {"messages": [{"role": "user", "content": LONE_LOW}]}),
        ("/v1/completions", {"model": f"tiny{LONE_HIGH}", "prompt": "Hi", "max_tokens": 1}),
        ("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 1, "user": LONE_HIGH}),
    ],
    ids=["chat", "completion", "prompt list", "tokenize", "tokenize messages", "model", "an ignored field"],
)
def test_lone_surrogates_are_400_invalid_unicode(url: str, path: str, body: dict) -> None:
    error = assert_openai_error(post_json(url, path, body), 400, "invalid_unicode")
    assert error["param"] is None and "surrogate" in error["message"] and "Unicode" in error["message"]


def test_lone_surrogate_escapes_in_upper_case_and_without_a_content_type(url: str) -> None:
    body = b'{"prompt": "\\uDBFF"}'
    response = httpx.post(f"{url}/tokenize", content=body, headers={"content-type": "application/json"})
    assert_openai_error(response, 400, "invalid_unicode")
    assert_openai_error(httpx.post(f"{url}/tokenize", content=body), 400, "invalid_unicode")


def test_surrogate_pairs_and_escaped_backslashes_pass(url: str) -> None:
    emoji = post_json(url, "/tokenize", {"prompt": "smile \U0001f600"})  # sent as "\ud83d\ude00"
    assert emoji.status_code == 200 and emoji.json()["count"] > 0
    completion = post_json(url, "/v1/completions", {"model": MODEL, "prompt": "\U0001f600", "max_tokens": 1})
    assert completion.status_code == 200, completion.text
    backslash = post_json(url, "/tokenize", {"prompt": "\\ud800 is how JSON writes a surrogate"})  # plain text
    assert backslash.status_code == 200, backslash.text


# ---- 5. a body cut short -----------------------------------------------------------------------------------------


def test_a_client_gone_mid_body_is_499_and_the_app_never_runs(url: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="pagedserve.requests")
    route = "/v1/completions"
    before = http_series(url)
    with connect(url) as sock:
        headers = {"Content-Type": "application/json", "Content-Length": "1000", "X-Request-Id": "gone-1"}
        head = request_bytes("POST", route, headers=headers)
        sock.sendall(head + b'{"model": ')  # 10 of the 1000 bytes
    deadline = time.monotonic() + 10
    while http_series(url).get((route, "POST", "499"), 0) == before.get((route, "POST", "499"), 0):
        assert time.monotonic() < deadline, "no 499 was counted"
        time.sleep(0.05)
    after = http_series(url)
    assert after.get((route, "POST", "400"), 0) == before.get((route, "POST", "400"), 0)
    logged = [getattr(record, "fields", {}) for record in caplog.records if record.name == "pagedserve.requests"]
    assert [(line["status"], line["error"]) for line in logged if line["request_id"] == "gone-1"] == [
        (499, "client_closed")
    ]


# ---- 6. the auth scheme's case -----------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER", "bEaReR"])
def test_the_bearer_scheme_is_case_insensitive(secured_url: str, scheme: str) -> None:
    response = httpx.get(f"{secured_url}/v1/models", headers={"Authorization": f"{scheme} {KEY}"})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    "value", ["bearer nope", f"BEARER {KEY}x", f"Basic {KEY}", f"Bearer{KEY}", "bearer", KEY, f"bearer {KEY.upper()}"]
)
def test_wrong_credentials_are_still_401(secured_url: str, value: str) -> None:
    response = httpx.get(f"{secured_url}/v1/models", headers={"Authorization": value})
    assert_openai_error(response, 401, "invalid_api_key")


# ---- 7. slow and idle connections --------------------------------------------------------------------------------


def test_headers_past_the_cap_are_431_and_the_connection_closes(url: str) -> None:
    with connect(url) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        for _ in range(20):  # 100 KiB of one header, in pieces
            sock.sendall(b"X-Padding-" + b"a" * 5110 + b": b\r\n")
            time.sleep(0.01)
        refused = read_response(sock)
        assert closed_within(sock, SLACK)
    assert_openai_error(refused, 431, "request_headers_too_large")
    with connect(url) as sock:  # big but under the cap
        sock.sendall(request_bytes("GET", "/health", headers={"X-Padding": "a" * 32_000}))
        assert read_response(sock).status == 200


def test_trickled_headers_are_cut_off_at_the_header_timeout(served: Served) -> None:
    started = time.monotonic()
    with connect(served.url) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        closed = False
        while not closed and time.monotonic() - started < HEADER_TIMEOUT + SLACK:
            try:
                sock.sendall(b"a")  # one byte a second: each one would restart a per-byte timer
            except (BrokenPipeError, ConnectionResetError):
                break
            closed = closed_within(sock, 1.0)
        elapsed = time.monotonic() - started
    assert elapsed < HEADER_TIMEOUT + SLACK, f"still open after {elapsed:.1f} s"
    assert elapsed >= HEADER_TIMEOUT * 0.9


def test_idle_connections_count_against_the_cap_until_the_header_timeout(served: Served) -> None:
    time.sleep(0.5)  # the earlier tests' connections are closed on both ends
    idle = [connect(served.url) for _ in range(MAX_CONNECTIONS)]
    try:
        with connect(served.url) as extra:
            extra.sendall(request_bytes("GET", "/health"))
            refused = read_response(extra)
            assert closed_within(extra, SLACK)
        error = assert_openai_error(refused, 503, "too_many_connections")
        assert refused.headers["retry-after"] == "1" and refused.headers["connection"] == "close"
        assert "connections" in error["message"]
        for sock in idle:  # none sent a request: each is closed at the header timeout
            assert closed_within(sock, HEADER_TIMEOUT + SLACK)
    finally:
        for sock in idle:
            sock.close()
    assert httpx.get(f"{served.url}/health").status_code == 200  # room again


def test_keep_alive_requests_and_long_streams_are_not_under_the_header_timeout(served: Served) -> None:
    with connect(served.url) as sock:
        started = time.monotonic()
        for _ in range(5):  # five requests over ~2 s on one connection, each well within the timeout
            sock.sendall(request_bytes("GET", "/health"))
            assert read_response(sock).status == 200
            time.sleep(HEADER_TIMEOUT / 2)
        assert time.monotonic() - started > HEADER_TIMEOUT
        assert closed_within(sock, HEADER_TIMEOUT + SLACK)  # idle after its answer: the timeout runs again
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1800, "ignore_eos": True, "stream": True}
    started = time.monotonic()
    with httpx.stream("POST", f"{served.url}/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        data = [line for line in response.iter_lines() if line.startswith("data: ")]
    elapsed = time.monotonic() - started
    assert data[-1] == "data: [DONE]"
    assert elapsed > HEADER_TIMEOUT, f"the stream took {elapsed:.2f} s: too short to test anything"


def test_connection_flags() -> None:
    args = cli.build_parser().parse_args(["serve"])
    assert (args.header_timeout, args.max_connections) == (10.0, 1024)
    args = cli.build_parser().parse_args(["serve", "--header-timeout", "2.5", "--max-connections", "8"])
    assert (args.header_timeout, args.max_connections) == (2.5, 8)
    for bad in (["--header-timeout", "0"], ["--max-connections", "0"], ["--max-connections", "1.5"]):
        with pytest.raises(SystemExit):
            cli.build_parser().parse_args(["serve", *bad])
