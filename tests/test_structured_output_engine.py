"""Constrained decoding in the engine: outputs obey their constraint, jump-forward is exact, neighbours unchanged.

Prompts are runs of ordinary word tokens: byte tokens at the end of a prompt would prefix the output's text
with replacement characters (an incomplete UTF-8 sequence), which no constraint is about.
"""

from __future__ import annotations

import json
import re

import pytest

from pagedserve.engine import SamplingParams, StructuredOutput
from pagedserve.engine.config import EngineConfig
from pagedserve.engine.core.llm_engine import LLMEngine
from pagedserve.engine.structured.grammar import GrammarCompiler
from pagedserve.engine.worker.model_loader import LoadedModel
from tests.test_engine import prompt, run

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}
CONSTRAINTS = {
    "schema": StructuredOutput.json_schema(PERSON),
    "object": StructuredOutput.json_object(),
    "regex": StructuredOutput.regex(r"[0-9]{3}-[0-9]{4}"),
    "choice": StructuredOutput.choice(["red", "green", "blue"]),
    "gbnf": StructuredOutput.grammar('root ::= "move " dir\ndir ::= "north" | "south"'),
    "lark": StructuredOutput.grammar('start: "x=" NUMBER\nNUMBER: /[1-9][0-9]?/'),
}


@pytest.fixture
def engine(tiny_llama_loaded: LoadedModel) -> LLMEngine:
    return make_engine(tiny_llama_loaded)


def make_engine(loaded: LoadedModel, **config: object) -> LLMEngine:
    options = {"num_kv_blocks": 128, "max_model_len": 512, **config}
    return LLMEngine(EngineConfig(model=str(loaded.model_dir), **options), loaded=loaded)  # type: ignore[arg-type]


def constrained(name: str, **params: object) -> SamplingParams:
    options = {"max_tokens": 120, "temperature": 0.0, **params}
    return SamplingParams(structured_output=CONSTRAINTS[name], **options)  # type: ignore[arg-type]


def assert_obeys(name: str, text: str) -> None:
    if name == "schema":
        person = json.loads(text)
        assert set(person) == set(PERSON["properties"]) and person["role"] in ("admin", "user", "guest")
        assert 0 <= person["age"] <= 120 and isinstance(person["name"], str) and len(person["name"]) <= 12
        assert len(person["tags"]) <= 2
    elif name == "object":
        assert isinstance(json.loads(text), dict)
    elif name == "regex":
        assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", text)
    elif name == "choice":
        assert text in ("red", "green", "blue")
    elif name == "gbnf":
        assert text in ("move north", "move south")
    else:
        assert re.fullmatch(r"x=[1-9][0-9]?", text)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_outputs_obey_their_constraint(engine: LLMEngine, temperature: float) -> None:
    requests = {
        name: (prompt(6, 1000 + 40 * i), constrained(name, temperature=temperature, seed=i))
        for i, name in enumerate(CONSTRAINTS)
    }
    results = run(engine, requests)
    for name in CONSTRAINTS:
        out = results[f"{name}/0"]
        if out["finish"] == "stop":  # "object" may run to max_tokens on a random model: its JSON is unbounded
            assert_obeys(name, out["text"])
        else:
            assert name == "object" and out["finish"] == "length"
    assert engine.kv.pool.num_free == engine.kv.num_blocks


def test_a_complete_constraint_ends_the_request_without_waiting_for_eos(engine: LLMEngine) -> None:
    out = run(engine, {"c": (prompt(5, 2000), constrained("choice", ignore_eos=True))})["c/0"]
    assert out["finish"] == "stop" and out["text"] in ("red", "green", "blue")


def test_jump_forward_is_token_exact_with_the_slow_path(tiny_llama_loaded: LoadedModel) -> None:
    bounded = [name for name in CONSTRAINTS if name != "object"]  # "object" runs to max_tokens either way
    requests = {name: (prompt(6, 3000 + 20 * i), constrained(name)) for i, name in enumerate(bounded)}
    slow_engine = make_engine(tiny_llama_loaded, jump_forward=False)
    slow = run(slow_engine, dict(requests))
    assert slow_engine.snapshot().jump_forward_tokens == 0
    fast_engine = make_engine(tiny_llama_loaded)
    fast = run(fast_engine, dict(requests))
    for key in slow:
        assert fast[key]["tokens"] == slow[key]["tokens"] and fast[key]["text"] == slow[key]["text"]
    snapshot = fast_engine.snapshot()
    assert snapshot.jump_forward_tokens > 0 and snapshot.constrained_requests == len(bounded)
    assert fast_engine.stats.num_steps < slow_engine.stats.num_steps


def test_unconstrained_neighbours_are_unchanged(engine: LLMEngine) -> None:
    neighbours = {
        "greedy": (prompt(7), SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)),
        "seeded": (prompt(9, 400), SamplingParams(max_tokens=16, temperature=1.0, seed=7, ignore_eos=True)),
    }
    alone = run(engine, dict(neighbours))
    engine.reset_prefix_cache()
    mixed = run(engine, {**neighbours, "s": (prompt(8, 7000), constrained("schema", temperature=0.8, seed=1))})
    for key, out in alone.items():
        assert mixed[key]["tokens"] == out["tokens"]


