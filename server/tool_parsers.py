"""Tool calls out of the text a model wrote, whole (`parse`) or as it streams (`stream`).

Each model family writes its calls its own way; one parser per way, by name in PARSERS. The stream of a reply
agrees with `parse` of the whole reply whenever its calls are well formed: the content deltas, the call names
and each call's concatenated argument fragments are what `parse` returns. A reply with a malformed call is
plain content, with one exception in streams: a call already sent cannot be withdrawn, so a malformed call
after it streams as content.

Arguments are always `json.dumps` text (its default separators, non-ASCII kept as is), whatever spacing and
escapes the model used, so that streamed and whole replies match byte for byte.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import ClassVar, Literal, NamedTuple


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
    name: ClassVar[str]

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
_NOT_JSON = object()  # what `_load_json` gives for text that is not JSON (None is JSON's null)


def _load_json(text: str) -> object:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: absurdly deep nesting
        return _NOT_JSON


def _call_from_json(value: object) -> ParsedToolCall | None:
    """A `{"name": ..., "arguments" | "parameters": {...}}` object as a call; None when it is not one."""
    if not isinstance(value, dict):
        return None
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return None
    arguments: object = next((value[key] for key in ARGUMENT_KEYS if value.get(key) is not None), {})
    if isinstance(arguments, str):  # some models write the arguments object as a JSON string
        arguments = _load_json(arguments)
    if not isinstance(arguments, dict):
        return None
    return ParsedToolCall(name, arguments_json(arguments))


def _call_from_text(text: str) -> ParsedToolCall | None:
    return _call_from_json(_load_json(text))


def _all_calls(calls: list[ParsedToolCall | None]) -> list[ParsedToolCall] | None:
    """The calls when every one is well formed, else None (one malformed call makes the reply plain content)."""
    if any(call is None for call in calls):
        return None
    return [call for call in calls if call is not None]


def _plain(text: str) -> ParsedReply:
    return ParsedReply(text, [])


def _reply(content: str, calls: list[ParsedToolCall] | None, text: str) -> ParsedReply:
    """The calls and the content around them; the whole text as content when there are none or one is malformed."""
    if not calls:
        return _plain(text)
    return ParsedReply(content or None, calls)


def _partial_marker_length(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker`: the split may have cut the marker there."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:length]):
            return length
    return 0


def _coalesce(events: list[StreamEvent]) -> list[StreamEvent]:
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


class _Mode(Enum):
    OPENING = auto()  # the reply's start decides whether it holds calls
    CONTENT = auto()
    CALLS = auto()  # inside a call or the calls section
    AFTER_CALL = auto()  # whitespace after a call is dropped
    PLAIN = auto()  # no calls can come any more: the rest is content


class _BufferedStream(ToolCallStream):
    """A stream that keeps the text it cannot send yet in `_buffer` and sends whole calls once they are complete."""

    def __init__(self, mode: _Mode) -> None:
        self._mode = mode
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
        events, self._events = _coalesce(self._events), []
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
            sendable = sendable[: len(sendable) - _partial_marker_length(sendable, marker)].rstrip()
        self._send_content(sendable)
        self._buffer = self._buffer[len(sendable) :]
        return False

    def _send_all_as_content(self) -> bool:
        self._send_content(self._buffer)
        self._buffer = ""
        return False


# ---------------------------------------------------------------------------------------------------------------
# hermes: Qwen2.5, Qwen3, Hermes

HERMES_START = "<tool_call>"
HERMES_END = "</tool_call>"


class HermesParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, after content and between pieces of it.

    Content is the text outside the blocks, without the whitespace next to them. A last block left open by the
    end of the reply still counts when its JSON is complete.
    """

    name = "hermes"

    def parse(self, text: str) -> ParsedReply:
        content: list[str] = []
        calls: list[ParsedToolCall] = []
        rest = text
        while True:
            start = rest.find(HERMES_START)
            segment = rest if start < 0 else rest[:start]
            if calls:
                segment = segment.lstrip()
            if start < 0:
                content.append(segment)
                return _reply("".join(content), calls, text)
            content.append(segment.rstrip())
            body, _, rest = rest[start + len(HERMES_START) :].partition(HERMES_END)
            call = _call_from_text(body)
            if call is None:
                return _plain(text)
            calls.append(call)

    def stream(self) -> ToolCallStream:
        return _HermesStream()


