"""Weights from disk: safetensors checkpoints, GGUF files, per-rank shards of block formats, quantizing on load."""
