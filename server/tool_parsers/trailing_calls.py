"""Formats whose calls follow one marker and run to the end of the reply (Mistral's, Phi-4-mini's)."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable

from pagedserve.server.tool_parsers import base

SectionCalls = Callable[[str], "list[base.ParsedToolCall] | None"]


class TrailingCallsParser(base.ToolParser):
    """Content, then `marker` and the calls up to the end of the reply.

    A subclass names the marker and reads the section that starts with it (`section_calls`: None when the
    section is not wholly calls, so the reply stays content)."""

    marker: str

    @abstractmethod
    def section_calls(self, section: str) -> list[base.ParsedToolCall] | None:
        """The calls to the declared functions in a section that starts with the marker."""

    def parse(self, text: str) -> base.ParsedReply:
        start = text.find(self.marker)
        if start < 0:
            return base.plain_reply(text)
        return base.reply_of(text[:start].rstrip(), self.section_calls(text[start:]), text)

    def stream(self) -> base.ToolCallStream:
        return _TrailingCallsStream(self.marker, self.section_calls, self.declared)


class _TrailingCallsStream(base.BufferedStream):
    """Content streams up to the marker; the calls after it are parsed once the reply has ended."""

    def __init__(self, marker: str, section_calls: SectionCalls, declared: base.Declared) -> None:
        super().__init__(base.Mode.CONTENT, declared)
        self._marker = marker
        self._section_calls = section_calls

    def _step(self, final: bool) -> bool:
        if self._mode is base.Mode.CONTENT:
            return self._content_until(self._marker, final)
        if final:
            calls = self._section_calls(self._buffer)
            if calls:
                for call in calls:
                    self._send_call(call)
            else:
                self._send_content(self._held_space + self._buffer)
            self._buffer = ""
        return False
