"""Structured output: a request's constraint on its output (JSON schema, JSON object, regex, choice, grammar).

A StructuredOutput names the constraint and crosses to the engine core with the request's SamplingParams;
engine/grammar.py turns it into token masks. The spec is text, so that equal constraints share one compiled
grammar.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
KINDS: tuple[Kind, ...] = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 256 * 1024  # a constraint is compiled for every distinct one: bounded like any request field


@dataclass(frozen=True)
class StructuredOutput:
    """One constraint on a request's output. `spec` is text, so that equal constraints share a compiled
    grammar: a JSON schema (as JSON), a regex, a choice list (as a JSON array) or a Lark / GBNF grammar."""

    kind: Kind
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if len(self.spec) > MAX_SPEC_CHARS:
            raise ValueError(f"a structured output constraint may be at most {MAX_SPEC_CHARS} characters")

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str) -> StructuredOutput:
        # Keys keep their order: a schema's property order is the order the model writes them in.
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def json_object(cls) -> StructuredOutput:
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutput:
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options: list[str]) -> StructuredOutput:
        if not options or not all(isinstance(o, str) for o in options):
            raise ValueError("a choice constraint needs a non-empty list of strings")
        return cls("choice", json.dumps(options))

    @classmethod
    def grammar(cls, text: str) -> StructuredOutput:
        """A Lark grammar (llguidance's dialect) or a GBNF one (llama.cpp's), told apart by the library."""
        return cls("grammar", text)
