"""hermes: Qwen2.5, Qwen3, Hermes (`<tool_call>` blocks)."""

from __future__ import annotations

from pagedserve.server.tool_parsers import base

HERMES_START = "<tool_call>"
HERMES_END = "</tool_call>"


class HermesParser(base.ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, after content and between pieces of it.

    Content is the text outside the blocks, without the whitespace next to them. A last block left open by the
    end of the reply still counts when its JSON is complete.
    """

    name = "hermes"

    def parse(self, text: str) -> base.ParsedReply:
        content: list[str] = []
        calls: list[base.ParsedToolCall] = []
        rest = text
        while True:
            start = rest.find(HERMES_START)
            segment = rest if start < 0 else rest[:start]
            if calls:
                segment = segment.lstrip()
            if start < 0:
                content.append(segment)
                return base.reply_of("".join(content), calls, text)
            content.append(segment.rstrip())
            body, _, rest = rest[start + len(HERMES_START) :].partition(HERMES_END)
            call = base.call_from_text(body, self.declared)
            if call is None:
                return base.plain_reply(text)
            calls.append(call)

    def stream(self) -> base.ToolCallStream:
        return _HermesStream(self.declared)


class _HermesStream(base.BufferedStream):
    """Sends each call whole at its `</tool_call>` (or at the end of the reply)."""

    def __init__(self, declared: base.Declared) -> None:
        super().__init__(base.Mode.CONTENT, declared)

    def _step(self, final: bool) -> bool:
        if self._mode is base.Mode.CONTENT:
            return self._content_until(HERMES_START, final)
        if self._mode is base.Mode.CALLS:
            return self._call_step(final)
        if self._mode is base.Mode.AFTER_CALL:
            self._buffer = self._buffer.lstrip()
            if not self._buffer:
                return False
            self._mode = base.Mode.CONTENT
            return True
        return self._send_all_as_content()

    def _call_step(self, final: bool) -> bool:
        block, end, rest = self._buffer.partition(HERMES_END)
        if not end and not final:
            return False
        call = base.call_from_text(block[len(HERMES_START) :], self._declared)
        if call is None:
            self._send_content(self._held_space + block + end)
            self._mode = base.Mode.PLAIN
        else:
            self._send_call(call)
            self._mode = base.Mode.AFTER_CALL
        self._held_space, self._buffer = "", rest
        return True
