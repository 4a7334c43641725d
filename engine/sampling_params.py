"""SamplingParams: how to pick each next token and when to stop; validated on construction.

A request's StructuredOutput (JSON schema, JSON object, regex, choice, grammar) is one of its fields and crosses
to the engine core with it; engine/structured/ turns it into token masks. Its spec is text, so that equal
constraints share one compiled grammar.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, Literal

MAX_TOP_LOGPROBS = 20
MAX_INT32 = 2**31 - 1  # the bound of every count: a vocabulary, a context, a batch all fit well below it


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
        try:
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"invalid json_schema constraint: not JSON ({exc})") from None
            # Keys keep their order: a schema's property order is the order the model writes them in.
            return cls("json_schema", json.dumps(closed_objects(schema)))
        except RecursionError:  # parsing, closing and writing recurse once per level of nesting
            raise ValueError("invalid json_schema constraint: nested too deeply") from None

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


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16  # None = until the context is full; 0 = score the prompt only (n must be 1)
    min_tokens: int = 0
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    allowed_token_ids: list[int] | None = None  # only these may be sampled (vLLM's); None: any token
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None = none; k >= 0 = the chosen token's plus the top k
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (no prefix cache)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True  # False: token ids only (benchmarks, clients that decode themselves)
    structured_output: StructuredOutput | None = None  # a constraint on the output (JSON schema, regex, ...)
    speculative: bool | None = None  # speculative decoding for this request; None: the engine's default

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = sorted(set(self.allowed_token_ids))
        self.logit_bias = {int(k): float(v) for k, v in (self.logit_bias or {}).items()}
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        _check("n", self.n, 1 <= self.n <= MAX_INT32, f"in [1, {MAX_INT32}]")
        max_tokens = self.max_tokens
        _check("max_tokens", max_tokens, max_tokens is None or 0 <= max_tokens <= MAX_INT32, f"in [0, {MAX_INT32}]")
        if max_tokens == 0 and self.n > 1:
            raise ValueError(f"n must be 1 when max_tokens is 0 (the prompt is only scored), got {self.n}")
        _check("min_tokens", self.min_tokens, 0 <= self.min_tokens <= MAX_INT32, f"in [0, {MAX_INT32}]")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        _check(
            "temperature",
            self.temperature,
            _finite(self.temperature) and 0 <= self.temperature <= 2,
            "in [0, 2]",
        )
        _check("top_p", self.top_p, _finite(self.top_p) and 0 < self.top_p <= 1, "in (0, 1]")
        _check("top_k", self.top_k, 0 <= self.top_k <= MAX_INT32, f"-1, 0 (off) or a positive integer <= {MAX_INT32}")
        _check("min_p", self.min_p, _finite(self.min_p) and 0 <= self.min_p <= 1, "in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(name, value, _finite(value) and -2 <= value <= 2, "in [-2, 2]")
        rep = self.repetition_penalty
        _check("repetition_penalty", rep, _finite(rep) and 0 < rep <= 2, "in (0, 2]")
        for token, bias in self.logit_bias.items():
            _check("logit_bias", bias, _finite(bias) and -100 <= bias <= 100, "values in [-100, 100]")
            _check("logit_bias", token, 0 <= token <= MAX_INT32, "keys that are token ids")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(name, value, value is None or 0 <= value <= MAX_TOP_LOGPROBS, f"in [0, {MAX_TOP_LOGPROBS}]")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must hold non-empty strings")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True")
        if self.allowed_token_ids is not None:
            allowed = self.allowed_token_ids
            _check("allowed_token_ids", allowed, bool(allowed), "a non-empty list of token ids")
            bad_allowed = next((t for t in allowed if not 0 <= t <= MAX_INT32), None)
            _check("allowed_token_ids", bad_allowed, bad_allowed is None, "a list of token ids")
        bad_stop = next((t for t in self.stop_token_ids if not 0 <= t <= MAX_INT32), None)
        _check("stop_token_ids", bad_stop, bad_stop is None, "a list of token ids")
        _check("seed", self.seed, self.seed is None or 0 <= self.seed < 2**63, "in [0, 2**63)")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def jumps_forward(self) -> bool:
        """Tokens a constraint forces may be appended without a forward pass each: the greedy choice is the
        forced token whatever the logits, and no logprobs are asked for (they would need the logits)."""
        return (
            self.structured_output is not None
            and self.is_greedy
            and self.logprobs is None
            and self.allowed_token_ids is None  # a forced token must still be an allowed one
        )

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def check_token_ids(self, vocab_size: int) -> None:
        """Token ids named by the request must exist in the model's vocabulary."""
        named = (("logit_bias", self.logit_bias), ("stop_token_ids", self.stop_token_ids))
        for name, ids in (*named, ("allowed_token_ids", self.allowed_token_ids or [])):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise ValueError(f"{name} names token id {bad[0]}, outside the vocabulary (size {vocab_size})")


def _finite(value: float) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _check(name: str, value: object, ok: bool, rule: str) -> None:
    if not ok:
        raise ValueError(f"{name} must be {rule}, got {value!r}")
