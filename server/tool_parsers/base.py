"""What the tool-call parsers share: the parsed calls and stream events, the parser interfaces, reading a
call's JSON, and the buffered stream the marker formats use."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import ClassVar

Declared = frozenset[str] | None  # the names calls may have; None: any (a parser used on its own)


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # JSON text, as `arguments_json` writes it


@dataclass
class ParsedReply:
    content: str | None  # None when the reply is only calls
    tool_calls: list[ParsedToolCall] = field(default_factory=list)


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int
    name: str


@dataclass(frozen=True)
class ToolArgumentsDelta:
    index: int
    text: str


StreamEvent = ContentDelta | ToolCallStart | ToolArgumentsDelta


class ToolCallStream(ABC):
    """Follows one streamed reply: `feed` it each text delta as it comes, then `finish` it once."""

    @abstractmethod
    def feed(self, text: str) -> list[StreamEvent]: ...

    @abstractmethod
    def finish(self) -> list[StreamEvent]: ...


class ToolParser(ABC):
    """Reads calls to the `declared` functions: a call to any other name makes a malformed call (content)."""

    name: ClassVar[str]

    def __init__(self, declared: Iterable[str] | None = None) -> None:
        self.declared: Declared = None if declared is None else frozenset(declared)

    @abstractmethod
    def parse(self, text: str) -> ParsedReply:
        """The calls in a whole reply and the content around them; never raises."""

    @abstractmethod
    def stream(self) -> ToolCallStream:
        """A fresh incremental parser for one streamed reply."""


def arguments_json(arguments: object) -> str:
    return json.dumps(arguments, ensure_ascii=False)


# ---------------------------------------------------------------------------------------------------------------
# Shared helpers

ARGUMENT_KEYS = ("arguments", "parameters")
NOT_JSON = object()  # what `load_json` gives for text that is not JSON (None is JSON's null)


def load_json(text: str) -> object:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: absurdly deep nesting
        return NOT_JSON


def call_from_json(value: object, declared: Declared = None) -> ParsedToolCall | None:
    """A `{"name": ..., "arguments" | "parameters": {...}}` object as a call; None when it is not one, or calls a
    function that is not declared."""
    if not isinstance(value, dict):
        return None
    name = value.get("name")
    if not isinstance(name, str) or not name or (declared is not None and name not in declared):
        return None
    arguments: object = next((value[key] for key in ARGUMENT_KEYS if value.get(key) is not None), {})
    if isinstance(arguments, str):  # some models write the arguments object as a JSON string
        arguments = load_json(arguments)
    if not isinstance(arguments, dict):
        return None
    return ParsedToolCall(name, arguments_json(arguments))


def call_from_text(text: str, declared: Declared = None) -> ParsedToolCall | None:
    return call_from_json(load_json(text), declared)


def all_calls(calls: list[ParsedToolCall | None]) -> list[ParsedToolCall] | None:
    """The calls when every one is well formed, else None (one malformed call makes the reply plain content)."""
    if any(call is None for call in calls):
        return None
    return [call for call in calls if call is not None]


def plain_reply(text: str) -> ParsedReply:
    return ParsedReply(text, [])


def reply_of(content: str, calls: list[ParsedToolCall] | None, text: str) -> ParsedReply:
    """The calls and the content around them; the whole text as content when there are none or one is malformed."""
    if not calls:
        return plain_reply(text)
    return ParsedReply(content or None, calls)


def partial_marker_length(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker`: the split may have cut the marker there."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:length]):
            return length
    return 0


def coalesce(events: list[StreamEvent]) -> list[StreamEvent]:
    """Joins neighbouring content deltas, and neighbouring argument deltas of one call."""
    merged: list[StreamEvent] = []
    for event in events:
        previous = merged[-1] if merged else None
        if isinstance(event, ContentDelta) and isinstance(previous, ContentDelta):
            merged[-1] = ContentDelta(previous.text + event.text)
        elif (
            isinstance(event, ToolArgumentsDelta)
            and isinstance(previous, ToolArgumentsDelta)
            and previous.index == event.index
        ):
            merged[-1] = ToolArgumentsDelta(event.index, previous.text + event.text)
        else:
            merged.append(event)
    return merged


class Mode(Enum):
    OPENING = auto()  # the reply's start decides whether it holds calls
    CONTENT = auto()
    CALLS = auto()  # inside a call or the calls section
    AFTER_CALL = auto()  # whitespace after a call is dropped
    PLAIN = auto()  # no calls can come any more: the rest is content


class BufferedStream(ToolCallStream):
    """A stream that keeps the text it cannot send yet in `_buffer` and sends whole calls once they are complete."""

    def __init__(self, mode: Mode, declared: Declared) -> None:
        self._mode = mode
        self._declared = declared
        self._buffer = ""
        self._held_space = ""  # whitespace before a call marker: content only if the call turns out malformed
        self._calls_sent = 0
        self._events: list[StreamEvent] = []

    def feed(self, text: str) -> list[StreamEvent]:
        self._buffer += text
        return self._drain(final=False)

    def finish(self) -> list[StreamEvent]:
        return self._drain(final=True)

    @abstractmethod
    def _step(self, final: bool) -> bool:
        """Handles what it can of the buffer; True when another step may do more."""

    def _drain(self, final: bool) -> list[StreamEvent]:
        while self._step(final):
            pass
        events, self._events = coalesce(self._events), []
        return events

    def _send_content(self, text: str) -> None:
        if text:
            self._events.append(ContentDelta(text))

    def _send_call(self, call: ParsedToolCall) -> None:
        index = self._calls_sent
        self._events += [ToolCallStart(index, call.name), ToolArgumentsDelta(index, call.arguments)]
        self._calls_sent += 1

    def _send_reply(self, reply: ParsedReply) -> None:
        self._send_content(reply.content or "")
        for call in reply.tool_calls:
            self._send_call(call)

    def _send_content_before(self, marker: str, final: bool) -> bool:
        """Sends the content ahead of `marker`; True once the marker is found, the buffer then starting with it.

        Trailing whitespace waits for what follows it, since it is dropped before a call, and so does an end of
        the buffer that may be the marker's beginning.
        """
        start = self._buffer.find(marker)
        if start >= 0:
            before = self._buffer[:start]
            self._send_content(before.rstrip())
            self._held_space = before[len(before.rstrip()) :]
            self._buffer = self._buffer[start:]
            return True
        sendable = self._buffer
        if not final:
            sendable = sendable[: len(sendable) - partial_marker_length(sendable, marker)].rstrip()
        self._send_content(sendable)
        self._buffer = self._buffer[len(sendable) :]
        return False

    def _content_until(self, marker: str, final: bool) -> bool:
        """The CONTENT step of a format whose calls start at `marker`: its content is sent; once the marker is
        found, the calls begin (True)."""
        if not self._send_content_before(marker, final):
            return False
        self._mode = Mode.CALLS
        return True

    def _send_all_as_content(self) -> bool:
        self._send_content(self._buffer)
        self._buffer = ""
        return False
