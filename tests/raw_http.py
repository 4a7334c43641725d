"""A bare HTTP/1.1 client over a socket, for tests that need to control bytes on the wire, and the HTTP metrics."""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families


def connect(url: str, timeout: float = 30.0) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=timeout)


def request_bytes(method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1"]
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    if body is not None:
        lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b"")


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> dict:
        return json.loads(self.body)


def read_response(sock: socket.socket) -> RawResponse:
    """One response with a Content-Length (what every non-streamed answer here has), leaving the connection open."""
    (response,) = read_responses(sock, 1)
    return response


def read_responses(sock: socket.socket, count: int) -> list[RawResponse]:
    """The next `count` responses, for pipelined requests: their bytes may come in one read."""
    data, responses = b"", []
    while len(responses) < count:
        while b"\r\n\r\n" not in data:
            data += _receive(sock, f"the connection closed mid-response: {data!r}")
        head, _, data = data.partition(b"\r\n\r\n")
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        headers = {name.lower(): value.strip() for name, _, value in (line.partition(":") for line in header_lines)}
        length = int(headers["content-length"])
        while len(data) < length:
            data += _receive(sock, "the connection closed mid-body")
        responses.append(RawResponse(int(status_line.split()[1]), headers, data[:length]))
        data = data[length:]
    assert not data, f"bytes past the last response: {data!r}"
    return responses


def _receive(sock: socket.socket, closed_message: str) -> bytes:
    chunk = sock.recv(65536)
    assert chunk, closed_message
    return chunk


def http_series(url: str) -> dict[tuple[str, str, str], float]:
    """pagedserve:http_requests_total by (route, method, status)."""
    series = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            if sample.name == "pagedserve:http_requests_total":
                labels = sample.labels
                series[labels["route"], labels["method"], labels["status"]] = sample.value
    return series
