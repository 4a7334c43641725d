"""Incremental detokenization: UTF-8 safety, stop strings across token boundaries, hold-back."""

from __future__ import annotations

import pytest

from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.text.detokenizer import IncrementalDetokenizer
from pagedserve.engine.worker.model_loader import LoadedModel


@pytest.fixture(scope="module")
def tokenizer(smol_loaded: LoadedModel):
    return smol_loaded.tokenizer


def stream(tokenizer, text: str, params: SamplingParams) -> tuple[list[str], str | None]:
    prompt = tokenizer.encode("Say something:")
    detok = IncrementalDetokenizer(tokenizer.backend_tokenizer, prompt, params)
    pieces = []
    for token in tokenizer.encode(text, add_special_tokens=False):
        piece, stop = detok.update([token])
        pieces.append(piece)
        if stop is not None:
            return pieces, stop
    pieces.append(detok.flush())
    return pieces, None


def test_streamed_pieces_join_to_the_text(tokenizer) -> None:
    text = " Hello world, naïve café — 東京 🙂!"
    pieces, stop = stream(tokenizer, text, SamplingParams())
    assert "".join(pieces) == text and stop is None
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_across_tokens_is_cut(tokenizer) -> None:
    pieces, stop = stream(tokenizer, " Hello world, this is a test", SamplingParams(stop=["o wor"]))
    assert stop == "o wor"
    assert "".join(pieces) == " Hell"


def test_stop_string_kept_when_asked(tokenizer) -> None:
    params = SamplingParams(stop=["world"], include_stop_str_in_output=True)
    pieces, stop = stream(tokenizer, " Hello world, this is a test", params)
    assert stop == "world" and "".join(pieces) == " Hello world"


def test_possible_stop_prefix_is_held_back_then_released(tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer.backend_tokenizer, [], SamplingParams(stop=["wor!"]))
    emitted = ""
    for token in tokenizer.encode(" Hello wor", add_special_tokens=False):
        emitted += detok.update([token])[0]
    assert emitted == " Hello "  # "wor" could still become the stop string
    for token in tokenizer.encode("ld", add_special_tokens=False):
        emitted += detok.update([token])[0]
    assert emitted == " Hello world"


def test_earliest_of_several_stops_wins(tokenizer) -> None:
    pieces, stop = stream(tokenizer, " one two three four", SamplingParams(stop=["four", "two"]))
    assert stop == "two" and "".join(pieces) == " one "