class _HermesStream(_BufferedStream):
    """Sends each call whole at its `</tool_call>` (or at the end of the reply)."""

    def __init__(self) -> None:
        super().__init__(_Mode.CONTENT)

    def _step(self, final: bool) -> bool:
        if self._mode is _Mode.CONTENT:
            if not self._send_content_before(HERMES_START, final):
                return False
            self._mode = _Mode.CALLS
            return True
        if self._mode is _Mode.CALLS:
            return self._call_step(final)
        if self._mode is _Mode.AFTER_CALL:
            self._buffer = self._buffer.lstrip()
            if not self._buffer:
                return False
            self._mode = _Mode.CONTENT
            return True
        return self._send_all_as_content()

    def _call_step(self, final: bool) -> bool:
        block, end, rest = self._buffer.partition(HERMES_END)
        if not end and not final:
            return False
        call = _call_from_text(block[len(HERMES_START) :])
        if call is None:
            self._send_content(self._held_space + block + end)
            self._mode = _Mode.PLAIN
        else:
            self._send_call(call)
            self._mode = _Mode.AFTER_CALL
        self._held_space, self._buffer = "", rest
        return True


# ---------------------------------------------------------------------------------------------------------------
# llama3_json: Llama 3.x

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser(ToolParser):
    """The whole reply is calls: an optional `<|python_tag|>`, then `{"name": ..., "parameters": {...}}` objects
    separated by `;`. A reply that starts any other way is content."""

    name = "llama3_json"

    def parse(self, text: str) -> ParsedReply:
        body = text.strip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG) :]
        elif not body.startswith("{"):
            return _plain(text)
        return _reply("", _llama3_calls(body), text)

    def stream(self) -> ToolCallStream:
        return _Llama3Stream()


def _skip_space(text: str, position: int) -> int:
    while position < len(text) and text[position].isspace():
        position += 1
    return position


def _llama3_calls(body: str) -> list[ParsedToolCall] | None:
    decoder = json.JSONDecoder()
    calls: list[ParsedToolCall] = []
    position = _skip_space(body, 0)
    while position < len(body):
        try:
            value, position = decoder.raw_decode(body, position)
        except (ValueError, RecursionError):
            return None
        call = _call_from_json(value)
        if call is None:
            return None
        calls.append(call)
        position = _skip_space(body, position)
        if body.startswith(";", position):
            position = _skip_space(body, position + 1)
    return calls


class _Llama3Stream(_BufferedStream):
    """Content streams as it comes once the reply's start rules out calls; a reply of calls is parsed at its end
    (the model stops right after its calls, so little waits)."""

    def __init__(self) -> None:
        super().__init__(_Mode.OPENING)

    def _step(self, final: bool) -> bool:
        if self._mode is _Mode.OPENING:
            head = self._buffer.lstrip()
            if head.startswith(("{", PYTHON_TAG)):
                self._mode = _Mode.CALLS
            elif not final and PYTHON_TAG.startswith(head):
                return False
            else:
                self._mode = _Mode.PLAIN
            return True
        if self._mode is _Mode.PLAIN:
            return self._send_all_as_content()
        if final:
            self._send_reply(Llama3JsonParser().parse(self._buffer))
            self._buffer = ""
        return False


# ---------------------------------------------------------------------------------------------------------------
# mistral

MISTRAL_CALLS = "[TOOL_CALLS]"
MISTRAL_ARGS = "[ARGS]"
_FUNCTION_NAME = re.compile(r"[\w.\-]+")


class MistralParser(ToolParser):
    """Content, then `[TOOL_CALLS]` and the calls up to the end of the reply: either a JSON array
    `[{"name": ..., "arguments": {...}}, ...]` or, with newer tokenizers, `name[ARGS]{...}` (one per marker)."""

    name = "mistral"

    def parse(self, text: str) -> ParsedReply:
        start = text.find(MISTRAL_CALLS)
        if start < 0:
            return _plain(text)
        return _reply(text[:start].rstrip(), _mistral_calls(text[start:]), text)

    def stream(self) -> ToolCallStream:
        return _MistralStream()


