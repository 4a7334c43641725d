"""A reasoning model's thinking apart from its answer: `<think>...</think>` (Qwen3, DeepSeek-R1 style) becomes
`reasoning_content`, the rest `content`.

Only a think block at the start of the reply counts. Some templates open it in the prompt, so the reply starts
inside it and only closes it (`starts_in_reasoning`). A block never closed is all reasoning: the reply ran out
while thinking. The whitespace between `</think>` and the answer is dropped.
"""

from __future__ import annotations

from enum import Enum, auto

from pagedserve.server.tool_parsers.base import partial_marker_length

THINK_START = "<think>"
THINK_END = "</think>"
THINK_PARSERS = ("think", "qwen3", "deepseek_r1")  # --reasoning-parser names of this format (vLLM's are the last)


def reasoning_parser_for_template(chat_template: str | None) -> bool:
    """Whether replies under this chat template may hold a think block to split off."""
    return THINK_START in (chat_template or "")


def prompt_opens_reasoning(prompt: str) -> bool:
    """Whether a rendered prompt ends inside a think block it opened, so that the reply starts in reasoning."""
    return prompt.rstrip().endswith(THINK_START)


def split_reasoning(text: str, starts_in_reasoning: bool = False) -> tuple[str | None, str]:
    """(reasoning, content) of a whole reply; reasoning is None when the reply has no think block."""
    head = text.lstrip()
    if head.startswith(THINK_START):
        thinking = head[len(THINK_START) :]
    elif starts_in_reasoning:
        thinking = text
    else:
        return None, text
    reasoning, _, content = thinking.partition(THINK_END)
    return reasoning, content.lstrip()


class _Phase(Enum):
    OPENING = auto()  # leading whitespace, and maybe the beginning of <think>
    REASONING = auto()
    AFTER_REASONING = auto()  # whitespace before the answer, dropped
    CONTENT = auto()


class ReasoningStream:
    """Splits a streamed reply as `split_reasoning` splits the whole one, holding back only text that may be a
    cut tag (and leading whitespace, until it is known whether a think block follows)."""

    def __init__(self, starts_in_reasoning: bool = False) -> None:
        self._starts_in_reasoning = starts_in_reasoning
        self._phase = _Phase.OPENING
        self._buffer = ""
        self._reasoning: list[str] = []
        self._content: list[str] = []

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning delta, content delta) for one text delta; either may be empty."""
        self._buffer += text
        return self._drain(final=False)

    def finish(self) -> tuple[str, str]:
        """The held-back text, at the end of the reply."""
        return self._drain(final=True)

    def _drain(self, final: bool) -> tuple[str, str]:
        while self._step(final):
            pass
        reasoning, content = "".join(self._reasoning), "".join(self._content)
        self._reasoning, self._content = [], []
        return reasoning, content

    def _step(self, final: bool) -> bool:
        """Handles what it can of the buffer; True when another step may do more."""
        if self._phase is _Phase.OPENING:
            return self._opening_step(final)
        if self._phase is _Phase.REASONING:
            return self._reasoning_step(final)
        if self._phase is _Phase.AFTER_REASONING:
            self._buffer = self._buffer.lstrip()
            if not self._buffer:
                return False
            self._phase = _Phase.CONTENT
        self._content.append(self._buffer)
        self._buffer = ""
        return False

    def _opening_step(self, final: bool) -> bool:
        head = self._buffer.lstrip()
        if head.startswith(THINK_START):
            self._buffer = head[len(THINK_START) :]
            self._phase = _Phase.REASONING
        elif not final and THINK_START.startswith(head):
            return False
        else:  # no think tag: the held text is replayed in the phase the reply starts in
            self._phase = _Phase.REASONING if self._starts_in_reasoning else _Phase.CONTENT
        return True

    def _reasoning_step(self, final: bool) -> bool:
        end = self._buffer.find(THINK_END)
        if end >= 0:
            self._reasoning.append(self._buffer[:end])
            self._buffer = self._buffer[end + len(THINK_END) :]
            self._phase = _Phase.AFTER_REASONING
            return True
        sendable = len(self._buffer) - (0 if final else partial_marker_length(self._buffer, THINK_END))
        self._reasoning.append(self._buffer[:sendable])
        self._buffer = self._buffer[sendable:]
        return False
