"""Grammar libraries for structured output (issue 19): schema coverage and mask cost with our tokenizer.

Measures xgrammar, llguidance and outlines-core side by side on the embedded SmolLM2-135M-Instruct tokenizer
(49,152 tokens): which of a corpus of JSON schemas (as the openai SDK's `parse()`, LangChain, LiteLLM and tool
definitions send them), json_object, a regex, a choice list and a grammar (GBNF/EBNF, Lark) each compiles,
whether each accepts a valid instance and rejects an invalid one (token by token through its matcher, checking
the mask bit of every token), compile time (cold and cached), per-token mask time over real walks (one
request, and 32 concurrent matchers with each library's batched API), the cost of applying a bitmask to
[32, vocab] logits, whether the mask calls release the GIL, and how a mask computed on a thread overlaps our
real decode forward (LLMEngine, 32 sequences).

None of the candidates is a project dependency: run it from a separate venv that sees the project venv's
packages through a .pth line, so that the project's torch (2.13.0, CPU) is the one used:

    python3 -m venv /tmp/grammar-venv
    echo "import site; site.addsitedir('$PWD/.venv/lib/python3.11/site-packages')" \
        > /tmp/grammar-venv/lib/python3.11/site-packages/project.pth   # addsitedir: the editable pagedserve too
    echo "torch==2.13.0" > /tmp/torch-pin.txt
    /tmp/grammar-venv/bin/pip install --no-deps -c /tmp/torch-pin.txt \
        xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 llguidance==1.9.1 outlines-core==0.2.14
    /tmp/grammar-venv/bin/python benchmarks/grammar_candidates.py   # ~2.5 min on 2 cores (mostly outlines-core)
    /tmp/grammar-venv/bin/python benchmarks/grammar_candidates.py --no-engine   # skip the forward-overlap part

(xgrammar's other requirements, pydantic, torch, transformers, triton, numpy and typing-extensions, are in the
project venv already; apache-tvm-ffi is its only new one. llguidance and outlines-core need nothing else.)
"""

from __future__ import annotations

import argparse
import datetime
import enum
import json
import multiprocessing
import os
import re
import statistics
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as engine/__init__.py does, before torch loads

import numpy
import torch
from pydantic import BaseModel, Field

if not __package__:  # run as a script: import the project, not benchmarks/kernels.py as `kernels`
    sys.path[0] = str(Path(__file__).resolve().parents[1])

LIBS = ("xgrammar", "llguidance", "outlines-core")
OUTLINES_COMPILE_TIMEOUT = 60.0  # seconds; outlines-core builds a full DFA over the vocabulary at compile time
BATCH = 32
SEPARATORS = (", ", ": ")  # fixed JSON whitespace: what json.dumps writes, and what lets jump-forward work


# ---- the corpus ------------------------------------------------------------------------------------------


@dataclass
class Case:
    name: str
    kind: str  # json_schema | json_object | regex | choice | gbnf | lark
    spec: Any
    valid: str
    invalid: str
    feature: str  # what the invalid instance violates
    source: str = ""  # how a client produces the schema


def _strict(model: type[BaseModel]) -> dict:
    """What `client.chat.completions.parse(response_format=model)` sends."""
    from openai.lib._pydantic import to_strict_json_schema

    return to_strict_json_schema(model)


def _plain(model: type[BaseModel]) -> dict:
    """What LangChain's json_schema method and LiteLLM send: pydantic's own schema."""
    return model.model_json_schema()


def _dump(value: Any) -> str:
    return json.dumps(value, separators=(", ", ": "))


class Person(BaseModel):
    name: str
    age: int


class Address(BaseModel):
    street: str
    city: str
    zip: str


class Customer(BaseModel):
    name: str
    address: Address


class Order(BaseModel):
    id: int
    customer: Customer
    total: float


class LineItem(BaseModel):
    sku: str
    qty: int
    price: float


class Invoice(BaseModel):
    number: str
    items: list[LineItem]


class Priority(str, enum.Enum):
    low = "low"
    medium = "medium"
    high = "high"


class Ticket(BaseModel):
    title: str
    priority: Priority
    status: Literal["open", "closed"]


class Profile(BaseModel):
    nickname: str | None
    age: int | None


class Shipment(BaseModel):
    billing: Address
    shipping: Address


class Draft(BaseModel):
    title: str
    tags: list[str] = []
    draft: bool = False


class Event(BaseModel):
    name: str
    start: datetime.datetime


class Contact(BaseModel):
    name: str
    email: str = Field(json_schema_extra={"format": "email"})


class Record(BaseModel):
    day: datetime.date
    id: uuid.UUID


class Username(BaseModel):
    handle: str = Field(min_length=3, max_length=8)


class Age(BaseModel):
    age: int = Field(ge=0, le=120)


class Score(BaseModel):
    score: float = Field(ge=0.0, le=1.0)


class Percent(BaseModel):
    percent: int = Field(gt=0, lt=100)


class Product(BaseModel):
    sku: str = Field(pattern=r"^[A-Z]{3}-\d{4}$")
    name: str


class Scores(BaseModel):
    scores: dict[str, int]


class Tagged(BaseModel):
    tags: list[str] = Field(min_length=1, max_length=3)


class Node(BaseModel):
    value: int
    children: list[Node]


class Linked(BaseModel):
    value: int
    next: Linked | None


class Cat(BaseModel):
    pet_type: Literal["cat"]
    meows: int


class Dog(BaseModel):
    pet_type: Literal["dog"]
    barks: float


class Owner(BaseModel):
    pet: Cat | Dog = Field(discriminator="pet_type")


class Shape(BaseModel):
    point: tuple[int, int, str]


class Versioned(BaseModel):
    version: Literal["v1"]
    payload: str


class GetWeather(BaseModel):
    """Current weather at a place."""

    location: str = Field(description="City and country, e.g. Paris, France")
    unit: Literal["celsius", "fahrenheit"]


class SearchWeb(BaseModel):
    """Searches the web."""

    query: str
    max_results: int = Field(ge=1, le=10)


class Joke(BaseModel):
    """A joke to tell the user."""

    setup: str = Field(description="The setup of the joke")
    punchline: str = Field(description="The punchline to the joke")
    rating: int | None = Field(default=None, description="How funny the joke is, from 1 to 10")


class Seniority(str, enum.Enum):
    junior = "junior"
    mid = "mid"
    senior = "senior"


class Job(BaseModel):
    company: str
    title: str
    start_year: int = Field(ge=1950, le=2100)
    end_year: int | None = Field(ge=1950, le=2100)
    seniority: Seniority


class Skill(BaseModel):
    name: str
    years: float = Field(ge=0)


