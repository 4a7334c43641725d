"""Finding and reading weights: sharded safetensors, hub ids offline, GGUF conversion cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.worker.weights.checkpoint import iter_safetensors, resolve_model_dir
from pagedserve.engine.worker.weights.gguf_files import dequantized_model_dir


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path: Path, tiny_model_dir) -> None:
    source = tiny_model_dir("qwen2")
    model = transformers.AutoModelForCausalLM.from_pretrained(source)
    model.save_pretrained(tmp_path, max_shard_size="2MB")
    transformers.AutoTokenizer.from_pretrained(source).save_pretrained(tmp_path)
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    names = {name for name, _ in iter_safetensors(tmp_path)}
    assert "model.layers.1.self_attn.q_proj.bias" in names
    params = SamplingParams(max_tokens=6, temperature=0)
    sharded = LLM(model=str(tmp_path), num_kv_blocks=16, engine_process=False).generate([[5, 6, 7]], params)
    single = LLM(model=str(source), num_kv_blocks=16, engine_process=False).generate([[5, 6, 7]], params)
    assert sharded[0].outputs[0].token_ids == single[0].outputs[0].token_ids


def test_unknown_hub_id_offline_says_what_to_download(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    import huggingface_hub.constants as hub_constants

    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(FileNotFoundError, match="huggingface-cli download someone/missing-model"):
        resolve_model_dir("someone/missing-model")


def test_missing_local_path_is_a_clear_error() -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_dir("./no/such/model.gguf")


def test_gguf_conversion_is_cached(smol_dir: Path) -> None:
    source = Path((smol_dir / "pagedserve_source.json").read_text().split('"')[3])
    assert dequantized_model_dir(source) == smol_dir  # second call: no conversion
    assert (smol_dir / "model.safetensors").exists() and (smol_dir / "tokenizer.json").exists()
    # A standard checkpoint: other tools (transformers' own server) need to know the model class.
    assert json.loads((smol_dir / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def test_directory_without_config_is_rejected(tmp_path: Path) -> None:
    torch.save({}, tmp_path / "weights.bin")
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        resolve_model_dir(str(tmp_path))
