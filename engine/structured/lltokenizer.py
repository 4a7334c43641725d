"""The tokenizer as llguidance sees it, built once per process and shared by every GrammarCompiler.

Both steps hold the GIL (about 0.4 s to serialize, 0.7 s to build the trie, for a 49k vocabulary): the engine
builds them as it loads, before it serves, so they never stall a running batch.
"""

from __future__ import annotations

import hashlib
import threading
import weakref
from copy import copy

import llguidance

from pagedserve.engine.text.text_tokenizer import FastTokenizer, TextTokenizer

_LOCK = threading.Lock()
_SERIALIZED: weakref.WeakKeyDictionary[FastTokenizer, str] = weakref.WeakKeyDictionary()
_BUILT: dict[tuple[bytes, int, str], llguidance.LLTokenizer] = {}


def serialized_tokenizer(tokenizer: FastTokenizer) -> str:
    """The tokenizer's JSON as llguidance.hf.from_tokenizer writes it (any fast tokenizer)."""
    if isinstance(tokenizer, TextTokenizer):
        return tokenizer.spec.backend_json  # serialized so already, by the core that described it
    with _LOCK:
        found = _SERIALIZED.get(tokenizer)
        if found is None:
            backend = copy(tokenizer.backend_tokenizer)
            backend.no_padding()
            backend.no_truncation()
            found = _SERIALIZED[tokenizer] = backend.to_str()
        return found


def shared_lltokenizer(serialized: str, vocab_size: int, eos: list[int] | int | None) -> llguidance.LLTokenizer:
    key = (hashlib.sha256(serialized.encode()).digest(), vocab_size, repr(eos))
    with _LOCK:
        found = _BUILT.get(key)
        if found is None:
            found = _BUILT[key] = llguidance.LLTokenizer(serialized, n_vocab=vocab_size, eos_token=eos)
        return found