class Resume(BaseModel):
    full_name: str
    email: str = Field(json_schema_extra={"format": "email"})
    phone: str | None = Field(pattern=r"^\+?[0-9 ()-]{7,20}$")
    location: Address
    summary: str = Field(max_length=300)
    jobs: list[Job]
    skills: list[Skill] = Field(max_length=20)
    languages: list[Literal["en", "fr", "de", "es", "zh"]]
    open_to_remote: bool


def _tool_required_schema() -> dict:
    """vLLM's grammar for tool_choice="required": a non-empty array of {name, parameters}, one branch per tool."""
    branches = [
        {
            "properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
            "required": ["name", "parameters"],
        }
        for name, params in (("get_weather", _strict(GetWeather)), ("search_web", _strict(SearchWeb)))
    ]
    return {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": branches}}


def corpus() -> list[Case]:
    from openai import pydantic_function_tool

    resume = {
        "full_name": "Ada Lovelace",
        "email": "ada@example.org",
        "phone": "+44 20 7946 0958",
        "location": {"street": "12 St James's Square", "city": "London", "zip": "SW1Y 4JH"},
        "summary": "Mathematician who wrote the first published algorithm for a computing machine.",
        "jobs": [
            {
                "company": "Analytical Engine Co",
                "title": "Programmer",
                "start_year": 1952,
                "end_year": None,
                "seniority": "senior",
            }
        ],
        "skills": [{"name": "mathematics", "years": 20}, {"name": "poetry", "years": 3.5}],
        "languages": ["en", "fr"],
        "open_to_remote": True,
    }
    bad_resume = json.loads(json.dumps(resume))
    bad_resume["jobs"][0]["seniority"] = "lead"
    tree = {
        "value": 1,
        "children": [{"value": 2, "children": [{"value": 3, "children": []}]}, {"value": 4, "children": []}],
    }
    bad_tree = {"value": 1, "children": [{"value": 2, "children": [{"value": "x", "children": []}]}]}
    chain = {"value": 1, "next": {"value": 2, "next": {"value": 3, "next": {"value": 4, "next": None}}}}
    weather_tool = pydantic_function_tool(GetWeather, name="get_weather")["function"]["parameters"]
    cases = [
        Case(
            "simple",
            "json_schema",
            _strict(Person),
            _dump({"name": "Bob", "age": 42}),
            _dump({"name": "Bob", "age": "42"}),
            "type",
            "openai parse()",
        ),
        Case(
            "nested objects",
            "json_schema",
            _strict(Order),
            _dump(
                {
                    "id": 7,
                    "customer": {"name": "Eve", "address": {"street": "1 Main St", "city": "Oslo", "zip": "0150"}},
                    "total": 19.99,
                }
            ),
            _dump(
                {
                    "id": 7,
                    "customer": {"name": "Eve", "address": {"street": "1 Main St", "zip": "0150"}},
                    "total": 19.99,
                }
            ),
            "nested required",
            "openai parse()",
        ),
        Case(
            "array of objects",
            "json_schema",
            _strict(Invoice),
            _dump(
                {
                    "number": "INV-1",
                    "items": [{"sku": "a1", "qty": 2, "price": 3.5}, {"sku": "b2", "qty": 1, "price": 10}],
                }
            ),
            _dump({"number": "INV-1", "items": [{"sku": "a1", "qty": 2.5, "price": 3.5}]}),
            "integer vs number",
            "openai parse()",
        ),
        Case(
            "enum + literal",
            "json_schema",
            _strict(Ticket),
            _dump({"title": "Printer on fire", "priority": "high", "status": "open"}),
            _dump({"title": "Printer on fire", "priority": "urgent", "status": "open"}),
            "enum",
            "openai parse()",
        ),
        Case(
            "Optional (anyOf null)",
            "json_schema",
            _strict(Profile),
            _dump({"nickname": None, "age": 30}),
            _dump({"nickname": 5, "age": 30}),
            "anyOf",
            "openai parse()",
        ),
        Case(
            "$ref/$defs reused",
            "json_schema",
            _strict(Shipment),
            _dump(
                {
                    "billing": {"street": "a", "city": "b", "zip": "c"},
                    "shipping": {"street": "d", "city": "e", "zip": "f"},
                }
            ),
            _dump({"billing": {"street": "a", "city": "b", "zip": "c"}, "shipping": {"street": "d", "city": "e"}}),
            "$ref required",
            "openai parse()",
        ),
        Case(
            "required vs optional (non-strict)",
            "json_schema",
            _plain(Draft),
            _dump({"title": "Notes"}),
            _dump({"tags": ["x"], "draft": True}),
            "missing required",
            "LangChain/LiteLLM",
        ),
        Case(
            "format date-time",
            "json_schema",
            _strict(Event),
            _dump({"name": "launch", "start": "2025-03-01T09:30:00Z"}),
            _dump({"name": "launch", "start": "next tuesday"}),
            "format date-time",
            "openai parse()",
        ),
        Case(
            "format email",
            "json_schema",
            _strict(Contact),
            _dump({"name": "Bob", "email": "bob@example.com"}),
            _dump({"name": "Bob", "email": "bob at example"}),
            "format email",
            "openai parse()",
        ),
        Case(
            "format date + uuid",
            "json_schema",
            _strict(Record),
            _dump({"day": "2024-02-29", "id": "123e4567-e89b-12d3-a456-426614174000"}),
            _dump({"day": "2024-02-29", "id": "1234"}),
            "format uuid",
            "openai parse()",
        ),
        Case(
            "maxLength",
            "json_schema",
            _strict(Username),
            _dump({"handle": "alice"}),
            _dump({"handle": "alice_in_wonderland"}),
            "maxLength",
            "openai parse()",
        ),
        Case(
            "minLength",
            "json_schema",
            _strict(Username),
            _dump({"handle": "bob"}),
            _dump({"handle": "bo"}),
            "minLength",
            "openai parse()",
        ),
        Case(
            "integer min/max",
            "json_schema",
            _strict(Age),
            _dump({"age": 37}),
            _dump({"age": 150}),
            "maximum",
            "openai parse()",
        ),
        Case(
            "number min/max",
            "json_schema",
            _strict(Score),
            _dump({"score": 0.75}),
            _dump({"score": 1.5}),
            "maximum (number)",
            "openai parse()",
        ),
        Case(
            "exclusive bounds",
            "json_schema",
            _strict(Percent),
            _dump({"percent": 99}),
            _dump({"percent": 100}),
            "exclusiveMaximum",
            "openai parse()",
        ),
        Case(
            "pattern",
            "json_schema",
            _strict(Product),
            _dump({"sku": "ABC-1234", "name": "widget"}),
            _dump({"sku": "AB-12345", "name": "widget"}),
            "pattern",
            "openai parse()",
        ),
        Case(
            "additionalProperties false",
            "json_schema",
            _strict(Person),
            _dump({"name": "Bob", "age": 42}),
            _dump({"name": "Bob", "age": 42, "extra": 1}),
            "additionalProperties",
            "openai parse()",
        ),
        Case(
            "dict[str, int]",
            "json_schema",
            _plain(Scores),
            _dump({"scores": {"alice": 3, "bob": 5}}),
            _dump({"scores": {"alice": "three"}}),
            "additionalProperties schema",
            "LangChain/LiteLLM",
        ),
        Case(
            "array bounds",
            "json_schema",
            _strict(Tagged),
            _dump({"tags": ["a", "b"]}),
            _dump({"tags": ["a", "b", "c", "d"]}),
            "maxItems",
            "openai parse()",
        ),
        Case(
            "recursive tree",
            "json_schema",
            _strict(Node),
            _dump(tree),
            _dump(bad_tree),
            "type (depth 3)",
            "openai parse()",
        ),
        Case(
            "recursive Optional chain",
            "json_schema",
            _strict(Linked),
            _dump(chain),
            _dump({"value": 1, "next": {"value": 2, "next": 5}}),
            "anyOf $ref|null",
            "openai parse()",
        ),
        Case(
            "discriminated union",
            "json_schema",
            _plain(Owner),
            _dump({"pet": {"pet_type": "dog", "barks": 2.5}}),
            _dump({"pet": {"pet_type": "cat", "barks": 2.5}}),
            "oneOf",
            "LangChain/LiteLLM",
        ),
        Case(
            "tuple (prefixItems)",
            "json_schema",
            _plain(Shape),
            _dump({"point": [1, 2, "a"]}),
            _dump({"point": [1, "a", "b"]}),
            "prefixItems",
            "LangChain/LiteLLM",
        ),
        Case(
            "const",
            "json_schema",
            _strict(Versioned),
            _dump({"version": "v1", "payload": "x"}),
            _dump({"version": "v2", "payload": "x"}),
            "const",
            "openai parse()",
        ),
        Case(
            "type list [string, null]",
            "json_schema",
            {
                "$schema": "http://json-schema.org/draft-07/schema#",
                "type": "object",
                "properties": {"a": {"type": ["string", "null"]}, "b": {"type": "boolean"}},
                "required": ["a", "b"],
                "additionalProperties": False,
            },
            _dump({"a": None, "b": False}),
            _dump({"a": 1, "b": False}),
            "type list",
            "zod / hand-written",
        ),
        Case(
            "function tool parameters",
            "json_schema",
            weather_tool,
            _dump({"location": "Paris, France", "unit": "celsius"}),
            _dump({"location": "Paris, France", "unit": "kelvin"}),
            "enum",
            "openai tools (strict)",
        ),
        Case(
            "tool_choice=required array",
            "json_schema",
            _tool_required_schema(),
            _dump(
                [
                    {"name": "get_weather", "parameters": {"location": "Oslo", "unit": "celsius"}},
                    {"name": "search_web", "parameters": {"query": "oslo events", "max_results": 3}},
                ]
            ),
            _dump([{"name": "get_weather", "parameters": {"query": "oslo events", "max_results": 3}}]),
            "anyOf branch",
            "vLLM tool_choice=required",
        ),
        Case(
            "LangChain joke (descriptions)",
            "json_schema",
            _plain(Joke),
            _dump({"setup": "Why did the chicken cross the road?", "punchline": "To get to the other side."}),
            _dump({"setup": "Why?", "punchline": "Because.", "rating": "high"}),
            "Optional int",
            "LangChain",
        ),
        Case(
            "large resume",
            "json_schema",
            _strict(Resume),
            _dump(resume),
            _dump(bad_resume),
            "deep enum",
            "openai parse()",
        ),
        Case(
            "json_object",
            "json_object",
            None,
            _dump({"a": [1, 2.5, {"b": None}], "c": "x", "d": True}),
            '{"a": [1, 2,]}',
            "JSON syntax",
        ),
        Case("regex phone", "regex", r"\(\d{3}\) \d{3}-\d{4}", "(555) 123-4567", "(555) 1234-567", "regex"),
        Case(
            "regex email-like",
            "regex",
            r"[a-z0-9._%+-]+@[a-z0-9.-]+\.[a-z]{2,}",
            "bob.smith@example.com",
            "bob@example",
            "regex (incomplete)",
        ),
        Case("choice", "choice", ["positive", "negative", "neutral"], "neutral", "happy", "choice"),
        Case(
            "GBNF/EBNF arithmetic",
            "gbnf",
            'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= factor (("*" | "/") factor)*\n'
            'factor ::= [0-9]+ | "(" expr ")"\n',
            "(1+2)*34-5",
            "(1+2))*3",
            "grammar",
        ),
        Case(
            "Lark arithmetic",
            "lark",
            'start: expr\nexpr: term (("+" | "-") term)*\nterm: factor (("*" | "/") factor)*\n'
            'factor: /[0-9]+/ | "(" expr ")"\n',
            "(1+2)*34-5",
            "(1+2))*3",
            "grammar",
        ),
    ]
    return cases


def beyond() -> list[Case]:
    """Keywords outside the common set, and broken schemas: does each library enforce, refuse (its message is
    what a 400 would carry) or silently ignore them (then a 'stop' output can fail validation)?"""
    obj = {"type": "object"}
    return [
        Case(
            "not",
            "json_schema",
            {**obj, "properties": {"a": {"not": {"type": "string"}}}, "required": ["a"]},
            '{"a": 1}',
            '{"a": "x"}',
            "not",
        ),
        Case(
            "allOf",
            "json_schema",
            {
                "allOf": [
                    {**obj, "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                    {"properties": {"b": {"type": "string"}}, "required": ["b"]},
                ]
            },
            '{"a": 1, "b": "s"}',
            '{"a": 1}',
            "allOf (2nd branch's required)",
        ),
        Case(
            "if/then",
            "json_schema",
            {
                **obj,
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a"],
                "if": {"properties": {"a": {"const": 1}}},
                "then": {"required": ["b"]},
            },
            '{"a": 1, "b": 2}',
            '{"a": 1}',
            "if/then",
        ),
        Case(
            "uniqueItems",
            "json_schema",
            {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
            "[1, 2]",
            "[1, 1]",
            "uniqueItems",
        ),
        Case(
            "contains",
            "json_schema",
            {"type": "array", "items": {"type": "integer"}, "contains": {"const": 3}},
            "[1, 3]",
            "[1, 2]",
            "contains",
        ),
        Case("multipleOf", "json_schema", {"type": "integer", "multipleOf": 5}, "10", "7", "multipleOf"),
        Case(
            "patternProperties",
            "json_schema",
            {**obj, "patternProperties": {"^x_": {"type": "integer"}}, "additionalProperties": False},
            '{"x_a": 1}',
            '{"y": 1}',
            "patternProperties",
        ),
        Case(
            "minProperties", "json_schema", {**obj, "minProperties": 2}, '{"a": 1, "b": 2}', '{"a": 1}', "minProperties"
        ),
        Case(
            "dependentRequired",
            "json_schema",
            {**obj, "dependentRequired": {"a": ["b"]}},
            '{"a": 1, "b": 2}',
            '{"a": 1}',
            "dependentRequired",
        ),
        Case(
            "format uri",
            "json_schema",
            {"type": "string", "format": "uri"},
            '"https://example.com/x"',
            '"not a uri"',
            "format uri",
        ),
        Case(
            "format hostname",
            "json_schema",
            {"type": "string", "format": "hostname"},
            '"example.com"',
            '"no spaces allowed"',
            "format hostname",
        ),
        Case("broken: unknown type", "json_schema", {"type": "foo"}, "1", "1", "-"),
        Case("broken: dangling $ref", "json_schema", {"$ref": "#/$defs/Missing"}, "1", "1", "-"),
    ]


def check_corpus(cases: list[Case]) -> list[str]:
    """The corpus itself: every valid instance validates (jsonschema), every invalid one does not."""
    import jsonschema

    problems = []
    for case in cases:
        if case.kind != "json_schema":
            continue
        validator = jsonschema.validators.validator_for(case.spec)(case.spec, format_checker=jsonschema.FormatChecker())
        if list(validator.iter_errors(json.loads(case.valid))):
            problems.append(f"{case.name}: the valid instance does not validate")
        if not list(validator.iter_errors(json.loads(case.invalid))):
            problems.append(f"{case.name}: the invalid instance validates (jsonschema cannot check {case.feature}?)")
    return problems


# ---- the libraries, behind one small interface ------------------------------------------------------------


class Unsupported(Exception):
    pass


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        start = time.perf_counter()
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.setup_seconds = time.perf_counter() - start
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=True)
        self.batcher = xgr.BatchGrammarMatcher(max_threads=2)
        self.batcher1 = xgr.BatchGrammarMatcher(max_threads=1)
        self.version = _dist_version("xgrammar")

    def _compile(self, case: Case):
        c = self.compiler
        if case.kind == "json_schema":
            return c.compile_json_schema(json.dumps(case.spec), any_whitespace=False, separators=SEPARATORS)
        if case.kind == "json_object":
            return c.compile_builtin_json_grammar()
        if case.kind == "regex":
            return c.compile_regex(case.spec)
        if case.kind == "choice":
            return c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in case.spec))
        if case.kind == "gbnf":
            return c.compile_grammar(case.spec)
        if case.kind == "lark":
            return c.compile_lark(case.spec)
        raise Unsupported(case.kind)

    def compile(self, case: Case):
        """(compiled, cold seconds, cached seconds)."""
        self.compiler.clear_cache()
        start = time.perf_counter()
        compiled = self._compile(case)
        cold = time.perf_counter() - start
        start = time.perf_counter()
        self._compile(case)
        return compiled, cold, time.perf_counter() - start

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher, bitmask: torch.Tensor, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def forced(self, matcher) -> bytes | None:
        return matcher.find_jump_forward_string().encode()

    def reset(self, matcher) -> None:
        matcher.reset()

    def batch_fill(self, matchers: list, bitmask: torch.Tensor, threads: int = 2) -> None:
        (self.batcher if threads == 2 else self.batcher1).batch_fill_next_token_bitmask(matchers, bitmask)


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg = llguidance
        start = time.perf_counter()
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.setup_seconds = time.perf_counter() - start
        self.executor = llguidance.LLExecutor(num_threads=2)
        self.executor1 = llguidance.LLExecutor(num_threads=1)
        self.version = _dist_version("llguidance")

    def _grammar(self, case: Case) -> str:
        llg = self.llg
        options = {"whitespace_flexible": False, "item_separator": SEPARATORS[0], "key_separator": SEPARATORS[1]}
        if case.kind == "json_schema":
            return llg.LLMatcher.grammar_from_json_schema(case.spec, defaults=options)
        if case.kind == "json_object":
            return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=options)
        if case.kind == "regex":
            return llg.LLMatcher.grammar_from_regex(case.spec)
        if case.kind == "choice":
            return llg.grammar_from("choice", json.dumps(case.spec))
        if case.kind == "gbnf":
            return llg.grammar_from("gbnf", case.spec)
        if case.kind == "lark":
            return llg.LLMatcher.grammar_from_lark(case.spec)
        raise Unsupported(case.kind)

    def _matcher(self, case: Case):
        matcher = self.llg.LLMatcher(self.tokenizer, self._grammar(case), log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def compile(self, case: Case):
        """No compile cache in the library: a compiled grammar is a pristine LLMatcher, and a request's matcher
        its deep_copy() (what 'cached' times)."""
        start = time.perf_counter()
        pristine = self._matcher(case)
        cold = time.perf_counter() - start
        start = time.perf_counter()
        pristine.deep_copy()
        return pristine, cold, time.perf_counter() - start

    def matcher(self, compiled):
        return compiled.deep_copy()

    def fill(self, matcher, bitmask: torch.Tensor, row: int) -> None:
        self.llg.torch.fill_next_token_bitmask(matcher, bitmask, row)

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)

    def forced(self, matcher) -> bytes | None:
        return matcher.compute_ff_bytes()

    def reset(self, matcher) -> None:
        matcher.reset()

    def batch_fill(self, matchers: list, bitmask: torch.Tensor, threads: int = 2) -> None:
        executor = self.executor if threads == 2 else self.executor1
        self.llg.torch.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)], bitmask)


def byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the character a byte-level BPE token uses -> the byte it stands for."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1))
    printable += list(range(ord("\xae"), ord("\xff") + 1))
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


def byte_level_vocabulary(tokenizer) -> tuple[dict[bytes, list[int]], int]:
    """The tokenizer's tokens as the bytes they stand for (GPT-2 byte-level BPE), without special tokens."""
    decode = byte_level_decoder()
    specials = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    vocabulary: dict[bytes, list[int]] = {}
    for token, token_id in tokenizer.get_vocab().items():
        if token_id in specials:
            continue
        vocabulary.setdefault(bytes(decode[c] for c in token), []).append(token_id)
    return vocabulary, tokenizer.eos_token_id


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tokenizer, vocab_size: int) -> None:
        import outlines_core

        self.oc = outlines_core
        start = time.perf_counter()
        tokens, eos = byte_level_vocabulary(tokenizer)
        self.vocabulary = outlines_core.Vocabulary(eos, tokens)
        self.setup_seconds = time.perf_counter() - start
        self.eos = eos
        self.version = _dist_version("outlines-core")

    def regex(self, case: Case) -> str:
        if case.kind == "json_schema":
            return self.oc.json_schema.build_regex_from_schema(json.dumps(case.spec))
        if case.kind == "json_object":
            return self.oc.json_schema.build_regex_from_schema(json.dumps({"type": "object"}))
        if case.kind == "regex":
            return case.spec
        if case.kind == "choice":
            return "(" + "|".join(re.escape(s) for s in case.spec) + ")"
        raise Unsupported(f"{case.kind}: outlines-core compiles regular languages only")

    def compile(self, case: Case):
        """No cache in the library (an Index can be kept and shared by Guides, which is what 'cached' times)."""
        regex = self.regex(case)
        start = time.perf_counter()
        index = self.oc.Index(regex, self.vocabulary)
        cold = time.perf_counter() - start
        start = time.perf_counter()
        self.oc.Guide(index)
        return index, cold, time.perf_counter() - start

    def matcher(self, compiled):
        return self.oc.Guide(compiled)

    def fill(self, matcher, bitmask: torch.Tensor, row: int) -> None:
        target = bitmask[row]
        matcher.write_mask_into(target.data_ptr(), target.numel(), target.element_size())

    def accept(self, matcher, token: int) -> bool:
        try:
            matcher.advance(token, return_tokens=False)
            return True
        except Exception:
            return False

    def forced(self, matcher) -> bytes | None:
        return None  # no jump-forward API

    def reset(self, matcher) -> None:
        matcher.reset()

    def batch_fill(self, matchers: list, bitmask: torch.Tensor, threads: int = 2) -> None:
        for row, matcher in enumerate(matchers):  # no batched API
            self.fill(matcher, bitmask, row)


