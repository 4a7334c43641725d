"""Random-weight GGUF files at the shapes people serve (Llama 3.2 1B/3B, Llama 3.1 8B), for speed and memory.

    python -m benchmarks.gguf_models --shape 1b --mix q4_0 --out /tmp/llama-1b-q4_0.gguf

The weights are random blocks (sane fp16 scales, random quants): meaningless text, but the bytes, the shapes
and the arithmetic of a real file, so load time, memory and tokens/s are those of a real model. The tokenizer
and chat template are the embedded SmolLM2's (49,152 tokens), so every server reads the same file as it would a
downloaded one. Mixes, as llama.cpp's quantizer lays them out:
    q4_0, q8_0   every projection in that format, the head (output, or a tied token_embd) in Q6_K / Q8_0
    q4_k_m       Q4_K, with attn_v and ffn_down in Q6_K on the first and last eighth of the layers and every
                 third layer between (llama.cpp's use_more_bits), the head in Q6_K
The file is written tensor by tensor: an 8B file (~4.5 GB) never sits in memory whole.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from pagedserve.engine.worker.weights.checkpoint import embedded_gguf_path


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    tied: bool
    rope_theta: float = 500000.0
    vocab: int = 49152  # SmolLM2's tokenizer


SHAPES = {
    "1b": Shape(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192, tied=True),
    "3b": Shape(hidden=3072, layers=28, heads=24, kv_heads=8, ffn=8192, tied=True),
    "8b": Shape(hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, tied=False),
}
Q = gguf.GGMLQuantizationType
MIXES = {"q4_0": (Q.Q4_0, Q.Q6_K), "q8_0": (Q.Q8_0, Q.Q8_0), "q4_k_m": (Q.Q4_K, Q.Q6_K)}
FILE_TYPES = {"q4_0": 2, "q8_0": 7, "q4_k_m": 15}  # llama.cpp's LLAMA_FTYPE_MOSTLY_*
TOKENIZER_KEYS = (
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.unknown_token_id",
    "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.add_bos_token",
    "tokenizer.chat_template",
)


def tensor_plan(shape: Shape, mix: str) -> Iterator[tuple[str, tuple[int, ...], Q]]:
    """(name, dims outermost first, type) of every tensor, in file order."""
    base, head = MIXES[mix]
    head_dim = shape.hidden // shape.heads
    yield "token_embd.weight", (shape.vocab, shape.hidden), head if shape.tied else base
    for layer in range(shape.layers):
        more_bits = mix == "q4_k_m" and _uses_more_bits(layer, shape.layers)
        wide = Q.Q6_K if more_bits else base
        yield f"blk.{layer}.attn_norm.weight", (shape.hidden,), Q.F32
        yield f"blk.{layer}.attn_q.weight", (shape.heads * head_dim, shape.hidden), base
        yield f"blk.{layer}.attn_k.weight", (shape.kv_heads * head_dim, shape.hidden), base
        yield f"blk.{layer}.attn_v.weight", (shape.kv_heads * head_dim, shape.hidden), wide
        yield f"blk.{layer}.attn_output.weight", (shape.hidden, shape.heads * head_dim), base
        yield f"blk.{layer}.ffn_norm.weight", (shape.hidden,), Q.F32
        yield f"blk.{layer}.ffn_gate.weight", (shape.ffn, shape.hidden), base
        yield f"blk.{layer}.ffn_up.weight", (shape.ffn, shape.hidden), base
        yield f"blk.{layer}.ffn_down.weight", (shape.hidden, shape.ffn), wide
    yield "output_norm.weight", (shape.hidden,), Q.F32
    if not shape.tied:
        yield "output.weight", (shape.vocab, shape.hidden), head


def _uses_more_bits(layer: int, layers: int) -> bool:
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def random_tensor(dims: tuple[int, ...], qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """Random bytes of a tensor of `qtype` (rows of blocks), with every fp16 scale set to a sane value; norms
    are ones."""
    if qtype == Q.F32:
        return np.ones(dims, np.float32)
    rows, columns = dims
    block_weights, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows, columns // block_weights, block_bytes), dtype=np.uint8)
    for start, value in SCALES[qtype]:
        blocks[..., start : start + 2] = np.frombuffer(np.float16(value).tobytes(), np.uint8)
    if qtype == Q.Q6_K:  # int8 sub-block scales: keep them small
        blocks[..., 192:208] = rng.integers(1, 16, (rows, columns // block_weights, 16), dtype=np.uint8)
    return blocks.reshape(rows, -1)


# Byte offset of each fp16 scale in a block, and its value: weights of mean ~0 and standard deviation ~0.02, as a
# trained model's. Q4_K's weights are d * scale * q - dmin * min with q in 0..15 and 6-bit scale and min: dmin at
# 7.5 d centres them (a positive mean makes every gate positive and the MLP's outputs blow up or underflow).
SCALES = {
    Q.Q4_0: [(0, 0.004)],
    Q.Q8_0: [(0, 0.0003)],
    Q.Q4_K: [(0, 0.00008), (2, 0.0006)],  # d, dmin
    Q.Q6_K: [(208, 0.00012)],  # d, after ql, qh and the scales
}


def add_metadata(writer: gguf.GGUFWriter, shape: Shape, mix: str, name: str) -> None:
    writer.add_name(name)
    writer.add_block_count(shape.layers)
    writer.add_context_length(8192)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_dimension_count(shape.hidden // shape.heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(shape.vocab)
    writer.add_file_type(FILE_TYPES[mix])
    source = gguf.GGUFReader(embedded_gguf_path())
    for key in TOKENIZER_KEYS:
        field = source.fields.get(key)
        if field is None:
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), value_type, sub_type)


def write_model(path: Path, shape: Shape, mix: str, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, "llama")
    add_metadata(writer, shape, mix, path.stem)
    plan = list(tensor_plan(shape, mix))
    for name, dims, qtype in plan:
        if qtype == Q.F32:
            writer.add_tensor_info(name, dims, np.dtype(np.float32), 4 * dims[0])
        else:
            block_weights, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
            byte_dims = (dims[0], dims[1] // block_weights * block_bytes)
            writer.add_tensor_info(name, byte_dims, np.dtype(np.uint8), byte_dims[0] * byte_dims[1], raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, dims, qtype in plan:
        writer.write_tensor_data(random_tensor(dims, qtype, rng))
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=SHAPES, default="1b")
    parser.add_argument("--mix", choices=MIXES, default="q4_0")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    write_model(args.out, SHAPES[args.shape], args.mix, args.seed)
    print(f"{args.out}: {args.out.stat().st_size / 2**20:.0f} MiB ({args.shape}, {args.mix})")


if __name__ == "__main__":
    main()
