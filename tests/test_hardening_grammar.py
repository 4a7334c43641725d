"""Constraints sent to hurt: a grammar that overflows the compiler's stack, one that takes seconds to compile
while others stream, and ones that compile but trip the grammar engine's limits in generation.

A crash is the bug under test, so whatever could crash runs in a subprocess: the test's process survives it
and sees how the other one ended.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from benchmarks.hostile_inputs import (
    chained_refs_schema,
    chained_rules_grammar,
    many_alternatives_grammar,
    many_patterned_properties,
)
from pagedserve.engine import SamplingParams, StructuredOutput
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.core.llm_engine import LLMEngine
from pagedserve.engine.structured import grammar
from pagedserve.engine.structured.grammar import GrammarCompiler
from pagedserve.engine.worker.model_loader import LoadedModel
from tests.servers import free_port, server_process
from tests.test_engine import prompt

ROOT = Path(__file__).resolve().parents[1]
STARTUP_SECONDS = 180  # loading on a busy 2-core machine
CRASH_SECONDS = 600
WIDE = " | ".join(f'"v{i:04d}"' for i in range(3000))  # one row of 3,000 items once a grammar reaches it


# ---- the inputs ------------------------------------------------------------------------------------------------


def crashers() -> dict[str, StructuredOutput]:
    return {
        "refs": StructuredOutput.json_schema(chained_refs_schema()),
        "rules": StructuredOutput.grammar(chained_rules_grammar()),
    }


def run_isolated(code: str, *args: str, timeout: float = CRASH_SECONDS) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


# ---- 1. a grammar that overflows the compiler's stack costs only its request ------------------------------------

CHECK_IN_A_CLIENT = """
import sys
from transformers import AutoTokenizer
from pagedserve.engine.sampling_params import StructuredOutput
from pagedserve.engine.structured.grammar import GrammarCompiler
from tests.test_hardening_grammar import crashers
compiler = GrammarCompiler(AutoTokenizer.from_pretrained(sys.argv[1]), 49152, frozenset())
for name, constraint in crashers().items():
    try:
        compiler.check(constraint)
        print(name, "accepted", flush=True)
    except ValueError as exc:
        print(name, "refused:", exc, flush=True)
compiler.check(StructuredOutput.regex("[0-9]+"))
print("still checking", flush=True)
"""


def test_the_clients_check_refuses_a_constraint_that_crashes_the_compiler(
    tiny_model_dir: Callable[[str], Path],
) -> None:
    """What AsyncEngine.generate and LLM call in the API process before a request goes to the core."""
    done = run_isolated(CHECK_IN_A_CLIENT, str(tiny_model_dir("llama")))
    assert done.returncode == 0, f"the checking process died ({done.returncode}):\n{done.stderr[-3000:]}"
    lines = done.stdout.splitlines()
    assert lines[-1] == "still checking"
    for name in crashers():
        (line,) = [line for line in lines if line.startswith(f"{name} ")]
        assert line.startswith(f"{name} refused:") and "too complex" in line, line


COMPILE_IN_THE_CORE = """
import sys
from pagedserve.engine import SamplingParams
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.core.llm_engine import LLMEngine
from tests.test_engine import prompt, run
from tests.test_hardening_grammar import crashers
engine = LLMEngine(EngineConfig(model=sys.argv[1], num_kv_blocks=64, max_model_len=256))
for name, constraint in crashers().items():
    try:  # past any client's check, as a client without one would send it
        engine.add_request(name, prompt(5), SamplingParams(structured_output=constraint, max_tokens=4))
    except ValueError as exc:
        print(name, "refused:", exc, flush=True)
        continue
    while engine.has_unfinished_requests():
        for delta in engine.step():
            if delta.finished:
                print(name, delta.finish_reason, delta.error, flush=True)
out = run(engine, {"after": (prompt(5), SamplingParams(max_tokens=4, temperature=0))})["after/0"]
print("served", out["finish"], len(out["tokens"]), flush=True)
"""


def test_the_core_fails_only_the_request_whose_constraint_crashes_the_compiler(
    tiny_model_dir: Callable[[str], Path],
) -> None:
    done = run_isolated(COMPILE_IN_THE_CORE, str(tiny_model_dir("llama")))
    assert done.returncode == 0, f"the engine's process died ({done.returncode}):\n{done.stderr[-3000:]}"
    lines = done.stdout.splitlines()
    assert lines[-1] == "served length 4"
    for name in crashers():
        (line,) = [line for line in lines if line.startswith(f"{name} ")]
        assert "too complex" in line and (" error " in line or " refused:" in line), line


@pytest.fixture(scope="module")
def server(tiny_model_dir: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`pagedserve serve` in a process of its own: a crash there is what the attacker is after."""
    port, log = free_port(), tmp_path_factory.mktemp("grammar") / "serve.log"
    command = [
        sys.executable, "-m", "pagedserve.server.cli", "serve", str(tiny_model_dir("llama")),
        "--served-model-name", "tiny", "--port", str(port), "--num-kv-blocks", "128", "--num-threads", "1",
    ]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    with server_process(command, url, log, STARTUP_SECONDS):
        yield url


