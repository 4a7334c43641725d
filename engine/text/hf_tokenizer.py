"""The model's tokenizer as transformers loads it: the engine core's (it imports torch through transformers).
The API process reads the same tokenizer through a TokenizerSpec (text_tokenizer.py) instead."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if not getattr(tokenizer, "is_fast", False) or getattr(tokenizer, "backend_tokenizer", None) is None:
        raise ValueError(f"{path}: pagedserve needs a fast (tokenizers) tokenizer")
    return tokenizer


def eos_token_ids(model_dir: Path, hf_config: Any, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """Every token that ends generation: from the config, generation_config.json and the tokenizer."""
    ids: set[int] = set()
    candidates: list[Any] = [getattr(hf_config, "eos_token_id", None), tokenizer.eos_token_id]
    generation_config = model_dir / "generation_config.json"
    if generation_config.exists():
        candidates.append(json.loads(generation_config.read_text()).get("eos_token_id"))
    for value in candidates:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))
    return frozenset(ids)
