"""Incremental detokenization with stop strings.

tokenizers' DecodeStream never yields half a UTF-8 character. On top of it, text that could still turn
into a stop string is held back, and a matched stop string is cut from the output.
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from pagedserve.engine.sampling_params import SamplingParams

PROMPT_CONTEXT_TOKENS = 4  # decoders drop a leading space at the start of a stream; prompt context avoids it


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=params.skip_special_tokens)
        context = prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]
        if context:
            self._stream.step(tokenizer, context)
        self._stops = params.stop
        self._max_stop_len = max((len(s) for s in self._stops), default=0)
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._num_tokens = 0
        self.text = ""  # everything decoded so far, held-back text included
        self._emitted = 0

    def update(self, token_ids: list[int]) -> tuple[str, str | None]:
        """Feeds new tokens; returns (text safe to emit now, the stop string that matched or None)."""
        checked_upto = len(self.text)
        for token_id in token_ids:
            piece = self._stream.step(self._tokenizer, token_id)
            if piece:
                self.text += piece
        self._num_tokens += len(token_ids)
        if not self._stops or self._num_tokens < self._min_tokens:
            return self._emit(len(self.text)), None
        match = self._find_stop(max(0, checked_upto - self._max_stop_len + 1))
        if match is not None:
            position, stop = match
            self.text = self.text[: position + (len(stop) if self._include_stop else 0)]
            return self._emit(len(self.text)), stop
        return self._emit(len(self.text) - self._held_back()), None

    def flush(self) -> str:
        """The held-back text, once the sequence has ended for another reason."""
        return self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        upto = max(upto, self._emitted)
        delta = self.text[self._emitted : upto]
        self._emitted = upto
        return delta

    def _find_stop(self, start: int) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self._stops:
            position = self.text.find(stop, start)
            if position != -1 and (best is None or position < best[0]):
                best = (position, stop)
        return best

    def _held_back(self) -> int:
        """Length of the longest end of the text that is the start of some stop string."""
        longest = 0
        tail = self.text[-self._max_stop_len :] if self._max_stop_len else ""
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(tail)), longest, -1):
                if tail.endswith(stop[:size]):
                    longest = size
                    break
        return longest