@pytest.mark.slow
def test_over_http_a_crashing_constraint_gets_400_and_the_server_serves_on(server: str) -> None:
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    schema = {"name": "chain", "schema": chained_refs_schema()}
    bodies = [
        {**chat, "response_format": {"type": "json_schema", "json_schema": schema}},
        {**chat, "structured_outputs": {"grammar": chained_rules_grammar()}},
    ]
    for body in bodies:
        try:
            answer = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=CRASH_SECONDS)
        except httpx.TransportError as exc:
            pytest.fail(f"the server went away: {exc!r}")
        assert answer.status_code == 400, answer.text
        assert "too complex" in answer.json()["error"]["message"]
    answer = httpx.post(f"{server}/v1/chat/completions", json=chat, timeout=60)
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"] is not None


# ---- 2. compiling a fresh grammar leaves the batch alone --------------------------------------------------------


def make_engine(loaded: LoadedModel) -> LLMEngine:
    config = EngineConfig(model=str(loaded.model_dir), num_kv_blocks=256, max_model_len=512)
    return LLMEngine(config, loaded=loaded)


def test_compiling_a_fresh_grammar_does_not_stall_a_running_stream(tiny_llama_loaded: LoadedModel) -> None:
    engine = make_engine(tiny_llama_loaded)
    stream = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    engine.add_request("s0", prompt(6), stream)
    for _ in range(3):  # past the prompt's prefill
        engine.step()
    fresh = StructuredOutput.grammar(many_alternatives_grammar(uuid.uuid4().hex[:6]))
    started = last = time.perf_counter()
    engine.add_request("g", prompt(6, 2000), SamplingParams(structured_output=fresh, max_tokens=8, temperature=0))
    gaps: list[float] = []
    finished: dict[str, str] = {}
    streams = 0
    while "g" not in finished:
        assert time.perf_counter() - started < CRASH_SECONDS, "the constrained request never finished"
        for delta in engine.step():
            if delta.finished:
                finished[delta.request_id] = delta.finish_reason or ""
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
        if not any(r.startswith("s") for r in engine.request_ids()):  # the stream ran out: another takes over
            streams += 1
            engine.add_request(f"s{streams}", prompt(6, 100 + streams), stream)
    compile_seconds = time.perf_counter() - started
    # The check has teeth only if the compile spans many steps: relative, as a fast machine compiles in under 1 s.
    assert compile_seconds > 20 * statistics.median(gaps), "the grammar compiled too fast to show anything"
    assert max(gaps) < compile_seconds / 2, f"a step waited {max(gaps):.2f} s of {compile_seconds:.2f} s compiling"
    assert finished["g"] in ("stop", "length")


def this_thread_s_niceness() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@pytest.mark.skipif(sys.platform != "linux", reason="a thread's own nice value is Linux's")
def test_compiling_runs_below_the_step_loop_s_cpu_priority(tiny_llama_loaded: LoadedModel) -> None:
    """Compiles take seconds of CPU; the forward's threads wait for each other at every layer, so a compile that
    takes one of their cores stalls every stream. Sandbox children and compile threads yield to the engine."""
    ours = this_thread_s_niceness()
    expected = min(19, ours + grammar.COMPILE_NICENESS)
    compiler = GrammarCompiler(tiny_llama_loaded.tokenizer, tiny_llama_loaded.spec.vocab_size, frozenset())
    compiler.compile(StructuredOutput.regex(f"[0-9]+{uuid.uuid4().hex}")).result()  # fresh: through a child
    children = [c for c in psutil.Process().children() if any("sandbox_child" in part for part in c.cmdline())]
    assert children and all(child.nice() == expected for child in children), (ours, [c.nice() for c in children])
    assert compiler._threads.submit(this_thread_s_niceness).result() == expected
    assert this_thread_s_niceness() == ours  # the process's other threads keep theirs


