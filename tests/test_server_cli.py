"""The `pagedserve` command line: engine flags from the dataclass, YAML under flags, the offline commands."""

from __future__ import annotations

import argparse
from pathlib import Path
from types import SimpleNamespace

import pytest

from pagedserve.engine import LLM, EngineConfig
from pagedserve.engine.worker.model_loader import LoadedModel
from pagedserve.server import cli, offline
from pagedserve.server.engine_args import engine_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def parse(*argv: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(argv)


def test_every_engine_config_field_has_a_flag(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse(
        "serve", "--max-num-seqs", "7", "--kv-cache-memory", "1000000", "--no-enable-prefix-caching",
        "--dtype", "float32", "--attention-backend", "cpu", "--max-model-len", "512",
    )  # fmt: skip
    config = engine_config(args)
    assert (config.max_num_seqs, config.kv_cache_memory, config.max_model_len) == (7, 1_000_000, 512)
    assert config.enable_prefix_caching is False and config.attention_backend == "cpu"
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    help_text = capsys.readouterr().out
    for name in EngineConfig.field_names():
        if name != "served_model_name":  # serve takes several names, see below
            assert "--" + name.replace("_", "-") in help_text


def test_flags_win_over_the_yaml_file() -> None:
    args = parse("serve", "--config", str(CONFIGS / "default.yaml"), "--max-num-seqs", "3")
    config = engine_config(args)
    assert config.max_num_seqs == 3 and config.kv_cache_memory == 1 << 30 and config.device == "cpu"


def test_every_shipped_config_is_valid() -> None:
    for path in CONFIGS.glob("*.yaml"):
        assert isinstance(EngineConfig.from_yaml(path), EngineConfig)


@pytest.mark.parametrize(
    ("field", "value", "rule"),
    [
        ("max_queue_time", 0.0, "> 0 seconds"),
        ("request_timeout", -1.0, "> 0 seconds"),
        ("block_size", 12, "a power of two"),
    ],
)
def test_invalid_engine_config_names_the_field(field: str, value: object, rule: str) -> None:
    with pytest.raises(ValueError, match=f"{field} must be {rule}"):
        EngineConfig(**{field: value})


def test_activation_dtype_flag() -> None:
    assert engine_config(parse("serve", "--activation-dtype", "int8")).activation_dtype == "int8"
    assert engine_config(parse("serve")).activation_dtype == "auto"
    with pytest.raises(SystemExit):
        parse("serve", "--activation-dtype", "int4")


def test_serve_options() -> None:
    args = parse("serve", "my/model", "--served-model-name", "a", "b", "--api-key", "k", "--port", "9000")
    assert engine_config(args, model=args.model_path).model == "my/model"
    assert (args.served_model_name, args.api_key, args.port, args.host) == (["a", "b"], "k", 9000, "127.0.0.1")
    with pytest.raises(SystemExit):
        parse("serve", "--dtype", "float8")


@pytest.fixture
def offline_engine(monkeypatch: pytest.MonkeyPatch, smol_loaded: LoadedModel) -> None:
    """The offline commands build their engine on the already-loaded model."""
    on_loaded = SimpleNamespace(from_config=lambda config: LLM.from_config(config, smol_loaded))
    monkeypatch.setattr(offline.engine, "LLM", on_loaded)


@pytest.mark.usefixtures("offline_engine")
def test_generate_streams_to_the_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", "--prompt", "The sky is", "--max-tokens", "5", "--temperature", "0", "--num-kv-blocks", "8"]
    assert cli.main(argv) == 0
    assert capsys.readouterr().out.strip()


@pytest.mark.usefixtures("offline_engine")
def test_chat_keeps_the_conversation(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], smol_loaded: LoadedModel
) -> None:
    lines = iter(["My name is Ada.", "What is my name?", "/exit"])
    monkeypatch.setattr("builtins.input", lambda _prompt: next(lines))
    prompts: list[list[int]] = []
    real_stream_reply = offline.stream_reply

    def recording(llm: LLM, prompt: list[int], params: object) -> str:
        prompts.append(prompt)
        return real_stream_reply(llm, prompt, params)  # type: ignore[arg-type]

    monkeypatch.setattr(offline, "stream_reply", recording)
    assert cli.main(["chat", "--max-tokens", "2", "--temperature", "0", "--num-kv-blocks", "16"]) == 0
    assert len(prompts) == 2
    assert "My name is Ada." in smol_loaded.tokenizer.decode(prompts[1])  # the second turn carries the first
    assert capsys.readouterr().out.strip()
