"""phi4_mini_json: Phi-4-mini (content, then `functools[...]`, a JSON list of calls)."""

from __future__ import annotations

from pagedserve.server.tool_parsers import base

FUNCTOOLS = "functools"
PHI4_TOOL_TAG = "<|tool|>"  # where Phi-4-mini's template lists the tools


class Phi4MiniJsonParser(base.ToolParser):
    """Content, then `functools[{"name": ..., "arguments": {...}}, ...]` up to the end of the reply."""

    name = "phi4_mini_json"

    def parse(self, text: str) -> base.ParsedReply:
        start = text.find(FUNCTOOLS)
        if start < 0:
            return base.plain_reply(text)
        return base.reply_of(text[:start].rstrip(), _functools_calls(text[start:], self.declared), text)

    def stream(self) -> base.ToolCallStream:
        return _Phi4MiniStream(self.declared)


def _functools_calls(section: str, declared: base.Declared) -> list[base.ParsedToolCall] | None:
    """The calls of a section that starts with `functools`; None when it is not a list of calls."""
    items = base.load_json(section[len(FUNCTOOLS) :].strip())
    if not isinstance(items, list):
        return None
    return base.all_calls([base.call_from_json(item, declared) for item in items])


class _Phi4MiniStream(base.BufferedStream):
    """Content streams up to `functools`; the list after it is parsed at the end of the reply, which it runs to."""

    def __init__(self, declared: base.Declared) -> None:
        super().__init__(base.Mode.CONTENT, declared)

    def _step(self, final: bool) -> bool:
        if self._mode is base.Mode.CONTENT:
            return self._content_until(FUNCTOOLS, final)
        if final:
            calls = _functools_calls(self._buffer, self._declared)
            if calls:
                for call in calls:
                    self._send_call(call)
            else:
                self._send_content(self._held_space + self._buffer)
            self._buffer = ""
        return False