def test_a_constraint_that_fails_to_compile_in_the_core_fails_alone(tiny_llama_loaded: LoadedModel) -> None:
    engine = make_engine(tiny_llama_loaded)
    engine.add_request("ok", prompt(6), SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    bad = SamplingParams(structured_output=StructuredOutput.regex("(ab"), max_tokens=6)
    try:
        engine.add_request("bad", prompt(6, 2000), bad)
    except ValueError as exc:  # refused at once: fine too
        assert "unclosed group" in str(exc)
    ends: dict[str, tuple[str | None, str | None]] = {}
    while engine.has_unfinished_requests():
        ends |= {d.request_id: (d.finish_reason, d.error) for d in engine.step() if d.finished}
    assert ends["ok"] == ("length", None)
    if "bad" in ends:
        assert ends["bad"][0] == "error" and "unclosed group" in (ends["bad"][1] or "")


def test_a_request_aborted_while_its_grammar_compiles_ends_at_once(tiny_llama_loaded: LoadedModel) -> None:
    engine = make_engine(tiny_llama_loaded)
    fresh = StructuredOutput.grammar(many_alternatives_grammar(uuid.uuid4().hex[:6]))
    engine.add_request("g", prompt(6), SamplingParams(structured_output=fresh, max_tokens=8))
    (delta,) = engine.abort_request("g")
    assert delta.finished and delta.finish_reason == "abort"
    assert not engine.has_unfinished_requests() and engine.request_ids() == []


# ---- 3. constraints that compile must generate valid output, or be refused up front ----------------------------


def generate(engine: LLMEngine, constraint: StructuredOutput, temperature: float) -> dict:
    params = SamplingParams(structured_output=constraint, max_tokens=12, temperature=temperature, seed=3)
    engine.add_request("r", prompt(6, 3000), params)
    out: dict = {"tokens": []}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            out["tokens"] += delta.new_token_ids
            if delta.finished:
                out["finish"], out["error"] = delta.finish_reason, delta.error
    return out


@pytest.fixture(scope="module")
def big_constraints() -> dict[str, StructuredOutput]:
    return {
        "alternatives": StructuredOutput.grammar(many_alternatives_grammar()),
        "properties": StructuredOutput.json_schema(many_patterned_properties()),
        "after_a_token": StructuredOutput.grammar(f'root ::= ("x" | "y") "Q" ({WIDE})'),
    }


@pytest.mark.parametrize("name", ["alternatives", "properties", "after_a_token"])
def test_a_constraint_that_compiles_generates_valid_output(
    tiny_llama_loaded: LoadedModel, big_constraints: dict[str, StructuredOutput], name: str
) -> None:
    """At each temperature, and greedy without jump-forward too (a forced token takes the other path)."""
    engine = make_engine(tiny_llama_loaded)
    constraint = big_constraints[name]
    checker = GrammarCompiler(tiny_llama_loaded.tokenizer, tiny_llama_loaded.spec.vocab_size, frozenset())
    for temperature, jump_forward in ((0.0, True), (0.0, False), (1.0, True), (1.5, True)):
        engine.constraints.jump_forward = jump_forward
        out = generate(engine, constraint, temperature)
        assert out["finish"] in ("stop", "length"), f"at {temperature}, jump-forward {jump_forward}: {out}"
        matcher = checker.matcher(constraint)
        assert matcher.consume_tokens([t for t in out["tokens"] if t != 2]), matcher.get_error()
        if out["finish"] == "stop":
            assert matcher.is_accepting(), f"at {temperature}, jump-forward {jump_forward}: {out}"


def test_a_constraint_past_the_parser_limits_is_refused_up_front(tiny_llama_loaded: LoadedModel) -> None:
    """With the library's default row limit (2,000 items) the 20,000 alternatives compile, yet the first token
    their mask admits trips the limit when consumed: refused at the check, not failed mid-generation."""
    tight = {**grammar.PARSER_LIMITS, "max_items_in_row": 2000}
    compiler = GrammarCompiler(
        tiny_llama_loaded.tokenizer, tiny_llama_loaded.spec.vocab_size, frozenset(), limits=tight
    )
    with pytest.raises(ValueError, match="too complex"):
        compiler.check(StructuredOutput.grammar(many_alternatives_grammar("t")))
    compiler.check(StructuredOutput.choice(["yes", "no"]))


def test_a_matcher_that_trips_a_limit_fails_its_request_with_the_reason(tiny_llama_loaded: LoadedModel) -> None:
    """A limit met mid-generation (with the library's default row limit: 3,000 alternatives after a token the
    up-front probe passes) ends the request with the library's reason: never a bare refused token, never a
    "stop" with invalid output. Forced by jump-forward or sampled, the token that trips it is the same."""
    engine = make_engine(tiny_llama_loaded)
    constraint = StructuredOutput.grammar(f'root ::= ("x" | "y") "Q" ({WIDE})')
    engine.constraints.compiler = GrammarCompiler(
        tiny_llama_loaded.tokenizer,
        tiny_llama_loaded.spec.vocab_size,
        tiny_llama_loaded.eos_token_ids,
        limits={**grammar.PARSER_LIMITS, "max_items_in_row": 2000},
    )
    for jump_forward in (True, False):
        engine.constraints.jump_forward = jump_forward
        out = generate(engine, constraint, 0.0)
        assert out["finish"] == "error", out
        assert "too complex for the grammar engine" in out["error"] and "max is 2000" in out["error"], out