def test_parallel_samples_each_follow_the_constraint(engine: LLMEngine) -> None:
    results = run(engine, {"p": (prompt(6, 2000), constrained("schema", n=3, temperature=1.0, seed=4))})
    for index in range(3):
        out = results[f"p/{index}"]
        assert out["finish"] == "stop"
        assert_obeys("schema", out["text"])


def test_the_constraint_survives_preemption(tiny_llama_loaded: LoadedModel) -> None:
    roomy = run(
        make_engine(tiny_llama_loaded), {f"r{i}": (prompt(40, 1000 + 60 * i), constrained("schema")) for i in range(4)}
    )
    cramped_engine = make_engine(tiny_llama_loaded, num_kv_blocks=9, max_model_len=128)
    cramped = run(cramped_engine, {f"r{i}": (prompt(40, 1000 + 60 * i), constrained("schema")) for i in range(4)})
    assert cramped_engine.scheduler.num_preemptions > 0
    for key, out in roomy.items():
        assert cramped[key]["tokens"] == out["tokens"]


def test_min_tokens_yields_to_a_complete_constraint(engine: LLMEngine) -> None:
    out = run(engine, {"m": (prompt(5, 2000), constrained("choice", min_tokens=10))})["m/0"]
    assert out["finish"] == "stop" and out["text"] in ("red", "green", "blue")


def test_a_bad_constraint_is_refused_with_the_librarys_reason(tiny_llama_loaded: LoadedModel) -> None:
    compiler = GrammarCompiler(tiny_llama_loaded.tokenizer, tiny_llama_loaded.spec.vocab_size, frozenset())
    with pytest.raises(ValueError, match="unclosed group"):
        compiler.check(StructuredOutput.regex("(ab"))
    with pytest.raises(ValueError, match="minimum"):
        compiler.check(StructuredOutput.json_schema({"type": "integer", "minimum": "zero"}))
    with pytest.raises(ValueError, match="not JSON"):
        StructuredOutput.json_schema("{not json")
    with pytest.raises(ValueError, match="non-empty list"):
        StructuredOutput.choice([])


@pytest.mark.parametrize("given_as", ["text", "dict"])
def test_a_schema_nested_past_python_s_recursion_limit_is_a_value_error(given_as: str) -> None:
    """What the offline API takes (the server refuses such schemas earlier, past 64 levels)."""
    levels = 100_000
    schema: object = '{"items": ' * levels + "{}" + "}" * levels
    if given_as == "dict":
        schema = {}
        for _ in range(5_000):
            schema = {"type": "object", "properties": {"a": schema}}
    with pytest.raises(ValueError, match="nested too deeply"):
        StructuredOutput.json_schema(schema)  # type: ignore[arg-type]


def test_listed_properties_are_the_only_ones_unless_the_schema_says_otherwise() -> None:
    schema = {
        "type": "object",
        "properties": {
            "properties": {"type": "object", "properties": {"x": {"type": "integer"}}},  # a key named like a keyword
            "free": {"type": "object", "properties": {"y": {}}, "additionalProperties": True},
            "tags": {"type": "array", "items": {"anyOf": [{"properties": {"z": {}}}, {"type": "string"}]}},
        },
        "$defs": {"point": {"properties": {"x": {}}}},
    }
    closed = json.loads(StructuredOutput.json_schema(schema).spec)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["properties"]["additionalProperties"] is False
    assert set(closed["properties"]["properties"]["properties"]) == {"x"}  # the map of properties is untouched
    assert closed["properties"]["free"]["additionalProperties"] is True
    assert closed["properties"]["tags"]["items"]["anyOf"][0]["additionalProperties"] is False
    assert closed["$defs"]["point"]["additionalProperties"] is False
    assert list(closed["properties"]) == ["properties", "free", "tags"]  # the order the model writes them in


@pytest.mark.parametrize("kind", ["json_schema", "choice", "grammar"])
@pytest.mark.parametrize(
    ("opened", "text"),
    [
        (False, '<think>maybe {"a": 1}, or not</think>\n{"a": 5}'),
        (False, '{"a": 7}'),  # thinking is optional
        (True, 'the prompt opened it: {"a": 1}?</think>\n\n{"a": 5}'),
    ],
)
def test_a_reasoning_models_thinking_goes_unconstrained_before_the_answer(
    tiny_llama_loaded: LoadedModel, opened: bool, text: str, kind: str
) -> None:
    answers = {
        "json_schema": StructuredOutput.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}}),
        "choice": StructuredOutput.choice(['{"a": 5}', '{"a": 7}']),
        "grammar": StructuredOutput.grammar('root ::= "{\\"a\\": " [0-9] "}"'),
    }
    compiler = GrammarCompiler(tiny_llama_loaded.tokenizer, tiny_llama_loaded.spec.vocab_size, frozenset())
    matcher = compiler.matcher(answers[kind].after_thinking(opened))
    assert matcher.consume_tokens(tiny_llama_loaded.tokenizer.encode(text, add_special_tokens=False))
    assert matcher.is_accepting()
    wrong = compiler.matcher(answers[kind].after_thinking(opened))
    prefix = "" if opened else "<think>"
    assert not wrong.consume_tokens(
        tiny_llama_loaded.tokenizer.encode(prefix + 'x</think>{"b": 1}', add_special_tokens=False)
    )
