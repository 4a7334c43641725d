"""EngineConfig: every knob of the engine in one dataclass, filled from YAML and overridden by flags."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

DTYPES = ("auto", "float32", "float16", "bfloat16")
SPECULATIVE_METHODS = ("ngram", "draft")
QUANTIZATIONS = ("auto", "none", "gguf", "q8_0", "q4_0", "q4_1", "q4_k", "q5_k", "q6_k")
ACTIVATION_DTYPES = ("auto", "float32", "int8", "int16")
MODEL_IMPLS = ("auto", "native", "transformers")
EMBEDDED_NAME = "SmolLM2-135M-Instruct"  # the model served when none is named


@dataclass
class EngineConfig:
    model: str | None = None  # hub id, local directory or .gguf file; None = the embedded SmolLM2
    tokenizer: str | None = None  # defaults to the model's own
    served_model_name: str | None = None
    revision: str | None = None
    dtype: str = "auto"  # float32 on CPU, bfloat16 on CUDA
    device: str = "auto"  # cuda when available, else cpu
    seed: int = 0
    load_format: str = "auto"  # auto = read the weights; dummy = keep random weights (benchmarks)
    # auto: a GGUF's Q8_0/Q4_0/Q4_1/Q4_K/Q5_K/Q6_K projections stay in blocks on the CPU; gguf: on CUDA too;
    # none: float; one of those formats (q8_0 ... q6_k): every projection quantized to it at load. Split over
    # ranks, each rank keeps its shards in blocks (engine/worker/weights/: on_load_quantization.py, gguf.py)
    quantization: str = "auto"
    # CPU decode steps' activations for block-format projections: int8 = 8-bit, as llama.cpp (fastest; moves
    # ~2% of greedy tokens), int16 (auto) = 16-bit (nearly as fast, ~float32's tokens); float32 = the dequantized
    # model's float products, transformers' tokens
    activation_dtype: str = "auto"
    # auto: our own model where the architecture has one (Llama, Mistral, Qwen2, Qwen3), transformers' modules
    # with paged attention for any other decoder; native: ours or an error; transformers: always the fallback
    model_impl: str = "auto"

    # KV cache
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes for K and V of all layers; None = derived (see below)
    num_kv_blocks: int | None = None  # overrides kv_cache_memory
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True

    # Scheduler
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings, capped at 8192
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_queue_len: int = 1024
    max_queue_time: float | None = None  # seconds a request may wait to be scheduled; then it fails (None: no limit)
    request_timeout: float | None = None  # seconds a request may take in all; then it is aborted (None: no limit)
    max_logprobs: int = 20
    max_n: int = 16
    # Chat message text is tokenized as plain text: "<|im_start|>" typed by a user never becomes the role marker.
    trust_message_special_tokens: bool = False  # True: special tokens typed in messages count (role markers too)
    chat_template: str | None = None  # a Jinja chat template, or a file holding one, instead of the tokenizer's

    # Structured output
    jump_forward: bool = True  # tokens a constraint forces on greedy requests are appended without a forward each

    # Speculative decoding
    speculative_method: str | None = None  # ngram: what followed the last n tokens; draft: --draft-model's (None: off)
    num_speculative_tokens: int = 4  # k: tokens proposed, and verified in one forward, per sequence and step
    ngram_min: int = 2  # the shortest n-gram matched
    ngram_max: int = 4  # the longest n-gram matched (tried first)
    draft_model: str | None = None  # the draft method's model (a folder or .gguf sharing the target's vocabulary)
    speculative_default: bool = True  # whether requests that leave `speculative` unset speculate
    # None: 10 where block-format weights run on the CPU (a row more costs half a step), max_num_batched_tokens else
    speculative_token_budget: int | None = None  # query tokens of a speculating step: running x (k + 1), k cut to fit

    # Execution
    attention_backend: str = "auto"  # auto | triton | cpu
    enforce_eager: bool = False  # disables CUDA graphs
    num_threads: int | None = None  # torch intra-op threads on CPU
    engine_process: bool = True  # the engine core in a process of its own (False: a thread of the caller's)
    engine_niceness: int = 5  # added to the core process's nice value: HTTP, probes and streams run first
    engine_heartbeat_timeout: float = 5.0  # seconds without a word from the core before /health says 503 (wedged)
    tensor_parallel_size: int = 1  # ranks the model is split over, one process each (gloo on CPU, NCCL on CUDA)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        checks = [
            (
                self.block_size > 0 and self.block_size & (self.block_size - 1) == 0,
                "block_size",
                "a power of two",
            ),
            (self.max_num_seqs >= 1, "max_num_seqs", ">= 1"),
            (self.max_num_batched_tokens >= 1, "max_num_batched_tokens", ">= 1"),
            (self.max_queue_len >= 0, "max_queue_len", ">= 0"),
            (0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization", "in (0, 1]"),
            (self.dtype in DTYPES, "dtype", f"one of {DTYPES}"),
            (self.load_format in ("auto", "dummy"), "load_format", "'auto' or 'dummy'"),
            (self.quantization in QUANTIZATIONS, "quantization", f"one of {QUANTIZATIONS}"),
            (self.activation_dtype in ACTIVATION_DTYPES, "activation_dtype", f"one of {ACTIVATION_DTYPES}"),
            (self.model_impl in MODEL_IMPLS, "model_impl", f"one of {MODEL_IMPLS}"),
            (self.num_kv_blocks is None or self.num_kv_blocks >= 1, "num_kv_blocks", ">= 1"),
            (self.kv_cache_memory is None or self.kv_cache_memory > 0, "kv_cache_memory", "> 0"),
            (self.max_model_len is None or self.max_model_len >= 1, "max_model_len", ">= 1"),
            (self.max_queue_time is None or self.max_queue_time > 0, "max_queue_time", "> 0 seconds"),
            (self.request_timeout is None or self.request_timeout > 0, "request_timeout", "> 0 seconds"),
            (0 <= self.engine_niceness <= 19, "engine_niceness", "in [0, 19]"),
            (self.engine_heartbeat_timeout > 0, "engine_heartbeat_timeout", "> 0 seconds"),
            (self.tensor_parallel_size >= 1, "tensor_parallel_size", ">= 1"),
            (
                self.speculative_method in (None, *SPECULATIVE_METHODS),
                "speculative_method",
                f"one of {SPECULATIVE_METHODS} or None",
            ),
            (1 <= self.num_speculative_tokens <= 32, "num_speculative_tokens", "in [1, 32]"),
            (
                self.speculative_token_budget is None or self.speculative_token_budget >= 1,
                "speculative_token_budget",
                ">= 1 or None",
            ),
            (self.ngram_min >= 1, "ngram_min", ">= 1"),
            (self.ngram_max >= self.ngram_min, "ngram_max", ">= ngram_min"),
            (
                (self.speculative_method == "draft") == (self.draft_model is not None),
                "draft_model",
                "given exactly when speculative_method is 'draft'",
            ),
        ]
        for ok, name, rule in checks:
            if not ok:
                raise ValueError(f"{name} must be {rule}, got {getattr(self, name)!r}")
        self.chat_template_text()

    def chat_template_text(self) -> str | None:
        """The chat template `chat_template` gives: the file's text where it names a file, else the value itself
        if it reads as Jinja (as vLLM's --chat-template); a value that is neither is refused."""
        if self.chat_template is None:
            return None
        path = Path(self.chat_template).expanduser()
        if len(self.chat_template) < 4096 and path.is_file():
            return path.read_text()
        if "{{" in self.chat_template or "{%" in self.chat_template:
            return self.chat_template
        raise ValueError(f"chat_template must be a file or a Jinja template, got {self.chat_template!r}")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> EngineConfig:
        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping of EngineConfig fields")
        unknown = set(data) - set(cls.field_names())
        if unknown:
            raise ValueError(f"{path}: unknown EngineConfig fields {sorted(unknown)}")
        data.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**data)

    def replace(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, **changes)
