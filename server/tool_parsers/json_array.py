"""json_array: the form a grammar forces for `tool_choice: "required"`."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Literal, NamedTuple

from pagedserve.server.tool_parsers import base


class JsonArrayParser(base.ToolParser):
    """The whole reply is `[{"name": ..., "parameters": {...}}, ...]`; "parameters" (or "arguments") may hold any
    JSON value, taken as it is.

    Its stream sends a call's name as soon as it is complete and its arguments as they arrive, rewritten as
    `json.dumps` would write them. An object with a key twice is the one case where they can differ from `parse`
    (which keeps the last value); the grammar writes each key once. The grammar also writes only the declared
    names, so `declared` is not consulted.
    """

    name = "json_array"

    def parse(self, text: str) -> base.ParsedReply:
        items = base.load_json(text)
        if not isinstance(items, list):
            return base.plain_reply(text)
        return base.reply_of("", base.all_calls([_array_item_call(item) for item in items]), text)

    def stream(self) -> base.ToolCallStream:
        return _JsonArrayStream()


def _array_item_call(item: object) -> base.ParsedToolCall | None:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
        return None
    key = next((key for key in item if key in base.ARGUMENT_KEYS), None)  # the first, as the stream sees it
    return base.ParsedToolCall(item["name"], base.arguments_json(item[key] if key is not None else {}))


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
    decoded = base.load_json(f'"{escape}"')
    return decoded if isinstance(decoded, str) else escape  # an invalid escape stays as written


_SEPARATORS = {",": ", ", ":": ": "}


def _canonical(token: _Token) -> str:
    """The token as `json.dumps` writes it: its separators, its escapes, its way with numbers."""
    if token.kind is _Kind.PUNCTUATION:
        return _SEPARATORS.get(token.text, token.text)
    if token.kind is _Kind.STRING_TEXT:
        return base.arguments_json(token.text)[1:-1]
    if token.kind is _Kind.SCALAR:
        value = base.load_json(token.text)
        return token.text if value is base.NOT_JSON else base.arguments_json(value)
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


class _JsonArrayStream(base.ToolCallStream):
    """Reads the array token by token, following only what matters: each object's keys, its name and its
    arguments, which go out rewritten token by token."""

    def __init__(self) -> None:
        self._text = ""  # the whole reply so far: content after all when no call comes out of it
        self._mode = base.Mode.OPENING
        self._tokenizer = _JsonTokenizer()
        self._containers: list[str] = []  # the brackets open outside values; ["[", "{"] is in a call object
        self._call = _ArrayCall()
        self._calls_started = 0

    def feed(self, text: str) -> list[base.StreamEvent]:
        self._text += text
        if self._mode is base.Mode.OPENING:
            head = self._text.lstrip()
            if not head:
                return []
            self._mode = base.Mode.CALLS if head.startswith("[") else base.Mode.PLAIN
            text = self._text  # replayed from the start: the held whitespace too
        if self._mode is base.Mode.PLAIN:
            return [base.ContentDelta(text)] if text else []
        return self._read(self._tokenizer.feed(text))

    def finish(self) -> list[base.StreamEvent]:
        events = self._read(self._tokenizer.close()) if self._mode is base.Mode.CALLS else []
        if self._mode is not base.Mode.PLAIN and self._calls_started == 0 and self._text:
            events.append(base.ContentDelta(self._text))
        return events

    def _read(self, tokens: list[_Token]) -> list[base.StreamEvent]:
        events: list[base.StreamEvent] = []
        for token in tokens:
            value = self._call.value
            if value is not None:
                self._read_value(value, token, events)
            else:
                self._read_structure(token, events)
        return base.coalesce(events)

    def _in_call_object(self) -> bool:
        return self._containers == ["[", "{"]

    def _read_structure(self, token: _Token, events: list[base.StreamEvent]) -> None:
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
        if key in base.ARGUMENT_KEYS and not self._call.has_arguments:
            return "arguments"
        return "skip"

    def _read_value(self, value: _Value, token: _Token, events: list[base.StreamEvent]) -> None:
        if value.role == "arguments":
            self._add_arguments(_canonical(token), events)
        elif value.role == "name" and token.kind is _Kind.STRING_TEXT:
            value.text.append(token.text)
        if value.ends_with(token):
            self._call.value = None
            if value.role == "name":
                self._start_call("".join(value.text), events)

    def _start_call(self, name: str, events: list[base.StreamEvent]) -> None:
        if not name:
            return
        call = self._call
        call.index = self._calls_started
        self._calls_started += 1
        events.append(base.ToolCallStart(call.index, name))
        if call.held_arguments:
            events.append(base.ToolArgumentsDelta(call.index, "".join(call.held_arguments)))
            call.held_arguments = []

    def _add_arguments(self, text: str, events: list[base.StreamEvent]) -> None:
        if self._call.index is None:
            self._call.held_arguments.append(text)
        else:
            events.append(base.ToolArgumentsDelta(self._call.index, text))

    def _end_call(self, events: list[base.StreamEvent]) -> None:
        if self._call.index is not None and not self._call.has_arguments:
            events.append(base.ToolArgumentsDelta(self._call.index, base.arguments_json({})))