def _dist_version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


# ---- measurements ----------------------------------------------------------------------------------------


def bit(bitmask: torch.Tensor, row: int, token: int) -> bool:
    return bool((int(bitmask[row, token // 32]) >> (token % 32)) & 1)


@dataclass
class Walk:
    accepted: bool  # every token in the mask and accepted, and EOS allowed at the end
    mask_ns: list[int] = field(default_factory=list)
    accept_ns: list[int] = field(default_factory=list)
    mismatch: int = 0  # tokens the mask refused but accept_token took (or the reverse)
    forced_bytes: int = 0  # bytes of the instance the grammar dictates (jump-forward could append them)
    total_bytes: int = 0
    single: int = 0  # positions whose mask allows exactly one token: skipping their forward is exact


def walk(lib, compiled, tokens: list[int], text: bytes, eos: int, vocab_size: int) -> Walk:
    """Feeds `tokens` one by one as a generation would: mask, check the token's bit, accept; then EOS."""
    import xgrammar as xgr

    matcher = lib.matcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    result = Walk(accepted=True, total_bytes=len(text))
    offset = 0
    covered_until = 0
    for token in tokens:
        if offset >= covered_until:
            forced = lib.forced(matcher)
            if forced and text[offset:].startswith(forced):
                result.forced_bytes += len(forced)
                covered_until = offset + len(forced)
        start = time.perf_counter_ns()
        lib.fill(matcher, bitmask, 0)
        mid = time.perf_counter_ns()
        allowed = bit(bitmask, 0, token)
        if int(numpy.unpackbits(bitmask[0].numpy().view(numpy.uint8)).sum()) == 1:
            result.single += 1
        t0 = time.perf_counter_ns()
        ok = lib.accept(matcher, token)
        end = time.perf_counter_ns()
        result.mask_ns.append(mid - start)
        result.accept_ns.append(end - t0)
        if allowed != ok:
            result.mismatch += 1
        if not (allowed and ok):
            result.accepted = False
            return result
        offset += len(_TOKEN_BYTES[token])
    lib.fill(matcher, bitmask, 0)
    if not bit(bitmask, 0, eos):
        result.accepted = False
    return result


_TOKEN_BYTES: dict[int, bytes] = {}


def coverage(libs: list, cases: list[Case], tokenizer, eos: int, vocab_size: int) -> dict:
    results: dict[str, dict[str, dict]] = {lib.name: {} for lib in libs}
    for lib in libs:
        for case in cases:
            row: dict[str, Any] = {}
            results[lib.name][case.name] = row
            try:
                if lib.name == "outlines-core":
                    compiled, cold, cached = compile_with_timeout(lib, case)
                else:
                    compiled, cold, cached = lib.compile(case)
            except Unsupported as exc:
                row["status"] = "unsupported"
                row["why"] = str(exc)
                continue
            except Exception as exc:  # the library's reason: what a 400 would say
                row["status"] = "error"
                row["why"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
                continue
            row.update(status="ok", cold=cold, cached=cached)
            good = tokenizer.encode(case.valid, add_special_tokens=False)
            bad = tokenizer.encode(case.invalid, add_special_tokens=False)
            valid_walk = walk(lib, compiled, good, case.valid.encode(), eos, vocab_size)
            invalid_walk = walk(lib, compiled, bad, case.invalid.encode(), eos, vocab_size)
            row.update(
                accepts_valid=valid_walk.accepted,
                rejects_invalid=not invalid_walk.accepted,
                mask_ns=valid_walk.mask_ns,
                accept_ns=valid_walk.accept_ns,
                mismatch=valid_walk.mismatch + invalid_walk.mismatch,
                forced=valid_walk.forced_bytes,
                single=valid_walk.single,
                total=valid_walk.total_bytes,
                tokens=len(good),
                compiled=compiled,
            )
    return results


def compile_with_timeout(lib: OutlinesCore, case: Case):
    """outlines-core's compile can take minutes (a DFA over the whole vocabulary): it runs in a forked child
    with a time limit, which sends the Index back pickled."""
    import pickle

    if case.kind in ("gbnf", "lark"):
        lib.regex(case)  # raises Unsupported
    parent, child = multiprocessing.Pipe(duplex=False)
    process = multiprocessing.get_context("fork").Process(target=_outlines_probe, args=(lib, case, child))
    process.start()
    if not parent.poll(OUTLINES_COMPILE_TIMEOUT):
        process.kill()
        process.join()
        raise TimeoutError(f"compile did not finish in {OUTLINES_COMPILE_TIMEOUT:.0f} s")
    status, detail, cold, cached = parent.recv()
    process.join()
    if status != "ok":
        raise RuntimeError(detail)
    return pickle.loads(detail), cold, cached


def _outlines_probe(lib: OutlinesCore, case: Case, conn) -> None:
    import pickle

    try:
        index, cold, cached = lib.compile(case)
        conn.send(("ok", pickle.dumps(index), cold, cached))
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}", 0, 0))


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


@dataclass
class Lane:
    compiled: Any
    tokens: list[int]
    matcher: Any = None
    position: int = 0


def lanes_for(lib, results: dict, cases: list[Case], tokenizer) -> list[Lane]:
    """32 concurrent requests over the JSON-schema cases this library handles, each at its own place."""
    usable = [c for c in cases if c.kind == "json_schema" and results[c.name].get("accepts_valid")]
    lanes = []
    for i in range(BATCH):
        case = usable[i % len(usable)]
        lane = Lane(results[case.name]["compiled"], tokenizer.encode(case.valid, add_special_tokens=False))
        lane.matcher = lib.matcher(lane.compiled)
        lane.position = (i * 7) % len(lane.tokens)  # stagger: not all at the first token
        for token in lane.tokens[: lane.position]:
            lib.accept(lane.matcher, token)
        lanes.append(lane)
    return lanes


def advance(lib, lanes: list[Lane]) -> None:
    for lane in lanes:
        if lane.position >= len(lane.tokens):
            lib.reset(lane.matcher)
            lane.position = 0
        lib.accept(lane.matcher, lane.tokens[lane.position])
        lane.position += 1


def batched(lib, results: dict, cases: list[Case], tokenizer, vocab_size: int, steps: int) -> dict:
    """Per step, 32 masks: a loop of single fills, the batched API on 1 and on 2 threads (interleaved step by
    step, so that the machine's other load falls on all three alike)."""
    import xgrammar as xgr

    modes = ("loop", "batch1", "batch2")
    lanes = {mode: lanes_for(lib, results, cases, tokenizer) for mode in modes}
    bitmask = xgr.allocate_token_bitmask(BATCH, vocab_size)
    out: dict[str, list[int]] = {mode: [] for mode in modes}
    for _ in range(steps):
        for mode in modes:
            start = time.perf_counter_ns()
            if mode == "loop":
                for row, lane in enumerate(lanes[mode]):
                    lib.fill(lane.matcher, bitmask, row)
            else:
                lib.batch_fill([lane.matcher for lane in lanes[mode]], bitmask, threads=1 if mode == "batch1" else 2)
            out[mode].append(time.perf_counter_ns() - start)
            advance(lib, lanes[mode])
    return out


def apply_costs(vocab_size: int, repeats: int = 50) -> dict:
    """Applying a [32, ceil(V/32)] int32 bitmask to [32, V] float32 logits on the CPU, whole or split in two: the
    unpack to a bool mask (can run on the mask thread, during the forward) and the masked_fill_ (after it)."""
    import xgrammar as xgr

    bitmask = torch.randint(-(2**31), 2**31 - 1, (BATCH, (vocab_size + 31) // 32), dtype=torch.int32)
    logits = torch.randn(BATCH, vocab_size)
    shifts = torch.arange(32, dtype=torch.int32)
    bits_of_byte = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).bool()  # little-endian bit order

    def plain_torch(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().view(bitmask.shape[0], -1)[:, : logits.shape[1]]
        logits.masked_fill_(~allowed, float("-inf"))

    def unpack_refused(bitmask: torch.Tensor) -> torch.Tensor:
        allowed = bits_of_byte[bitmask.view(torch.uint8).long()].view(bitmask.shape[0], -1)[:, :vocab_size]
        return ~allowed

    reference = logits.clone()
    plain_torch(reference, bitmask)
    check = logits.clone()
    xgr.apply_token_bitmask_inplace(check, bitmask, backend="cpu")
    assert torch.equal(check, reference)
    refused = unpack_refused(bitmask)
    check = logits.clone().masked_fill_(refused, float("-inf"))
    assert torch.equal(check, reference)
    bias = torch.zeros(BATCH, vocab_size).masked_fill_(refused, float("-inf"))
    assert torch.equal(logits.clone().add_(bias), reference)
    one_row = [0]
    out = {}
    for name, fn in (
        (
            "xgrammar apply_token_bitmask_inplace, cpu kernel, 32 rows",
            lambda x: xgr.apply_token_bitmask_inplace(x, bitmask, backend="cpu"),
        ),
        (
            "xgrammar apply_token_bitmask_inplace, cpu kernel, 1 constrained row (indices=)",
            lambda x: xgr.apply_token_bitmask_inplace(x, bitmask, indices=one_row, backend="cpu"),
        ),
        ("plain torch, shift/and/masked_fill_, 32 rows", lambda x: plain_torch(x, bitmask)),
        ("split: unpack to bool via a 256x8 table (on the mask thread)", lambda x: unpack_refused(bitmask)),
        ("split: masked_fill_ with the bool mask (critical path)", lambda x: x.masked_fill_(refused, float("-inf"))),
        ("split: add_ a -inf/0 bias built on the mask thread (critical path)", lambda x: x.add_(bias)),
    ):
        times = []
        for _ in range(repeats):
            x = logits.clone()
            start = time.perf_counter_ns()
            fn(x)
            times.append(time.perf_counter_ns() - start)
        out[name] = times
    return out


def _wake_lateness(call, seconds: float = 1.0) -> dict:
    """A worker thread makes `call` over and over while the main thread sleeps 2 ms at a time and measures how
    late it wakes. A call that holds the GIL makes the main thread wait for it to end (lateness ~ the call's
    length); one that releases the GIL lets it run at once (lateness ~ scheduling noise, well under the call)."""
    stop = threading.Event()
    calls: list[float] = []

    def worker() -> None:
        while not stop.is_set():
            start = time.perf_counter()
            call()
            calls.append(time.perf_counter() - start)

    thread = threading.Thread(target=worker)
    thread.start()
    time.sleep(0.05)
    late = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        start = time.perf_counter()
        time.sleep(0.002)
        late.append(time.perf_counter() - start - 0.002)
    stop.set()
    thread.join()
    return {
        "call_ms": statistics.median(calls) * 1e3,
        "late_p50_ms": statistics.median(late) * 1e3,
        "late_p90_ms": percentile(late, 90) * 1e3,
    }


def gil_release(lib, results: dict, cases: list[Case], tokenizer, vocab_size: int) -> dict:
    """One native call fills 16 x 32 masks (the library's single-threaded batched API; for outlines-core, which
    has none, a Python loop of single fills, so mostly Python holding the GIL)."""
    import xgrammar as xgr

    lanes = [lane for _ in range(16) for lane in lanes_for(lib, results, cases, tokenizer)]
    matchers = [lane.matcher for lane in lanes]
    bitmask = xgr.allocate_token_bitmask(len(lanes), vocab_size)
    return _wake_lateness(lambda: lib.batch_fill(matchers, bitmask, threads=1))


def gil_references() -> dict:
    """The same test with native calls known to hold the GIL (bytes.count) and to release it (hashlib on large
    data), each about 20 ms: what 'held' and 'released' read as on this machine, under its current load."""
    import hashlib

    data = os.urandom(1 << 25)

    def sized(fn):
        size = 1 << 16
        while size < len(data):
            start = time.perf_counter()
            fn(size)
            if time.perf_counter() - start > 0.02:
                break
            size *= 2
        return lambda: fn(size)

    return {
        "bytes.count (holds the GIL)": _wake_lateness(sized(lambda n: data[:n].count(b"\x00\x01\x02"))),
        "hashlib.sha256 (releases the GIL)": _wake_lateness(
            sized(lambda n: hashlib.sha256(memoryview(data)[:n]).digest())
        ),
    }


def engine_overlap(libs: list, all_results: dict, cases: list[Case], tokenizer, vocab_size: int, steps: int) -> dict:
    """Our real decode forward (LLMEngine, embedded SmolLM2, 32 sequences) with the next step's 32 masks
    computed on a thread during it, as the integration would, then the bitmask applied to the step's logits
    (xgrammar's CPU kernel, on a copy). Modes take turns step by step (the machine's other load falls on all);
    per step: forward, mask on the thread, forward + join, apply."""
    import xgrammar as xgr

    from pagedserve.engine import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(EngineConfig(max_num_seqs=BATCH))
    original = engine.runner.execute
    modes: list[tuple[str, Any, int, bool]] = [("no mask", None, 0, False)]
    for lib in libs:
        if lib.name == "outlines-core":
            modes.append((f"{lib.name}, loop of fills", lib, 1, False))
            continue
        for threads in (1, 2):
            modes.append((f"{lib.name}, batched fill on {threads} thread(s)", lib, threads, False))
        if lib.name == "xgrammar":
            modes.append((f"{lib.name}, 1 thread, -inf bias built on it too; add_ after", lib, 1, True))
    lanes = {name: lanes_for(lib, all_results[lib.name], cases, tokenizer) for name, lib, _, _ in modes if lib}
    record: dict[str, list[tuple[float, float, float, float]]] = {name: [] for name, *_ in modes}
    bitmask = xgr.allocate_token_bitmask(BATCH, vocab_size)
    bias = torch.zeros(BATCH, vocab_size)
    turn = [0]

    def execute(scheduled, copies=None):
        decode = len(scheduled) == BATCH and all(s.num_new_tokens == 1 for s in scheduled)
        name, lib, threads, with_bias = modes[turn[0] % len(modes)] if decode else ("prefill", None, 0, False)
        mask_seconds = [0.0]
        thread = None
        if lib is not None:
            matchers = [lane.matcher for lane in lanes[name]]

            def fill() -> None:
                start = time.perf_counter()
                lib.batch_fill(matchers, bitmask, threads=threads)
                if with_bias:
                    xgr.apply_token_bitmask_inplace(bias.zero_(), bitmask, backend="cpu")
                mask_seconds[0] = time.perf_counter() - start

            thread = threading.Thread(target=fill)
        start = time.perf_counter()
        if thread:
            thread.start()
        logits = original(scheduled, copies)
        forward = time.perf_counter() - start
        if thread:
            thread.join()
        both = time.perf_counter() - start
        apply = 0.0
        if lib is not None:
            copy = logits.sampling.clone()
            start = time.perf_counter()
            if with_bias:
                copy.add_(bias)
            else:
                xgr.apply_token_bitmask_inplace(copy, bitmask, backend="cpu")
            apply = time.perf_counter() - start
            advance(lib, lanes[name])
        if decode:
            record[name].append((forward, mask_seconds[0], both, apply))
            turn[0] += 1
        return logits

    engine.runner.execute = execute
    prompts = [tokenizer.encode(f"Write the JSON for user number {i}.", add_special_tokens=False) for i in range(BATCH)]
    for i, ids in enumerate(prompts):
        engine.add_request(
            f"r{i}", ids, SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True, detokenize=False)
        )
    while engine.has_unfinished_requests():
        engine.step()
    return record


# ---- report ----------------------------------------------------------------------------------------------


def reason(why: str) -> str:
    """The library's message without the exception type and xgrammar's '[time] file:line: ' prefix."""
    message = why.split(": ", 1)[-1]
    return re.sub(r"^\[[0-9:]+\] \S+: ", "", message)[:90]


def ms(ns: float) -> str:
    return f"{ns / 1e6:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-engine", action="store_true", help="skip the overlap with our real forward")
    parser.add_argument("--steps", type=int, default=64, help="steps of the 32-matcher walk")
    parser.add_argument("--engine-steps", type=int, default=140, help="decode steps of the forward-overlap run")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from pagedserve.engine.worker.weights.checkpoint import embedded_gguf_path, materialize_gguf

    torch.set_num_threads(2)
    model_dir = materialize_gguf(embedded_gguf_path())
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    vocab_size = len(tokenizer)
    eos = tokenizer.eos_token_id
    byte_of = byte_level_decoder()
    for token, token_id in tokenizer.get_vocab().items():
        _TOKEN_BYTES[token_id] = bytes(byte_of.get(c, 0) for c in token)
    print(
        f"tokenizer: {model_dir.name}, vocab {vocab_size}, eos {eos}; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.2f}"
    )

    cases = corpus()
    for problem in check_corpus(cases):
        print("corpus note:", problem)
    libs: list[Any] = [
        XGrammar(tokenizer, vocab_size),
        LLGuidance(tokenizer, vocab_size),
        OutlinesCore(tokenizer, vocab_size),
    ]
    for lib in libs:
        print(f"{lib.name} {lib.version}: tokenizer setup {lib.setup_seconds * 1e3:.0f} ms (once per model)")

    results = coverage(libs, cases, tokenizer, eos, vocab_size)
    extra = beyond()
    extra_results = coverage(libs, extra, tokenizer, eos, vocab_size)

    # 1. coverage
    print("\n## Coverage: compiles / accepts the valid instance / rejects the invalid one  (- = not applicable)")
    print(f"| case | source | invalid violates | {' | '.join(lib.name for lib in libs)} |")
    print("|---|---|---|" + "---|" * len(libs))
    for case in cases:
        cells = []
        for lib in libs:
            r = results[lib.name][case.name]
            if r["status"] != "ok":
                cells.append(f"{r['status']}: {r['why'][:70]}")
            else:
                mark = (
                    ("ok" if r["accepts_valid"] else "REFUSES VALID")
                    + " / "
                    + ("rejects" if r["rejects_invalid"] else "ACCEPTS INVALID")
                )
                if r["mismatch"]:
                    mark += f" (mask/accept disagree x{r['mismatch']})"
                cells.append(mark)
        print(f"| {case.name} | {case.source or case.kind} | {case.feature} | {' | '.join(cells)} |")
    print("\n| totals | " + " | ".join(lib.name for lib in libs) + " |")
    print("|---|" + "---|" * len(libs))
    json_cases = [c for c in cases if c.kind == "json_schema"]
    other_cases = [c for c in cases if c.kind != "json_schema"]
    for label, subset in (
        (f"{len(json_cases)} JSON schemas", json_cases),
        (f"{len(other_cases)} other constraints", other_cases),
    ):
        for what, key in (
            ("compile", None),
            ("accept valid", "accepts_valid"),
            ("reject invalid", "rejects_invalid"),
            ("both (exact)", "both"),
        ):
            cells = []
            for lib in libs:
                rows = [results[lib.name][c.name] for c in subset]
                if key is None:
                    n = sum(r["status"] == "ok" for r in rows)
                elif key == "both":
                    n = sum(r.get("accepts_valid", False) and r.get("rejects_invalid", False) for r in rows)
                else:
                    n = sum(r.get(key, False) for r in rows)
                cells.append(f"{n}/{len(subset)}")
            print(f"| {label}: {what} | {' | '.join(cells)} |")

    print(
        "\n## Beyond the common set: enforced / refused (the library's reason) / IGNORED (the invalid instance passes)"
    )
    print(f"| schema | {' | '.join(lib.name for lib in libs)} |")
    print("|---|" + "---|" * len(libs))
    for case in extra:
        cells = []
        for lib in libs:
            r = extra_results[lib.name][case.name]
            if r["status"] != "ok":
                cells.append(f"refused: {reason(r['why'])}")
            elif not r["accepts_valid"]:
                cells.append("REFUSES VALID")
            else:
                cells.append("enforced" if r["rejects_invalid"] else "IGNORED")
        print(f"| {case.name} | {' | '.join(cells)} |")

    # 2. cost
    print(
        "\n## Cost per JSON schema (ms): compile cold / cached (xgrammar: its compiler cache; llguidance: deep_copy of "
        "a pristine matcher; outlines-core: a Guide on a kept Index)"
    )
    print(f"| case | {' | '.join(lib.name + ' cold / cached' for lib in libs)} |")
    print("|---|" + "---|" * len(libs))
    for case in cases:
        cells = []
        for lib in libs:
            r = results[lib.name][case.name]
            cells.append(f"{r['cold'] * 1e3:.2f} / {r['cached'] * 1e3:.3f}" if r["status"] == "ok" else "-")
        print(f"| {case.name} | {' | '.join(cells)} |")
    print("\n## Per-token mask, one request, over the valid instances' tokens (all cases that accept)")
    print(
        "| library | tokens | compile cold median / max (ms) | mask median (ms) | mask p99 (ms) | mask max (ms) | "
        "first mask median (ms) | accept median (ms) | worst case p99 |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for lib in libs:
        rows = [r for r in results[lib.name].values() if r.get("accepts_valid")]
        masks = [t for r in rows for t in r["mask_ns"]]
        firsts = [r["mask_ns"][0] for r in rows]
        accepts = [t for r in rows for t in r["accept_ns"]]
        colds = [r["cold"] * 1e9 for r in results[lib.name].values() if r["status"] == "ok"]
        worst = max(
            ((percentile(r["mask_ns"], 99), name) for name, r in results[lib.name].items() if r.get("accepts_valid"))
        )
        print(
            f"| {lib.name} | {len(masks)} | {ms(statistics.median(colds))} / {ms(max(colds))} | "
            f"{ms(statistics.median(masks))} | {ms(percentile(masks, 99))} | {ms(max(masks))} | "
            f"{ms(statistics.median(firsts))} | {ms(statistics.median(accepts))} | {worst[1]} {ms(worst[0])} |"
        )

    print(
        f"\n## {BATCH} concurrent matchers (the JSON-schema cases cycled, staggered), per step, {args.steps} steps (ms)"
    )
    print("| library | loop of single fills median / p99 | batched API, 1 thread | batched API, 2 threads |")
    print("|---|---|---|---|")
    for lib in libs:
        b = batched(lib, results[lib.name], cases, tokenizer, vocab_size, args.steps)
        cells = [f"{ms(statistics.median(b[m]))} / {ms(percentile(b[m], 99))}" for m in ("loop", "batch1", "batch2")]
        if lib.name == "outlines-core":
            cells[1] = cells[2] = "no batched API (loop)"
        print(f"| {lib.name} | {' | '.join(cells)} |")

    print("\n## Applying the bitmask to [32, vocab] float32 logits on the CPU (ms)")
    for name, times in apply_costs(vocab_size).items():
        print(f"- {name}: median {ms(statistics.median(times))}, p99 {ms(percentile(times, 99))}")

    # 3. API shape
    print("\n## GIL: how late a sleeping Python thread wakes (2 ms sleeps) while another thread makes mask calls")
    print("| caller | one call (ms) | wake lateness p50 (ms) | p90 (ms) |")
    print("|---|---|---|---|")
    for name, g in gil_references().items():
        print(f"| reference: {name} | {g['call_ms']:.1f} | {g['late_p50_ms']:.2f} | {g['late_p90_ms']:.2f} |")
    for lib in libs:
        g = gil_release(lib, results[lib.name], cases, tokenizer, vocab_size)
        what = (
            "Python loop of 512 single fills" if lib.name == "outlines-core" else "batched fill of 512 masks, 1 thread"
        )
        print(f"| {lib.name}: {what} | {g['call_ms']:.1f} | {g['late_p50_ms']:.2f} | {g['late_p90_ms']:.2f} |")

    print("\n## Jump-forward: bytes of the valid JSON instances the grammar alone dictates (fixed separators)")
    for lib in libs:
        rows = [results[lib.name][c.name] for c in json_cases if results[lib.name][c.name].get("accepts_valid")]
        if lib.name == "outlines-core":
            single, tokens = sum(r["single"] for r in rows), sum(r["tokens"] for r in rows)
            print(f"- {lib.name}: no forced-token API; {single}/{tokens} token positions have a one-token mask")
            continue
        forced, total = sum(r["forced"] for r in rows), sum(r["total"] for r in rows)
        single, tokens = sum(r["single"] for r in rows), sum(r["tokens"] for r in rows)
        print(
            f"- {lib.name}: {forced}/{total} bytes = {forced / total:.0%} over {len(rows)} schemas "
            f"({'find_jump_forward_string' if lib.name == 'xgrammar' else 'compute_ff_bytes / compute_ff_tokens'}); "
            f"{single}/{tokens} token positions = {single / tokens:.0%} have a mask of exactly one token"
        )

    if not args.no_engine:
        print(
            f"\n## Our decode forward (LLMEngine, {BATCH} sequences; modes take turns step by step) with the next "
            f"step's masks on a thread during it, and xgrammar's CPU kernel applying them after (ms)"
        )
        record = engine_overlap(libs, results, cases, tokenizer, vocab_size, steps=args.engine_steps)
        print(
            "| mode | steps | forward median | mask on thread median | forward + join median | forward + join p90 "
            "| apply median |"
        )
        print("|---|---|---|---|---|---|---|")
        for name, rows in record.items():
            fw, mk, both, ap = ([r[k] * 1e9 for r in rows] for k in range(4))
            print(
                f"| {name} | {len(rows)} | {ms(statistics.median(fw))} | {ms(statistics.median(mk))} | "
                f"{ms(statistics.median(both))} | {ms(percentile(both, 90))} | {ms(statistics.median(ap))} |"
            )
    print(f"\nload average at the end: {os.getloadavg()[0]:.2f} (1 min) on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
