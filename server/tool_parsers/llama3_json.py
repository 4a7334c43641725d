"""llama3_json: Llama 3.x (`<|python_tag|>`, then JSON call objects)."""

from __future__ import annotations

import json

from pagedserve.server.tool_parsers import base

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser(base.ToolParser):
    """The whole reply is calls: an optional `<|python_tag|>`, then `{"name": ..., "parameters": {...}}` objects
    separated by `;`. A reply that starts any other way is content."""

    name = "llama3_json"

    def parse(self, text: str) -> base.ParsedReply:
        body = text.strip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG) :]
        elif not body.startswith("{"):
            return base.plain_reply(text)
        return base.reply_of("", _llama3_calls(body, self.declared), text)

    def stream(self) -> base.ToolCallStream:
        return _Llama3Stream(self.declared)


def _skip_space(text: str, position: int) -> int:
    while position < len(text) and text[position].isspace():
        position += 1
    return position


def _llama3_calls(body: str, declared: base.Declared) -> list[base.ParsedToolCall] | None:
    decoder = json.JSONDecoder()
    calls: list[base.ParsedToolCall] = []
    position = _skip_space(body, 0)
    while position < len(body):
        try:
            value, position = decoder.raw_decode(body, position)
        except (ValueError, RecursionError):
            return None
        call = base.call_from_json(value, declared)
        if call is None:
            return None
        calls.append(call)
        position = _skip_space(body, position)
        if body.startswith(";", position):
            position = _skip_space(body, position + 1)
    return calls


class _Llama3Stream(base.BufferedStream):
    """Content streams as it comes once the reply's start rules out calls; a reply of calls is parsed at its end
    (the model stops right after its calls, so little waits)."""

    def __init__(self, declared: base.Declared) -> None:
        super().__init__(base.Mode.OPENING, declared)

    def _step(self, final: bool) -> bool:
        if self._mode is base.Mode.OPENING:
            head = self._buffer.lstrip()
            if head.startswith(("{", PYTHON_TAG)):
                self._mode = base.Mode.CALLS
            elif not final and PYTHON_TAG.startswith(head):
                return False
            else:
                self._mode = base.Mode.PLAIN
            return True
        if self._mode is base.Mode.PLAIN:
            return self._send_all_as_content()
        if final:
            self._send_reply(Llama3JsonParser(self._declared).parse(self._buffer))
            self._buffer = ""
        return False
