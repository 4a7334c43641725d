"""Structured output: a request's constraint on its output (JSON schema, JSON object, regex, choice, grammar).

A StructuredOutput names the constraint and crosses to the engine core with the request's SamplingParams;
engine/grammar.py turns it into token masks. The spec is text, so that equal constraints share one compiled
grammar.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
# A reasoning model's <think>...</think> ahead of the constrained answer: none, an optional block, or the rest of
# a block the prompt already opened.
Thinking = Literal["none", "optional", "opened"]
KINDS: tuple[Kind, ...] = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 256 * 1024  # a constraint is compiled for every distinct one: bounded like any request field


@dataclass(frozen=True)
class StructuredOutput:
    """One constraint on a request's output. `spec` is text, so that equal constraints share a compiled
    grammar: a JSON schema (as JSON), a regex, a choice list (as a JSON array) or a Lark / GBNF grammar."""

    kind: Kind
    spec: str = ""
    thinking: Thinking = "none"  # free text in <think> tags first, for reasoning models

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if len(self.spec) > MAX_SPEC_CHARS:
            raise ValueError(f"a structured output constraint may be at most {MAX_SPEC_CHARS} characters")

    def after_thinking(self, opened: bool) -> StructuredOutput:
        """The same constraint on the answer of a reasoning model, whose thinking goes unconstrained first:
        a whole `<think>...</think>` block it may write, or (`opened`) the rest of one the prompt began."""
        return dataclasses.replace(self, thinking="opened" if opened else "optional")

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str) -> StructuredOutput:
        """An object schema that lists its properties and leaves `additionalProperties` unsaid admits only
        those, as OpenAI's strict mode and vLLM do: JSON Schema's open default lets a model copy schema
        keywords into its output as keys of their own."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ValueError(f"invalid json_schema constraint: not JSON ({exc})") from None
        # Keys keep their order: a schema's property order is the order the model writes them in.
        return cls("json_schema", json.dumps(closed_objects(schema)))

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


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMAS = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames")


def closed_objects(schema: Any) -> Any:
    """`schema` with `additionalProperties: false` on every object schema that lists properties and leaves it
    unsaid; walks subschemas by keyword, so a property named like a keyword is never mistaken for one."""
    if not isinstance(schema, dict):
        return schema
    closed = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(closed.get(key), dict):
            closed[key] = {name: closed_objects(sub) for name, sub in closed[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(closed.get(key), list):
            closed[key] = [closed_objects(sub) for sub in closed[key]]
    for key in (*_SCHEMAS, "additionalProperties"):
        if key in closed:
            closed[key] = closed_objects(closed[key])
    says_otherwise = {"additionalProperties", "patternProperties", "unevaluatedProperties"} & closed.keys()
    if isinstance(closed.get("properties"), dict) and not says_otherwise:
        closed["additionalProperties"] = False
    return closed
