"""Reasoning split: `<think>...</think>` apart from the answer, whole and streamed replies cut anywhere."""

from __future__ import annotations

import random

import pytest

from pagedserve.server.reasoning import (
    ReasoningStream,
    prompt_opens_reasoning,
    reasoning_parser_for_template,
    split_reasoning,
)


def random_pieces(text: str, rng: random.Random, longest: int = 6) -> list[str]:
    pieces, position = [], 0
    while position < len(text):
        size = rng.randint(1, longest)
        pieces.append(text[position : position + size])
        position += size
    return pieces


def replay(pieces: list[str], starts_in_reasoning: bool = False) -> tuple[str, str]:
    stream = ReasoningStream(starts_in_reasoning)
    deltas = [stream.feed(piece) for piece in pieces] + [stream.finish()]
    return "".join(reasoning for reasoning, _ in deltas), "".join(content for _, content in deltas)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<think>\nThe user greets me.\n</think>\n\nHello!", ("\nThe user greets me.\n", "Hello!")),
        ("\n <think>x</think>answer", ("x", "answer")),
        ("<think></think>\n\n  Answer\n", ("", "Answer\n")),
        ("<think>\nStill thinking when the tokens ran out", ("\nStill thinking when the tokens ran out", "")),
        ("<think>a</think>b</think>c", ("a", "b</think>c")),
        ("<think>東京 🙂</think>\ncafé", ("東京 🙂", "café")),
    ],
)
def test_split_reasoning_with_a_think_block(text: str, expected: tuple[str, str]) -> None:
    assert split_reasoning(text) == expected


@pytest.mark.parametrize("text", ["Just an answer.", "", "  spaced answer ", "The <think> tag, mid-sentence.", "<thin"])
def test_split_reasoning_without_a_think_block_is_all_content(text: str) -> None:
    assert split_reasoning(text) == (None, text)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("Okay, the user wants...\n</think>\n\nAnswer", ("Okay, the user wants...\n", "Answer")),
        ("<think>\nrepeated opening tag</think>Answer", ("\nrepeated opening tag", "Answer")),
        ("Never closed", ("Never closed", "")),
        ("", ("", "")),
    ],
)
def test_split_reasoning_when_the_prompt_opened_the_think_block(text: str, expected: tuple[str, str]) -> None:
    assert split_reasoning(text, starts_in_reasoning=True) == expected


REPLIES = [
    "<think>\nThe user greets me.\n</think>\n\nHello!",
    "\n\n<think>a < b and </thinking> is not the tag</think>  \n answer </think> stays",
    "<think>unterminated </thi",
    "<thinking is not the tag",
    "Plain answer with <think> inside",
    "Okay...\n</think>\n\nAnswer",
    "  ",
    "<think></think>",
]


@pytest.mark.parametrize("starts_in_reasoning", [False, True])
@pytest.mark.parametrize("text", REPLIES)
def test_stream_matches_split_however_the_reply_is_cut(text: str, starts_in_reasoning: bool) -> None:
    reasoning, content = split_reasoning(text, starts_in_reasoning)
    rng = random.Random(42)
    for pieces in [list(text), [text]] + [random_pieces(text, rng) for _ in range(50)]:
        assert replay(pieces, starts_in_reasoning) == (reasoning or "", content), pieces


def test_stream_holds_back_only_what_may_be_a_tag() -> None:
    stream = ReasoningStream()
    assert stream.feed("\n<thi") == ("", "")
    assert stream.feed("nk>Let me") == ("Let me", "")
    assert stream.feed(" see.</th") == (" see.", "")
    assert stream.feed("ink>\n") == ("", "")
    assert stream.feed("\nThe answer") == ("", "The answer")
    assert stream.feed(" </think> is text now") == ("", " </think> is text now")
    assert stream.finish() == ("", "")


def test_stream_without_a_think_block_sends_content_once_the_start_is_known() -> None:
    stream = ReasoningStream()
    assert stream.feed(" <th") == ("", "")
    assert stream.feed("ree") == ("", " <three")


def test_stream_flushes_a_cut_tag_at_the_end() -> None:
    stream = ReasoningStream()
    assert stream.feed("<think>thinking </thi") == ("thinking ", "")
    assert stream.finish() == ("</thi", "")


def test_stream_starting_in_reasoning() -> None:
    stream = ReasoningStream(starts_in_reasoning=True)
    assert stream.feed("Hmm") == ("Hmm", "")
    assert stream.feed(", right.</think>") == (", right.", "")
    assert stream.feed("\n\nYes.") == ("", "Yes.")


def test_template_detection() -> None:
    assert reasoning_parser_for_template("{{ '<think>\\n' }}{{ message.reasoning_content }}{{ '</think>' }}")
    assert not reasoning_parser_for_template("{% for message in messages %}{{ message.content }}{% endfor %}")
    assert not reasoning_parser_for_template(None)


def test_prompt_opens_reasoning_only_when_the_think_block_is_left_open() -> None:
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # thinking switched off
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")
