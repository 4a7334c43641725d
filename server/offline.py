"""`pagedserve generate` and `pagedserve chat`: no server; the engine steps here and text streams out."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pagedserve import engine  # its names load when a command runs, not while the CLI parses
from pagedserve.server.engine_args import add_engine_args, engine_config

EXIT_WORDS = ("/exit", "/quit")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def add_commands(commands: argparse._SubParsersAction) -> None:
    generate = commands.add_parser("generate", help="complete one prompt, streaming to the terminal")
    generate.add_argument("--prompt", required=True)
    generate.add_argument(
        "--chat-template", dest="as_chat", action="store_true", help="wrap the prompt as one user message"
    )
    _add_sampling_args(generate, max_tokens=128, engine_exclude=frozenset({"seed", "chat_template"}))
    generate.set_defaults(run=generate_command)

    chat = commands.add_parser("chat", help="talk to a model in the terminal (keeps the conversation)")
    chat.add_argument("--system", help="a system prompt")
    _add_sampling_args(chat, max_tokens=512)
    chat.set_defaults(run=chat_command)


def _add_sampling_args(
    parser: argparse.ArgumentParser, max_tokens: int, engine_exclude: frozenset[str] = frozenset({"seed"})
) -> None:
    sampling = parser.add_argument_group("sampling")
    sampling.add_argument("--max-tokens", type=int, default=max_tokens)
    sampling.add_argument("--temperature", type=float, default=0.7)
    sampling.add_argument("--top-p", type=float, default=1.0)
    sampling.add_argument("--top-k", type=int, default=0)
    sampling.add_argument("--min-p", type=float, default=0.0)
    sampling.add_argument("--repetition-penalty", type=float, default=1.0)
    sampling.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    sampling.add_argument("--seed", type=int, help="sampling seed, for reproducible output (also the engine's)")
    parser.add_argument("--log-level", choices=LOG_LEVELS, default="warning")
    add_engine_args(parser, exclude=engine_exclude)


def _sampling_params(args: argparse.Namespace) -> engine.SamplingParams:
    return engine.SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        stop=args.stop,
        seed=args.seed,
    )


def generate_command(args: argparse.Namespace) -> int:
    params = _sampling_params(args)
    with engine.LLM.from_config(engine_config(args)) as llm:
        prompt = args.prompt
        if args.as_chat:
            prompt = llm.encode_chat([{"role": "user", "content": prompt}])
        stream_reply(llm, prompt, params)
    return 0


def chat_command(args: argparse.Namespace) -> int:
    params = _sampling_params(args)
    with engine.LLM.from_config(engine_config(args)) as llm:
        return _chat(llm, args.system, params)


def _chat(llm: engine.LLM, system: str | None, params: engine.SamplingParams) -> int:
    history = [{"role": "system", "content": system}] if system else []
    print(f"chatting with {Path(llm.info.model_dir).name}; {' or '.join(EXIT_WORDS)} ends", file=sys.stderr)
    while True:
        try:
            line = input("\n>>> ").strip()
        except (EOFError, KeyboardInterrupt):
            return 0
        if line in EXIT_WORDS:
            return 0
        if line:
            history.append({"role": "user", "content": line})
            reply = stream_reply(llm, llm.encode_chat(history), params)
            history.append({"role": "assistant", "content": reply})


def stream_reply(llm: engine.LLM, prompt: str | list[int], params: engine.SamplingParams) -> str:
    """Generates and prints as tokens come; Ctrl-C stops this reply only. Returns the text printed."""
    pieces: list[str] = []
    deltas = llm.stream(prompt, params)
    try:
        for delta in deltas:
            print(delta.new_text, end="", flush=True)
            pieces.append(delta.new_text)
            if delta.error:
                print(f"\n[error: {delta.error}]", file=sys.stderr)
    except KeyboardInterrupt:
        deltas.close()  # aborts the request
        print("\n[interrupted]", file=sys.stderr)
    print()
    return "".join(pieces)
