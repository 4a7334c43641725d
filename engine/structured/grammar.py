"""Constraints as token masks: llguidance compiles a StructuredOutput into a matcher per sequence and fills masks.

Why llguidance over xgrammar and outlines-core: README, "Structured output". A GrammarCompiler compiles each
constraint once and hands every sequence a copy; StepMasks fills a step's masks on a worker thread while the
forward runs (llguidance releases the GIL), and the engine applies them before any sampling parameter.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import llguidance
import llguidance.hf
import torch
from transformers import PreTrainedTokenizerBase

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # declared for type checkers only

from pagedserve.engine.sampling_params import StructuredOutput

# JSON is written as json.dumps writes it: one space after ',' and ':', no other whitespace. A model may not
# pad with newlines forever, and more positions admit exactly one token (jump-forward).
JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


# Thinking ahead of the answer: the `suffix` lexeme ends at the first </think> (a greedy regex would run past it).
_THOUGHT = 'thought[suffix="</think>"]: /(.|\n)*/'
_THINKING_LARK = {
    "optional": f'start: think? @answer\nthink: "<think>" thought /[ \\n]*/\n{_THOUGHT}',
    "opened": f"start: thought /[ \\n]*/ @answer\n{_THOUGHT}",
}


def grammar_text(constraint: StructuredOutput) -> str:
    """The constraint as an llguidance grammar; ValueError when it is malformed."""
    answer = _answer_grammar(constraint)
    if constraint.thinking == "none":
        return answer
    grammars = json.loads(answer)["grammars"] if answer.startswith("{") else [{"lark_grammar": answer}]
    grammars[0] = {**grammars[0], "name": "answer"}
    return json.dumps({"grammars": [{"lark_grammar": _THINKING_LARK[constraint.thinking]}, *grammars]})


def _answer_grammar(constraint: StructuredOutput) -> str:
    """llguidance's grammar: a JSON TopLevelGrammar, or Lark text (choices and grammars)."""
    kind, spec = constraint.kind, constraint.spec
    try:
        if kind == "json_schema":
            schema = json.loads(spec)
            if not isinstance(schema, (dict, bool)):
                raise ValueError("a JSON schema must be an object")
            return llguidance.LLMatcher.grammar_from_json_schema(spec, defaults=JSON_OPTIONS)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec)
        if kind == "choice":
            return llguidance.grammar_from("choice", spec)
        return llguidance.grammar_from("grammar", spec)
    except (ValueError, TypeError, RuntimeError) as exc:  # the library's messages say what is wrong
        raise ValueError(f"invalid {kind} constraint: {exc}") from None


class GrammarCompiler:
    """Matchers for constraints, each compiled once (an LRU of pristine matchers; a sequence gets a copy).

    The tokenizer's llguidance view takes a fraction of a second to build, so it is built on first use.
    Thread-safe: the caller's side checks constraints on a pool thread.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        cache_size: int = 512,
    ) -> None:
        self._hf = tokenizer
        self._vocab_size = vocab_size
        self._eos = sorted(eos_token_ids) or None
        self._cache_size = cache_size
        self._compiled: OrderedDict[StructuredOutput, llguidance.LLMatcher] = OrderedDict()
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self.compile_seconds = 0.0  # in compiling (cache misses), summed

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.hf.from_tokenizer(
                    self._hf,  # type: ignore[arg-type]  # any fast tokenizer: it reads backend_tokenizer
                    n_vocab=self._vocab_size,
                    eos_token=self._eos,
                )
            return self._tokenizer

    def check(self, constraint: StructuredOutput) -> None:
        """ValueError with the library's reason when the constraint cannot be compiled."""
        self._pristine(constraint)

    def matcher(self, constraint: StructuredOutput) -> llguidance.LLMatcher:
        """A fresh matcher for one sequence."""
        return self._pristine(constraint).deep_copy()

    def _pristine(self, constraint: StructuredOutput) -> llguidance.LLMatcher:
        with self._lock:
            found = self._compiled.get(constraint)
            if found is not None:
                self._compiled.move_to_end(constraint)
                return found
        start = time.perf_counter()
        matcher = llguidance.LLMatcher(self.tokenizer, grammar_text(constraint), log_level=0)
        self.compile_seconds += time.perf_counter() - start
        if matcher.is_error():
            raise ValueError(f"invalid {constraint.kind} constraint: {matcher.get_error()}")
        with self._lock:
            self._compiled[constraint] = matcher
            if len(self._compiled) > self._cache_size:
                self._compiled.popitem(last=False)
        return matcher