def _mistral_calls(section: str) -> list[ParsedToolCall] | None:
    """The calls of a section that starts with `[TOOL_CALLS]`; None when any part of it is not a call."""
    calls: list[ParsedToolCall] = []
    for part in section.split(MISTRAL_CALLS)[1:]:
        part_calls = _mistral_part_calls(part.strip())
        if part_calls is None:
            return None
        calls += part_calls
    return calls


def _mistral_part_calls(part: str) -> list[ParsedToolCall] | None:
    if part.startswith("["):
        items = _load_json(part)
        if not isinstance(items, list):
            return None
        return _all_calls([_call_from_json(item) for item in items])
    name, has_arguments, arguments = part.partition(MISTRAL_ARGS)
    if not has_arguments or not _FUNCTION_NAME.fullmatch(name.strip()):
        return None
    return _all_calls([_call_from_json({"name": name.strip(), "arguments": _load_json(arguments)})])


class _MistralStream(_BufferedStream):
    """Content streams up to `[TOOL_CALLS]`; the calls after it are parsed at the end of the reply, which they
    run to."""

    def __init__(self) -> None:
        super().__init__(_Mode.CONTENT)

    def _step(self, final: bool) -> bool:
        if self._mode is _Mode.CONTENT:
            if not self._send_content_before(MISTRAL_CALLS, final):
                return False
            self._mode = _Mode.CALLS
            return True
        if final:
            calls = _mistral_calls(self._buffer)
            if calls:
                for call in calls:
                    self._send_call(call)
            else:
                self._send_content(self._held_space + self._buffer)
            self._buffer = ""
        return False


# ---------------------------------------------------------------------------------------------------------------
# json_array: the form a grammar forces for `tool_choice: "required"`


class JsonArrayParser(ToolParser):
    """The whole reply is `[{"name": ..., "parameters": {...}}, ...]`; "parameters" (or "arguments") may hold any
    JSON value, taken as it is.

    Its stream sends a call's name as soon as it is complete and its arguments as they arrive, rewritten as
    `json.dumps` would write them. An object with a key twice is the one case where they can differ from `parse`
    (which keeps the last value); the grammar writes each key once.
    """

    name = "json_array"

    def parse(self, text: str) -> ParsedReply:
        items = _load_json(text)
        if not isinstance(items, list):
            return _plain(text)
        return _reply("", _all_calls([_array_item_call(item) for item in items]), text)

    def stream(self) -> ToolCallStream:
        return _JsonArrayStream()


def _array_item_call(item: object) -> ParsedToolCall | None:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
        return None
    key = next((key for key in item if key in ARGUMENT_KEYS), None)  # the first, as the stream sees it
    return ParsedToolCall(item["name"], arguments_json(item[key] if key is not None else {}))


class _Kind(Enum):
    PUNCTUATION = auto()  # { } [ ] , :
    STRING_OPEN = auto()
    STRING_TEXT = auto()  # decoded characters of a string, as far as they have come
    STRING_CLOSE = auto()
    SCALAR = auto()  # a number or literal, as written


class _Token(NamedTuple):
    kind: _Kind
    text: str = ""


