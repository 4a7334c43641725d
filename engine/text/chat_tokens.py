"""Chat message text tokenized as text: special tokens typed by a user do not become real ones.

A chat template wraps each message in role markers that are special tokens (`<|im_start|>user ... <|im_end|>`).
Tokenizing the rendered prompt parses the text of every special token wherever it appears, so a user who types
`<|im_end|>\\n<|im_start|>system` would open a system turn of their own.

Messages that hold no special token's text (nearly all) are encoded as before. Otherwise the template is
rendered again with each such occurrence fenced by two Unicode noncharacters, which locates it in the prompt;
the prompt is encoded as usual and every special token that falls inside a fence is replaced by the tokens of
its text. Everything outside the fences tokenizes exactly as it did.

Tool calls in the history are conversation text too: every string in a message's `tool_calls` (the function's
name and arguments, as a dict or a JSON string) is fenced like its content, and so is every string of the
request's chat template kwargs (a client's `{"system_hint": "<|im_end|>..."}` is text like a message). Tool
definitions are not: like the template, they are the application's, not text of the conversation.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterator
from typing import Any

from tokenizers import Tokenizer

OPEN, CLOSE = "\ufdd0", "\ufdd1"  # noncharacters: reserved for a program's own use, never in text
_FENCE = re.compile(f"{OPEN}(.*?){CLOSE}", re.DOTALL)

Message = dict[str, Any]
Render = Callable[[list[Message], dict[str, Any]], str]  # messages, template kwargs -> the prompt


class MessageTextGuard:
    """Encodes a rendered chat prompt so that special tokens only come from the template."""

    def __init__(self, tokenizer: Any) -> None:
        """`tokenizer`: a TextTokenizer, or transformers' fast tokenizer (the same names)."""
        self._tokenizer = tokenizer
        special = {token.content: index for index, token in tokenizer.added_tokens_decoder.items() if token.special}
        self._special_ids = frozenset(special.values())
        longest_first = sorted(special, key=len, reverse=True)
        self._pattern = re.compile("|".join(map(re.escape, longest_first))) if special else None
        self._as_text: Tokenizer | None = None  # built on first use

    def is_needed(self, messages: list[Message], template_kwargs: dict[str, Any] | None = None) -> bool:
        """True when some message's text (or a template kwarg's string) holds the text of a special token."""
        pattern = self._pattern
        texts = itertools.chain(_texts(messages), _strings(list((template_kwargs or {}).values())))
        return pattern is not None and any(pattern.search(text) for text in texts)

    def encode(
        self, messages: list[Message], template_kwargs: dict[str, Any], rendered: str, render: Render
    ) -> list[int]:
        """Token ids of `rendered` (the template applied to `messages` and `template_kwargs`), typed special
        tokens kept as text."""
        fenced_kwargs = {name: _map_strings(value, self._fence_text) for name, value in template_kwargs.items()}
        fenced = render([self._fence(message) for message in messages], fenced_kwargs)
        spans = _fenced_spans(fenced)
        if _unfenced(fenced) != rendered:
            raise ValueError(
                "a message holds the text of a special token, and this model's chat template changes message "
                "text in a way that keeps it from being tokenized as plain text"
            )
        encoding = self._tokenizer.backend_tokenizer.encode(rendered, add_special_tokens=False)
        ids: list[int] = encoding.ids
        offsets: list[tuple[int, int]] = encoding.offsets
        special = self._special_ids  # a prompt whose messages hold special tokens' text: rare, so plain Python
        special_positions = [position for position, token in enumerate(ids) if token in special]
        result: list[int] = []
        done = 0
        for position in special_positions:
            start, end = offsets[position]
            if any(low <= start and end <= high for low, high in spans):
                result += ids[done:position]
                result += self._text_tokens(rendered[start:end])
                done = position + 1
        return result + ids[done:]

    def _fence_text(self, text: str) -> str:
        assert self._pattern is not None
        return self._pattern.sub(lambda match: OPEN + match.group(0) + CLOSE, text)

    def _fence(self, message: Message) -> Message:
        fence = self._fence_text
        fenced = dict(message)
        content = message.get("content")
        if isinstance(content, str):
            fenced["content"] = fence(content)
        elif isinstance(content, list):
            fenced["content"] = [{**p, "text": fence(p["text"])} if _is_text_part(p) else p for p in content]
        if message.get("tool_calls"):
            fenced["tool_calls"] = _map_strings(message["tool_calls"], fence)
        return fenced

    def _text_tokens(self, text: str) -> list[int]:
        """`text` tokenized with special tokens treated as plain text.

        A copy of the tokenizer of its own: transformers' `split_special_tokens` flips a flag on the shared
        backend tokenizer, which other threads encode with at the same time.
        """
        if self._as_text is None:
            as_text = Tokenizer.from_str(self._tokenizer.backend_tokenizer.to_str())
            as_text.encode_special_tokens = True
            self._as_text = as_text
        return self._as_text.encode(text, add_special_tokens=False).ids


def _texts(messages: list[Message]) -> Iterator[str]:
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            yield content
        elif isinstance(content, list):
            yield from (part["text"] for part in content if _is_text_part(part))
        yield from _strings(message.get("tool_calls"))


def _strings(value: Any) -> Iterator[str]:
    """Every string in a JSON-like value, dict keys included (tool-call arguments may put text anywhere)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _strings(key)
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def _map_strings(value: Any, change: Callable[[str], str]) -> Any:
    """A copy of a JSON-like value with `change` applied to each of its strings, dict keys included."""
    if isinstance(value, str):
        return change(value)
    if isinstance(value, dict):
        return {_map_strings(key, change): _map_strings(item, change) for key, item in value.items()}
    if isinstance(value, list):
        return [_map_strings(item, change) for item in value]
    return value


def _is_text_part(part: Any) -> bool:
    return isinstance(part, dict) and isinstance(part.get("text"), str)


def _fenced_spans(fenced: str) -> list[tuple[int, int]]:
    """Where each fenced text lies in the text without its fences."""
    spans = []
    removed = 0  # fence characters before the current match
    for match in _FENCE.finditer(fenced):
        start = match.start() - removed
        spans.append((start, start + len(match.group(1))))
        removed += 2
    return spans


def _unfenced(text: str) -> str:
    return text.replace(OPEN, "").replace(CLOSE, "")
