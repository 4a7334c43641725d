"""phi4_mini_json: Phi-4-mini (content, then `functools[...]`, a JSON list of calls)."""

from __future__ import annotations

from pagedserve.server.tool_parsers import base
from pagedserve.server.tool_parsers.trailing_calls import TrailingCallsParser

FUNCTOOLS = "functools"
PHI4_TOOL_TAG = "<|tool|>"  # where Phi-4-mini's template lists the tools


class Phi4MiniJsonParser(TrailingCallsParser):
    """Content, then `functools[{"name": ..., "arguments": {...}}, ...]` up to the end of the reply."""

    name = "phi4_mini_json"
    marker = FUNCTOOLS

    def section_calls(self, section: str) -> list[base.ParsedToolCall] | None:
        items = base.load_json(section[len(FUNCTOOLS) :].strip())
        if not isinstance(items, list):
            return None
        return base.all_calls([base.call_from_json(item, self.declared) for item in items])
