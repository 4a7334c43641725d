"""SamplingParams: how to pick each next token and when to stop; validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pagedserve.engine.structured_output import StructuredOutput

MAX_TOP_LOGPROBS = 20
MAX_INT32 = 2**31 - 1  # the bound of every count: a vocabulary, a context, a batch all fit well below it


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
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None = none; k >= 0 = the chosen token's plus the top k
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (no prefix cache)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True  # False: token ids only (benchmarks, clients that decode themselves)
    structured_output: StructuredOutput | None = None  # a constraint on the output (JSON schema, regex, ...)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
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
        return self.structured_output is not None and self.is_greedy and self.logprobs is None

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def check_token_ids(self, vocab_size: int) -> None:
        """Token ids named by the request must exist in the model's vocabulary."""
        for name, ids in (("logit_bias", self.logit_bias), ("stop_token_ids", self.stop_token_ids)):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise ValueError(f"{name} names token id {bad[0]}, outside the vocabulary (size {vocab_size})")


def _finite(value: float) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _check(name: str, value: object, ok: bool, rule: str) -> None:
    if not ok:
        raise ValueError(f"{name} must be {rule}, got {value!r}")
