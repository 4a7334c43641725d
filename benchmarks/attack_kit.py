"""How the soak's attacks (benchmarks/hostile.py, benchmarks/hostile_constraints.py) are declared and sent.

An attack sends one request the way an attacker would (raw sockets where a client library would refuse) and returns
the status it got, or None when no answer is due (the attacker left first). Its planned statuses are declared
beside it: the soak counts any other as a failure. An answer with a planned status that is still wrong (an error
that is not OpenAI-shaped, a tool call to a tool nobody declared, ...) raises Unplanned.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

# While the waiting queue is full, generation requests are shed with 503 before their bodies are even read:
# deliberate, whatever the body holds.
SHED = frozenset({503})
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"


class Unplanned(Exception):
    """An answer with a planned status whose content is not what was planned."""


@dataclass(frozen=True)
class Target:
    """The server under attack: `client` sends the API key (if the server has one) on every request."""

    client: httpx.AsyncClient
    model: str
    api_key: str | None = None

    def key_headers(self) -> list[tuple[str, str]]:
        return [("Authorization", f"Bearer {self.api_key}")] if self.api_key else []


@dataclass(frozen=True)
class Attack:
    name: str
    planned: frozenset[int | None]
    send: Callable[[Target, random.Random], Awaitable[int | None]]
    heavy: bool = False  # seconds of CPU (long prompts, big grammars) or of waiting (a body timeout) per request


def planned(*statuses: int | None, shed: bool = True) -> frozenset[int | None]:
    """These statuses, and the deliberate 503 of a full queue unless the request is never shed (`shed=False`)."""
    return frozenset(statuses) | (SHED if shed else frozenset())


def chat_body(model: str, **fields: object) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **fields}


async def post(target: Target, path: str, body: dict, timeout: float | None = None) -> httpx.Response:
    """POSTs `body` as JSON (`timeout`: seconds, else the client's); an error answer must be OpenAI-shaped."""
    wait = httpx.USE_CLIENT_DEFAULT if timeout is None else httpx.Timeout(timeout)
    response = await target.client.post(path, json=body, timeout=wait)
    if response.status_code >= 400:
        check_openai_error(response)
    return response


async def post_status(target: Target, path: str, body: dict) -> int:
    return (await post(target, path, body)).status_code


def check_openai_error(response: httpx.Response) -> None:
    try:
        error = response.json()["error"]
        shaped = set(error) == {"message", "type", "param", "code"} and isinstance(error["code"], str)
    except (ValueError, KeyError, TypeError):
        shaped = False
    if not shaped:
        raise Unplanned(f"{response.status_code} without an OpenAI error: {response.text[:200]}")


async def send_raw(target: Target, chunks: list[bytes], pause: float) -> None:
    """Writes `chunks` `pause` seconds apart on a fresh connection, then leaves without reading."""
    _, writer = await _connect(target)
    try:
        for chunk in chunks:
            writer.write(chunk)
            await writer.drain()
            await asyncio.sleep(pause)
    except ConnectionError:
        pass  # the server hung up on it first: what it should do to a slow attacker
    finally:
        writer.close()


async def exchange_raw(target: Target, request: bytes, timeout: float = 60.0) -> int | None:
    """Writes `request` on a fresh connection and returns the status of the answer (None if the server closed the
    connection without one, or none came within `timeout`)."""
    reader, writer = await _connect(target)
    try:
        writer.write(request)
        await writer.drain()
        status_line = await asyncio.wait_for(reader.readline(), timeout)
    except (ConnectionError, asyncio.TimeoutError):
        return None
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    parts = status_line.split()
    return int(parts[1]) if len(parts) >= 2 and parts[1].isdigit() else None


async def _connect(target: Target) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    address = urlsplit(str(target.client.base_url))
    return await asyncio.open_connection(address.hostname, address.port)
