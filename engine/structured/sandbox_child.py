"""The grammar sandbox's child process: it compiles grammars first, so that one which crashes llguidance (a deep
chain of rules overflows its stack: SIGSEGV) ends this process, not the server's or the engine's.

sandbox.py runs this file as a script (`python sandbox_child.py`), not as part of pagedserve: it needs only the
standard library and llguidance, which keeps a restart after a crash under two seconds. Messages both ways are
a 4-byte big-endian length and UTF-8 JSON: first the parent's configuration, then one job per message,
{"source": [kind, spec, thinking], "compile": bool, "want_grammar": bool}, answered with {"error": the library's
reason or None, "stage": "compile" or "probe", "grammar": llguidance's grammar text when wanted}. The text comes
from here (grammar_source.py): converting a big grammar is seconds of Python. "compile": false only converts.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
import threading
from types import ModuleType
from typing import TYPE_CHECKING, Any, BinaryIO

if TYPE_CHECKING:
    import llguidance

HEADER_BYTES = 4


def encode_message(message: Any) -> bytes:
    data = json.dumps(message).encode()
    return len(data).to_bytes(HEADER_BYTES, "big") + data


def read_message(stream: BinaryIO) -> Any:
    """The next message, or None when the other side has closed the stream."""
    header = stream.read(HEADER_BYTES)
    if len(header) < HEADER_BYTES:
        return None
    data = stream.read(int.from_bytes(header, "big"))
    return json.loads(data)


def judge(tokenizer: llguidance.LLTokenizer, grammar: str, limits: dict[str, Any], probe_tokens: int) -> dict:
    """Compiles `grammar` as the engine will, then probes it: whatever would crash, crashes here."""
    import llguidance

    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=llguidance.LLParserLimits(**limits))
    if matcher.is_error():
        return {"error": matcher.get_error(), "stage": "compile"}
    return {"error": probe(matcher, probe_tokens), "stage": "probe"}


def probe(matcher: llguidance.LLMatcher, count: int) -> str | None:
    """The first mask, then each of the first `count` tokens it admits consumed on a copy. The library checks
    some limits (a row's items) on consuming but not on masking: such a grammar would fail its request at its
    first token, so it is refused before it runs."""
    mask = matcher.compute_bitmask()
    if matcher.is_error():
        return matcher.get_error()
    for token in allowed_tokens(mask, count):
        trial = matcher.deep_copy()
        if not trial.consume_token(token):
            return trial.get_error()
    return None


def allowed_tokens(mask: bytes, count: int) -> list[int]:
    """The first `count` tokens set in a packed mask (bit j of byte i is token 8 i + j)."""
    tokens: list[int] = []
    for index, byte in enumerate(mask):
        for bit in range(8):
            if byte >> bit & 1:
                if len(tokens) == count:
                    return tokens
                tokens.append(8 * index + bit)
    return tokens


def answer(job: dict[str, Any], tokenizer: llguidance.LLTokenizer, config: dict[str, Any], texts: ModuleType) -> dict:
    try:
        grammar = texts.grammar_text(*job["source"])
        if not job["compile"]:
            return {"error": None, "stage": "compile", "grammar": grammar}
        verdict = judge(tokenizer, grammar, config["limits"], config["probe_tokens"])
    except Exception as exc:  # a malformed constraint, refused through Python: a verdict, not a crash
        return {"error": str(exc), "stage": "compile", "grammar": None}
    return {**verdict, "grammar": grammar if verdict["error"] is None and job["want_grammar"] else None}


def serve(source: BinaryIO, replies: BinaryIO, config: dict[str, Any]) -> None:
    import llguidance

    texts = _load_sibling("grammar_source")
    tokenizer = llguidance.LLTokenizer(config["tokenizer"], n_vocab=config["n_vocab"], eos_token=config["eos"])
    replies.write(encode_message({"ready": True}))
    replies.flush()
    while (job := read_message(source)) is not None:
        replies.write(encode_message(answer(job, tokenizer, config, texts)))
        replies.flush()


def _load_sibling(name: str) -> ModuleType:
    """A module of this folder by its path: the child runs isolated (`python -I`, so this folder is not on the
    import path and cannot shadow what llguidance imports), and the package is not imported."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(os.path.dirname(__file__), f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is for the parent; stdin's end ends this
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # whatever a library prints goes to stderr, never into the replies
    config = read_message(sys.stdin.buffer)
    if config is None:
        return
    if "nice" in config:  # compiling is background work: the engine's steps come first
        os.setpriority(os.PRIO_PROCESS, 0, max(config["nice"], os.getpriority(os.PRIO_PROCESS, 0)))
    # The compiling thread gets the stack the parent names: the engine compiles in its own process only what
    # compiled here, on a thread with several times this stack.
    threading.stack_size(config["stack_bytes"])
    worker = threading.Thread(target=serve, args=(sys.stdin.buffer, replies, config), name="grammar-sandbox")
    worker.start()
    worker.join()


if __name__ == "__main__":
    main()
