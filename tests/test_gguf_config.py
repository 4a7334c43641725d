"""A GGUF file's config values read from its metadata alone (engine/worker/weights/gguf_config.py) equal what
transformers' load_gguf_checkpoint builds with its full parse, for every architecture read that way, and the others
take load_gguf_checkpoint itself; the scalar settings (gguf_metadata.py) equal gguf-py's reading."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import transformers

from pagedserve.engine.worker.weights import gguf_config, gguf_metadata
from pagedserve.engine.worker.weights.checkpoint import embedded_gguf_path
from tests.gguf_writing import add_tokenizer, close_writer, new_writer

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    vocab_size=256,
    rms_norm_eps=1e-5,
)


def write_metadata_file(path: Path, arch: str, smol_dir: Path, name: str = "tiny", untied: bool = False) -> Path:
    """A file with every decoder setting, the tokenizer, a rope base and an embedding (and an untied head)."""
    writer = new_writer(path, arch, transformers.LlamaConfig(**TINY), smol_dir)
    writer.add_name(name)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(16)
    writer.add_tensor("token_embd.weight", np.zeros((TINY["vocab_size"], TINY["hidden_size"]), np.float32))
    if untied:
        writer.add_tensor("output.weight", np.zeros((TINY["vocab_size"], TINY["hidden_size"]), np.float32))
    close_writer(writer)
    return path


def assert_same_values(path: Path) -> None:
    fast, full = gguf_config.gguf_config_values(path), gguf_config._values_from_checkpoint(path)
    assert fast == full
    assert {key: type(value) for key, value in fast.items()} == {key: type(value) for key, value in full.items()}


@pytest.mark.parametrize("untied", [False, True])
@pytest.mark.parametrize("arch", sorted(gguf_config.MAPPED_ARCHITECTURES))
def test_mapped_architectures_read_the_metadata_alone_and_agree(
    arch: str, untied: bool, smol_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_metadata_file(tmp_path / f"{arch}.gguf", arch, smol_dir, untied=untied)
    full = gguf_config._values_from_checkpoint(path)
    assert full["tie_word_embeddings"] is not untied
    with monkeypatch.context() as patched:
        patched.setattr(gguf_config, "_values_from_checkpoint", lambda _: pytest.fail("took the full parse"))
        fast = gguf_config.gguf_config_values(path)
    assert fast == full
    assert {key: type(value) for key, value in fast.items()} == {key: type(value) for key, value in full.items()}
    name = gguf_config.TRANSFORMERS_NAMES.get(arch, arch)
    assert fast["model_type"] == gguf_config.TEXT_MODEL_TYPES.get(name, name)  # e.g. qwen2_moe, gemma3_text


def test_the_embedded_model_agrees() -> None:
    assert_same_values(embedded_gguf_path())


@pytest.mark.parametrize(("arch", "name"), [("llama", "mistral"), ("starcoder2", "tiny")])
def test_other_files_take_the_full_parse(
    arch: str, name: str, smol_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Llama file named Mistral becomes a Mistral config inside load_gguf_checkpoint; StarCoder2 is not read here."""
    path = write_metadata_file(tmp_path / f"{arch}.gguf", arch, smol_dir, name=name)
    calls: list[Path] = []
    full = gguf_config._values_from_checkpoint
    monkeypatch.setattr(gguf_config, "_values_from_checkpoint", lambda file: calls.append(file) or full(file))
    values = gguf_config.gguf_config_values(path)
    assert calls == [path]
    assert values["model_type"] == ("mistral" if name == "mistral" else arch)


def test_a_file_without_a_vocabulary_size_takes_its_token_count(smol_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "no-vocab-size.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(1)
    writer.add_embedding_length(64)
    writer.add_head_count(4)
    add_tokenizer(writer, smol_dir, 300)
    close_writer(writer)
    assert gguf_config.gguf_config_values(path)["vocab_size"] == 300
    assert_same_values(path)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_file_scalars_agree_with_gguf_py(arch: str, smol_dir: Path, tmp_path: Path) -> None:
    path = write_metadata_file(tmp_path / f"{arch}.gguf", arch, smol_dir)
    scalars = gguf_metadata.file_scalars(path, arch)
    assert scalars["block_count"] == TINY["num_hidden_layers"] and scalars["rope.freq_base"] == 10000.0
    assert scalars == gguf_metadata._scalars_with_gguf_py(path, arch)
    embedded = embedded_gguf_path()
    assert gguf_metadata.file_scalars(embedded, "llama") == gguf_metadata._scalars_with_gguf_py(embedded, "llama")