class _JsonTokenizer:
    """Cuts JSON text that arrives in pieces into tokens. String contents come out decoded as they arrive, but
    an escape cut short, or the first half of an escaped surrogate pair, waits for the rest."""

    def __init__(self) -> None:
        self._in_string = False
        self._escape = ""  # an escape sequence from its backslash, not complete yet
        self._high_surrogate = ""  # \ud800-\udbff, waiting for the low half of its pair
        self._string_text: list[str] = []
        self._scalar = ""  # complete only once a character that cannot belong to it arrives
        self._tokens: list[_Token] = []

    def feed(self, text: str) -> list[_Token]:
        for char in text:
            if self._in_string:
                self._string_char(char)
            else:
                self._structural_char(char)
        self._flush_string_text()
        tokens, self._tokens = self._tokens, []
        return tokens

    def close(self) -> list[_Token]:
        self._end_scalar()
        return self.feed("")

    def _structural_char(self, char: str) -> None:
        if char == '"':
            self._end_scalar()
            self._tokens.append(_Token(_Kind.STRING_OPEN))
            self._in_string = True
        elif char in "{}[],:":
            self._end_scalar()
            self._tokens.append(_Token(_Kind.PUNCTUATION, char))
        elif char.isspace():
            self._end_scalar()
        else:
            self._scalar += char

    def _end_scalar(self) -> None:
        if self._scalar:
            self._tokens.append(_Token(_Kind.SCALAR, self._scalar))
            self._scalar = ""

    def _string_char(self, char: str) -> None:
        if self._escape:
            self._escape += char
            if len(self._escape) == (6 if self._escape[1] == "u" else 2):
                self._add_string_char(_decode_escape(self._escape))
                self._escape = ""
        elif char == "\\":
            self._escape = char
        elif char == '"':
            self._string_text.append(self._high_surrogate)
            self._high_surrogate = ""
            self._flush_string_text()
            self._tokens.append(_Token(_Kind.STRING_CLOSE))
            self._in_string = False
        else:
            self._add_string_char(char)

    def _add_string_char(self, char: str) -> None:
        if self._high_surrogate:
            high, self._high_surrogate = self._high_surrogate, ""
            if len(char) == 1 and "\udc00" <= char <= "\udfff":
                char = (high + char).encode("utf-16", "surrogatepass").decode("utf-16")
            else:
                self._string_text.append(high)  # a lone half stays, as json.loads keeps it
        if len(char) == 1 and "\ud800" <= char <= "\udbff":
            self._high_surrogate = char
        else:
            self._string_text.append(char)

    def _flush_string_text(self) -> None:
        text = "".join(self._string_text)
        self._string_text = []
        if text:
            self._tokens.append(_Token(_Kind.STRING_TEXT, text))


def _decode_escape(escape: str) -> str:
    decoded = _load_json(f'"{escape}"')
    return decoded if isinstance(decoded, str) else escape  # an invalid escape stays as written


_SEPARATORS = {",": ", ", ":": ": "}


def _canonical(token: _Token) -> str:
    """The token as `json.dumps` writes it: its separators, its escapes, its way with numbers."""
    if token.kind is _Kind.PUNCTUATION:
        return _SEPARATORS.get(token.text, token.text)
    if token.kind is _Kind.STRING_TEXT:
        return arguments_json(token.text)[1:-1]
    if token.kind is _Kind.SCALAR:
        value = _load_json(token.text)
        return token.text if value is _NOT_JSON else arguments_json(value)
    return '"'


_Role = Literal["name", "arguments", "skip"]  # what a call object's value is read for


@dataclass
class _Value:
    """A value in a call object, followed to its last token."""

    role: _Role
    depth: int = 0
    text: list[str] = field(default_factory=list)  # a name's decoded pieces

    def ends_with(self, token: _Token) -> bool:
        if token.kind is _Kind.PUNCTUATION and token.text in "[{":
            self.depth += 1
        elif token.kind is _Kind.PUNCTUATION and token.text in "]}":
            self.depth -= 1
            return self.depth <= 0
        return self.depth == 0 and token.kind in (_Kind.STRING_CLOSE, _Kind.SCALAR)


@dataclass
class _ArrayCall:
    """The call object being read: its key, its value, and its arguments until the name starts the call."""

    index: int | None = None  # set once the call is started
    key: list[str] = field(default_factory=list)
    value: _Value | None = None
    has_arguments: bool = False
    held_arguments: list[str] = field(default_factory=list)


