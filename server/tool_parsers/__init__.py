"""Tool calls out of the text a model wrote, whole (`parse`) or as it streams (`stream`).

Each model family writes its calls its own way; one parser per way, by name in PARSERS. The stream of a reply
agrees with `parse` of the whole reply whenever its calls are well formed: the content deltas, the call names
and each call's concatenated argument fragments are what `parse` returns. A reply with a malformed call is
plain content, with one exception in streams: a call already sent cannot be withdrawn, so a malformed call
after it streams as content. A call to a function the request did not declare (the parser's `declared`) counts
as malformed: only the request's tools come back as calls.

Arguments are always `json.dumps` text (its default separators, non-ASCII kept as is), whatever spacing and
escapes the model used, so that streamed and whole replies match byte for byte.

The calls and stream events the parsers give, and their interfaces, are in tool_parsers/base.py.
"""

from __future__ import annotations

from pagedserve.server.tool_parsers.base import ToolParser
from pagedserve.server.tool_parsers.hermes import HERMES_START, HermesParser
from pagedserve.server.tool_parsers.json_array import JsonArrayParser
from pagedserve.server.tool_parsers.llama3_json import PYTHON_TAG, Llama3JsonParser
from pagedserve.server.tool_parsers.mistral import MISTRAL_CALLS, MistralParser
from pagedserve.server.tool_parsers.phi4_mini import PHI4_TOOL_TAG, Phi4MiniJsonParser
from pagedserve.server.tool_parsers.pythonic import PYTHONIC_EXAMPLE, PythonicParser

__all__ = [
    "PARSERS",
    "HermesParser",
    "JsonArrayParser",
    "Llama3JsonParser",
    "MistralParser",
    "Phi4MiniJsonParser",
    "PythonicParser",
    "parser_for_template",
]

PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser
    for parser in (HermesParser, Llama3JsonParser, MistralParser, Phi4MiniJsonParser, PythonicParser, JsonArrayParser)
}
AUTO_TOOL_PARSERS = tuple(name for name in PARSERS if name != "json_array")  # formats models write by themselves


def parser_for_template(chat_template: str | None) -> str:
    """The `tool_choice: "auto"` parser for a chat template, by the markers it writes."""
    template = chat_template or ""
    if HERMES_START in template:
        return HermesParser.name
    if PYTHON_TAG in template or "ipython" in template:
        return Llama3JsonParser.name
    if MISTRAL_CALLS in template:
        return MistralParser.name
    if PHI4_TOOL_TAG in template:
        return Phi4MiniJsonParser.name
    if PYTHONIC_EXAMPLE in template:
        return PythonicParser.name
    return HermesParser.name  # our default tool template writes Hermes-style blocks
