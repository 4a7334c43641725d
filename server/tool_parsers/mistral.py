"""mistral: `[TOOL_CALLS]`, then the calls."""

from __future__ import annotations

import re

from pagedserve.server.tool_parsers import base
from pagedserve.server.tool_parsers.trailing_calls import TrailingCallsParser

MISTRAL_CALLS = "[TOOL_CALLS]"
MISTRAL_ARGS = "[ARGS]"
_FUNCTION_NAME = re.compile(r"[\w.\-]+")


class MistralParser(TrailingCallsParser):
    """Content, then `[TOOL_CALLS]` and the calls up to the end of the reply: either a JSON array
    `[{"name": ..., "arguments": {...}}, ...]` or, with newer tokenizers, `name[ARGS]{...}` (one per marker)."""

    name = "mistral"
    marker = MISTRAL_CALLS

    def section_calls(self, section: str) -> list[base.ParsedToolCall] | None:
        calls: list[base.ParsedToolCall] = []
        for part in section.split(MISTRAL_CALLS)[1:]:
            part_calls = _mistral_part_calls(part.strip(), self.declared)
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