def new_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """llguidance's mask layout: one int32 word per 32 tokens, every bit set (all allowed) until filled.

    Written here rather than taken from llguidance.torch, whose import decorates a function with torch.compile
    and so imports Triton early, before a program's TRITON_INTERPRET setting is read."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, vocab_size] bool from llguidance's [rows, ceil(vocab/32)] int32 bitmask (bit j of word i is
    token 32 i + j)."""
    shifts = torch.arange(32, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def only_allowed_token(matcher: llguidance.LLMatcher, vocab_size: int) -> int | None:
    """The one token the matcher admits next, or None when it admits several (or none). Read off the packed
    mask: one non-zero word with one bit set (unpacking the whole vocabulary would cost far more)."""
    bitmask = new_bitmask(1, vocab_size)
    matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * 4)
    words = bitmask[0].nonzero()
    if words.shape[0] != 1:
        return None
    index = int(words[0, 0])
    word = int(bitmask[0, index]) & 0xFFFFFFFF
    if word & (word - 1):
        return None
    return 32 * index + word.bit_length() - 1


@dataclass
class GrammarRows:
    """The step's constrained rows of the sampling batch, and an additive bias for each: 0 for the tokens its
    constraint admits, -inf for the others ([rows, vocab] float32, built on the worker thread)."""

    rows: torch.Tensor
    bias: torch.Tensor

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """A copy of `logits` with every token the constraints refuse at -inf: one pass over the logits."""
        return logits.float().index_add(0, self.rows.to(logits.device), self.bias.to(logits.device))


class StepMasks:
    """Fills a step's masks on a worker thread: started before the forward, awaited before sampling."""

    def __init__(self, vocab_size: int, num_threads: int = 1) -> None:
        self._vocab_size = vocab_size
        self._num_threads = num_threads
        self._executor: llguidance.LLExecutor | None = None  # made at the first mask: most engines never need one
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pagedserve-grammar")
        self.mask_seconds = 0.0  # filling masks, on the worker thread
        self.wait_seconds = 0.0  # the step waiting for them after its forward

    def start(self, matchers: list[llguidance.LLMatcher | None]) -> concurrent.futures.Future[GrammarRows] | None:
        """Masks for the rows that have a matcher (None: nothing to mask this step)."""
        constrained = [(row, m) for row, m in enumerate(matchers) if m is not None]
        if not constrained:
            return None
        return self._pool.submit(self._fill, constrained)

    def wait(self, pending: concurrent.futures.Future[GrammarRows] | None) -> GrammarRows | None:
        if pending is None:
            return None
        start = time.perf_counter()
        try:
            return pending.result()
        finally:
            self.wait_seconds += time.perf_counter() - start

    def _fill(self, constrained: list[tuple[int, llguidance.LLMatcher]]) -> GrammarRows:
        start = time.perf_counter()
        bitmask = new_bitmask(len(constrained), self._vocab_size)
        pairs = [(matcher, i) for i, (_, matcher) in enumerate(constrained)]
        if self._executor is None:  # only ever touched on the worker thread
            self._executor = llguidance.LLExecutor(num_threads=self._num_threads)
        self._executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), bitmask.shape[1] * 4, len(constrained))
        rows = torch.tensor([row for row, _ in constrained])
        refused = ~allowed_tokens(bitmask, self._vocab_size)
        bias = torch.zeros(refused.shape).masked_fill_(refused, float("-inf"))
        result = GrammarRows(rows, bias)
        self.mask_seconds += time.perf_counter() - start
        return result

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