class _JsonArrayStream(ToolCallStream):
    """Reads the array token by token, following only what matters: each object's keys, its name and its
    arguments, which go out rewritten token by token."""

    def __init__(self) -> None:
        self._text = ""  # the whole reply so far: content after all when no call comes out of it
        self._mode = _Mode.OPENING
        self._tokenizer = _JsonTokenizer()
        self._containers: list[str] = []  # the brackets open outside values; ["[", "{"] is in a call object
        self._call = _ArrayCall()
        self._calls_started = 0

    def feed(self, text: str) -> list[StreamEvent]:
        self._text += text
        if self._mode is _Mode.OPENING:
            head = self._text.lstrip()
            if not head:
                return []
            self._mode = _Mode.CALLS if head.startswith("[") else _Mode.PLAIN
            text = self._text  # replayed from the start: the held whitespace too
        if self._mode is _Mode.PLAIN:
            return [ContentDelta(text)] if text else []
        return self._read(self._tokenizer.feed(text))

    def finish(self) -> list[StreamEvent]:
        events = self._read(self._tokenizer.close()) if self._mode is _Mode.CALLS else []
        if self._mode is not _Mode.PLAIN and self._calls_started == 0 and self._text:
            events.append(ContentDelta(self._text))
        return events

    def _read(self, tokens: list[_Token]) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        for token in tokens:
            value = self._call.value
            if value is not None:
                self._read_value(value, token, events)
            else:
                self._read_structure(token, events)
        return _coalesce(events)

    def _in_call_object(self) -> bool:
        return self._containers == ["[", "{"]

    def _read_structure(self, token: _Token, events: list[StreamEvent]) -> None:
        if token.kind is _Kind.PUNCTUATION and token.text in "[{":
            self._containers.append(token.text)
            if self._in_call_object():
                self._call = _ArrayCall()
        elif token.kind is _Kind.PUNCTUATION and token.text in "]}":
            if self._in_call_object():
                self._end_call(events)
            if self._containers:
                self._containers.pop()
        elif self._in_call_object():
            self._read_key(token)

    def _read_key(self, token: _Token) -> None:
        call = self._call
        if token.kind is _Kind.STRING_OPEN:
            call.key = []
        elif token.kind is _Kind.STRING_TEXT:
            call.key.append(token.text)
        elif token.kind is _Kind.PUNCTUATION and token.text == ":":
            call.value = _Value(self._role_of("".join(call.key)))
            call.has_arguments |= call.value.role == "arguments"

    def _role_of(self, key: str) -> _Role:
        if key == "name" and self._call.index is None:
            return "name"
        if key in ARGUMENT_KEYS and not self._call.has_arguments:
            return "arguments"
        return "skip"

    def _read_value(self, value: _Value, token: _Token, events: list[StreamEvent]) -> None:
        if value.role == "arguments":
            self._add_arguments(_canonical(token), events)
        elif value.role == "name" and token.kind is _Kind.STRING_TEXT:
            value.text.append(token.text)
        if value.ends_with(token):
            self._call.value = None
            if value.role == "name":
                self._start_call("".join(value.text), events)

    def _start_call(self, name: str, events: list[StreamEvent]) -> None:
        if not name:
            return
        call = self._call
        call.index = self._calls_started
        self._calls_started += 1
        events.append(ToolCallStart(call.index, name))
        if call.held_arguments:
            events.append(ToolArgumentsDelta(call.index, "".join(call.held_arguments)))
            call.held_arguments = []

    def _add_arguments(self, text: str, events: list[StreamEvent]) -> None:
        if self._call.index is None:
            self._call.held_arguments.append(text)
        else:
            events.append(ToolArgumentsDelta(self._call.index, text))

    def _end_call(self, events: list[StreamEvent]) -> None:
        if self._call.index is not None and not self._call.has_arguments:
            events.append(ToolArgumentsDelta(self._call.index, arguments_json({})))


# ---------------------------------------------------------------------------------------------------------------

PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesParser, Llama3JsonParser, MistralParser, JsonArrayParser)
}


def parser_for_template(chat_template: str | None) -> str:
    """The `tool_choice: "auto"` parser for a chat template, by the markers it writes."""
    template = chat_template or ""
    if HERMES_START in template:
        return HermesParser.name
    if PYTHON_TAG in template or "ipython" in template:
        return Llama3JsonParser.name
    if MISTRAL_CALLS in template:
        return MistralParser.name
    return HermesParser.name  # our default tool template writes Hermes-style blocks
