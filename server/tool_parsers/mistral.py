"""mistral: `[TOOL_CALLS]`, then the calls."""

from __future__ import annotations

import re

from pagedserve.server.tool_parsers import base

MISTRAL_CALLS = "[TOOL_CALLS]"
MISTRAL_ARGS = "[ARGS]"
_FUNCTION_NAME = re.compile(r"[\w.\-]+")


class MistralParser(base.ToolParser):
    """Content, then `[TOOL_CALLS]` and the calls up to the end of the reply: either a JSON array
    `[{"name": ..., "arguments": {...}}, ...]` or, with newer tokenizers, `name[ARGS]{...}` (one per marker)."""

    name = "mistral"

    def parse(self, text: str) -> base.ParsedReply:
        start = text.find(MISTRAL_CALLS)
        if start < 0:
            return base.plain_reply(text)
        return base.reply_of(text[:start].rstrip(), _mistral_calls(text[start:], self.declared), text)

    def stream(self) -> base.ToolCallStream:
        return _MistralStream(self.declared)


def _mistral_calls(section: str, declared: base.Declared) -> list[base.ParsedToolCall] | None:
    """The calls of a section that starts with `[TOOL_CALLS]`; None when any part of it is not a call."""
    calls: list[base.ParsedToolCall] = []
    for part in section.split(MISTRAL_CALLS)[1:]:
        part_calls = _mistral_part_calls(part.strip(), declared)
        if part_calls is None:
            return None
        calls += part_calls
    return calls


def _mistral_part_calls(part: str, declared: base.Declared) -> list[base.ParsedToolCall] | None:
    if part.startswith("["):
        items = base.load_json(part)
        if not isinstance(items, list):
            return None
        return base.all_calls([base.call_from_json(item, declared) for item in items])
    name, has_arguments, arguments = part.partition(MISTRAL_ARGS)
    if not has_arguments or not _FUNCTION_NAME.fullmatch(name.strip()):
        return None
    call = {"name": name.strip(), "arguments": base.load_json(arguments)}
    return base.all_calls([base.call_from_json(call, declared)])


class _MistralStream(base.BufferedStream):
    """Content streams up to `[TOOL_CALLS]`; the calls after it are parsed at the end of the reply, which they
    run to."""

    def __init__(self, declared: base.Declared) -> None:
        super().__init__(base.Mode.CONTENT, declared)

    def _step(self, final: bool) -> bool:
        if self._mode is base.Mode.CONTENT:
            return self._content_until(MISTRAL_CALLS, final)
        if final:
            calls = _mistral_calls(self._buffer, self._declared)
            if calls:
                for call in calls:
                    self._send_call(call)
            else:
                self._send_content(self._held_space + self._buffer)
            self._buffer = ""
        return False
