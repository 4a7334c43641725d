"""The structured-output benchmark's schema corpus is sound: every schema compiles in the engine's grammar
library, and every schema's hand-written example is a valid instance of it (and is accepted by its grammar),
so a failure in the benchmark is the engine's, not the corpus's."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from transformers import PreTrainedTokenizerBase

from pagedserve.engine import StructuredOutput
from pagedserve.engine.structured.grammar import GrammarCompiler
from pagedserve.engine.text.hf_tokenizer import load_tokenizer
from tests.structured_corpus import CORPUS, FORMAT_CHECKER, Case

VOCAB_SIZE = 49152


@pytest.fixture(scope="module")
def tokenizer(smol_dir: Path) -> PreTrainedTokenizerBase:
    return load_tokenizer(smol_dir)


@pytest.fixture(scope="module")
def compiler(tokenizer: PreTrainedTokenizerBase) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, VOCAB_SIZE, frozenset())


def formats(schema: Any) -> Iterator[str]:
    """Every `format` a schema names, however deep."""
    if isinstance(schema, dict):
        if isinstance(schema.get("format"), str):
            yield schema["format"]
        for value in schema.values():
            yield from formats(value)
    elif isinstance(schema, list):
        for value in schema:
            yield from formats(value)


def test_the_corpus_has_fifty_schemas_with_unique_names() -> None:
    names = [case.name for case in CORPUS]
    assert len(names) >= 50 and len(set(names)) == len(names)


@pytest.mark.parametrize("case", CORPUS, ids=lambda case: case.name)
def test_the_schema_compiles(compiler: GrammarCompiler, case: Case) -> None:
    compiler.check(StructuredOutput.json_schema(case.schema))


@pytest.mark.parametrize("case", CORPUS, ids=lambda case: case.name)
def test_the_example_is_a_valid_instance(case: Case) -> None:
    jsonschema.Draft202012Validator.check_schema(case.schema)
    validator = jsonschema.Draft202012Validator(case.schema, format_checker=FORMAT_CHECKER)
    assert [error.message for error in validator.iter_errors(case.example)] == []
    assert set(formats(case.schema)) <= set(FORMAT_CHECKER.checkers), "a format the validator would not check"


@pytest.mark.parametrize("case", CORPUS, ids=lambda case: case.name)
def test_the_grammar_accepts_the_example(
    compiler: GrammarCompiler, tokenizer: PreTrainedTokenizerBase, case: Case
) -> None:
    """As the engine writes JSON (json.dumps's separators): the grammar and the validator agree on it."""
    matcher = compiler.matcher(StructuredOutput.json_schema(case.schema))
    tokens = tokenizer.encode(json.dumps(case.example), add_special_tokens=False)
    assert matcher.consume_tokens(tokens) and matcher.is_accepting(), matcher.get_error()
