"""Constraints as matchers: llguidance compiles a StructuredOutput into a matcher each sequence gets a copy of.

Why llguidance over xgrammar and outlines-core: README, "Structured output". Its compiler is native code that
a hostile grammar can crash (a stack overflow), so a GrammarCompiler compiles nothing in its own process that
has not compiled in a sandbox process first (sandbox.py), and compiles on threads with a larger stack than the
sandbox's. The masks a step needs are built in masks.py.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
import weakref
from collections import OrderedDict
from typing import Any

import llguidance

from pagedserve.engine.sampling_params import StructuredOutput
from pagedserve.engine.structured.lltokenizer import serialized_tokenizer, shared_lltokenizer
from pagedserve.engine.structured.sandbox import GrammarSandbox, Verdict, shared_sandbox
from pagedserve.engine.structured.threads import StackedThreads
from pagedserve.engine.text.text_tokenizer import FastTokenizer

# Set explicitly, the same in every process that compiles (the sandbox's children get them from here).
PARSER_LIMITS: dict[str, Any] = {
    # The library's default is 2,000. It checks this bound when a token is consumed, not when the mask is
    # built, so a grammar past it (one rule of 20,000 literals; 3,000 optional properties) fails at a token
    # its own mask admitted. As many as one mask step may build: then the mask step meets the bound first.
    "max_items_in_row": 50_000,
    "step_max_items": 50_000,
    "initial_lexer_fuel": 1_000_000,
    "step_lexer_fuel": 200_000,
    "max_lexer_states": 250_000,
    "max_grammar_size": 500_000,
    "precompute_large_lexemes": True,
    "verbose_errors": False,  # a client's error says why, without the parser's state and the whole grammar
}
SANDBOX_STACK_BYTES = 8 << 20  # a Linux thread's default: where llguidance ran before the sandbox existed
COMPILE_STACK_BYTES = 8 * SANDBOX_STACK_BYTES  # what compiled in a child compiles here with room to spare
PROBE_TOKENS = 4  # first tokens the sandbox consumes, each on a copy, to find a limit tripped at once
# Compiling is background work (seconds of CPU for a big grammar, done up to three times: the API's check and the
# core's in sandbox children, then the core's own), and the step loop's forward is not: its OpenMP threads meet
# at a barrier in every layer, so one that loses its core to a compile stalls the whole step, every other stream's
# next token with it. Compile threads and sandbox children run this much nicer than the engine.
COMPILE_NICENESS = 10


def background_nice() -> int:
    """The nice value for compiling: COMPILE_NICENESS above the process's main thread (a child process inherits
    the value of the thread that starts it, which may be a compile thread already)."""
    return min(19, os.getpriority(os.PRIO_PROCESS, os.getpid()) + COMPILE_NICENESS)


def library_error(matcher: llguidance.LLMatcher) -> str:
    return clean_error(matcher.get_error())


def clean_error(text: str) -> str:
    """llguidance's error without the marker it leaves where verbose errors would show the parser's state."""
    return text.replace("<non-verbose/>", "").strip()


class GrammarCompiler:
    """Matchers for constraints, each compiled once (an LRU of pristine matchers; a sequence gets a copy).

    check() only asks the sandbox (a client's process never needs a matcher); compile() proves the grammar in
    the sandbox, then compiles it on a thread of this process with the first mask built.
    Thread-safe: the caller's side checks constraints on pool threads.
    """

    def __init__(
        self,
        tokenizer: FastTokenizer,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        cache_size: int = 512,
        *,
        limits: dict[str, Any] = PARSER_LIMITS,
        probe_tokens: int = PROBE_TOKENS,
    ) -> None:
        self._hf = tokenizer
        self._vocab_size = vocab_size
        self._eos: list[int] | int | None = sorted(eos_token_ids) or tokenizer.eos_token_id
        self._limits = dict(limits)
        self._probe_tokens = probe_tokens
        self._cache_size = cache_size
        self._compiled: OrderedDict[StructuredOutput, llguidance.LLMatcher] = OrderedDict()
        self._compiling: dict[StructuredOutput, concurrent.futures.Future[llguidance.LLMatcher]] = {}
        self._sandbox: GrammarSandbox | None = None
        self._lock = threading.Lock()
        self._threads = StackedThreads(
            "pagedserve-grammar", COMPILE_STACK_BYTES, num_threads=2, niceness=COMPILE_NICENESS
        )
        weakref.finalize(self, self._threads.close)
        self.compile_seconds = 0.0  # in compiling here (cache misses) and building first masks, summed

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """Built at first use; the engine builds it as it loads (prepare)."""
        return shared_lltokenizer(serialized_tokenizer(self._hf), self._vocab_size, self._eos)

    def prepare(self) -> llguidance.LLTokenizer:
        """Builds the tokenizer's llguidance view now: it holds the GIL for about a second (lltokenizer.py)."""
        return self.tokenizer

    def check(self, constraint: StructuredOutput) -> None:
        """ValueError with the reason when the constraint cannot be compiled, or is too complex to."""
        self._judge(constraint, want_grammar=False)

    def matcher(self, constraint: StructuredOutput) -> llguidance.LLMatcher:
        """A fresh matcher for one sequence; waits while its grammar compiles."""
        return self.compile(constraint).result().deep_copy()

    def compile(self, constraint: StructuredOutput) -> concurrent.futures.Future[llguidance.LLMatcher]:
        """The pristine matcher, done at once when cached; the future raises ValueError for a bad constraint.
        Copy it (deep_copy) for a sequence."""
        with self._lock:
            found = self._compiled.get(constraint)
            if found is not None:
                self._compiled.move_to_end(constraint)
                done: concurrent.futures.Future[llguidance.LLMatcher] = concurrent.futures.Future()
                done.set_result(found)
                return done
            pending = self._compiling.get(constraint)
            if pending is None:  # the same new constraint in several requests compiles once
                pending = self._compiling[constraint] = self._threads.submit(self._build, constraint)
            return pending

    def _build(self, constraint: StructuredOutput) -> llguidance.LLMatcher:
        """On a compile thread: converted and proven in the sandbox, compiled here, its first mask built (which
        the copies' first masks then read from its cache)."""
        try:
            grammar = self._judge(constraint, want_grammar=True).grammar
            assert grammar is not None
            start = time.perf_counter()
            limits = llguidance.LLParserLimits(**self._limits)
            matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=limits)
            if not matcher.is_error():
                matcher.compute_bitmask()
            with self._lock:
                self.compile_seconds += time.perf_counter() - start
            if matcher.is_error():
                raise ValueError(f"the {constraint.kind} constraint is too complex: {library_error(matcher)}")
            with self._lock:
                self._compiled[constraint] = matcher
                if len(self._compiled) > self._cache_size:
                    self._compiled.popitem(last=False)
            return matcher
        finally:
            with self._lock:
                self._compiling.pop(constraint, None)

    def _judge(self, constraint: StructuredOutput, want_grammar: bool) -> Verdict:
        """The sandbox's verdict (with the grammar's text when wanted); ValueError when it is no."""
        source = (constraint.kind, constraint.spec, constraint.thinking)
        verdict = self._sandboxed().judge(source, want_grammar)
        if verdict.error is None:
            return verdict
        if verdict.stage == "compile":
            raise ValueError(f"invalid {constraint.kind} constraint: {clean_error(verdict.error)}")
        raise ValueError(f"the {constraint.kind} constraint is too complex: {clean_error(verdict.error)}")

    def _sandboxed(self) -> GrammarSandbox:
        with self._lock:
            if self._sandbox is None:
                config = {
                    "tokenizer": serialized_tokenizer(self._hf),
                    "n_vocab": self._vocab_size,
                    "eos": self._eos,
                    "limits": self._limits,
                    "probe_tokens": self._probe_tokens,
                    "stack_bytes": SANDBOX_STACK_BYTES,
                    "nice": background_nice(),
                }
                self._sandbox = shared_sandbox(config)
            return self._sandbox
