"""Native CPU kernels, compiled on first use with the system C compiler for the host CPU.

Decode attention on a CPU is bound by memory traffic, and torch has no paged-attention op: the torch path
must gather a sequence's blocks into a contiguous copy before SDPA. `csrc/paged_decode_attention.c` reads
the blocks in place instead. (The other kernels in csrc/ are bound in kernels/cpu_layer_ops.py,
kernels/cpu_linear.py and kernels/quantized.py; all of them run their loops on the thread pool of
csrc/parallel.c.) The sources are built into one library the way Triton builds its launchers: at first use,
with `cc`, into a cache keyed by the sources, the flags, the compiler and the CPU, so later starts load it in
milliseconds. Without a compiler (or with PAGEDSERVE_NATIVE_KERNELS=0) the torch path runs, after one warning.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent / "csrc"
# -march=native: the library is built on, and only ever loaded by, the machine that runs it (the cache key
# includes the CPU's flags). OpenMP only for its `simd` loop hints: threads come from csrc/parallel.c. FMA
# contraction, no errno and no FP traps let the compiler use fused multiply-adds, vectorised sqrt and
# compare-and-select; results differ from torch's by rounding only.
CFLAGS = (
    "-O3",
    "-march=native",
    "-ffp-contract=fast",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fopenmp-simd",
    "-pthread",
    "-fPIC",
    "-shared",
    "-std=c11",
)
# Flags appended to CFLAGS (and to the cache key), e.g. "-mno-avx512f" or "-mno-avx": a build for a narrower
# instruction set than the host's, so that tests exercise the AVX2 and portable paths on any x86 machine.
EXTRA_CFLAGS_VARIABLE = "PAGEDSERVE_NATIVE_CFLAGS"
DecodeAttention = Callable[..., None]
WriteKV = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], bool]
# The kernel reads keys, values and queries in whole vectors of this many floats: head_dim must be a multiple.
VECTOR_LANES = 8


def native_kernels_enabled() -> bool:
    return os.environ.get("PAGEDSERVE_NATIVE_KERNELS", "1") not in ("0", "false", "no", "off")


@functools.cache
def native_library() -> ctypes.CDLL | None:
    """The compiled kernels (built now unless cached), or None where they cannot be built or are switched off."""
    if not native_kernels_enabled():
        return None
    try:
        path = _build()
        library = ctypes.CDLL(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        # Loud: the torch path runs 2-3x slower, which a user would otherwise only see as a slow server.
        logger.error("native CPU kernels unavailable, using the slower torch path: %s", exc)
        return None
    logger.info("native CPU kernels ready (%s)", path)
    return library


def native_function(symbol: str, argtypes: list[Any]) -> Callable[..., int] | None:
    """The library's C function `symbol` (returning int) with its argument types set, or None where the
    library cannot be built."""
    library = native_library()
    if library is None:
        return None
    function = getattr(library, symbol)
    function.argtypes = argtypes
    function.restype = ctypes.c_int
    return function


@functools.cache
def decode_attention_kernel() -> DecodeAttention | None:
    """`paged_decode_attention` bound to the compiled library, or None where it cannot be built."""
    pointer, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    argtypes = [pointer] * 5 + [i64] + [pointer] * 3 + [i64] + [i32] * 4 + [ctypes.c_float, i32]
    function = native_function("paged_decode_attention_f32", argtypes)
    return None if function is None else functools.partial(_paged_decode_attention, function)


@functools.cache
def write_kv_kernel() -> WriteKV | None:
    """`write_kv` bound to the compiled library, or None where it cannot be built."""
    function = native_function("write_kv_f32", [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 5)
    return None if function is None else functools.partial(_write_kv, function)


def _write_kv(
    function: Callable[..., int],
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> bool:
    """Writes key/value [T, KVH, D] into the caches' rows `slots` [T] (int64, < 0 skipped); False, having
    written nothing, where the kernel does not take these tensors (the caller then uses torch)."""
    tensors = (key, value, k_cache, v_cache)
    if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors) or slots.dtype != torch.int64:
        return False
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and slots.is_contiguous()):
        return False
    tokens, heads, head_dim = key.shape
    strides = key.stride()
    if value.shape != key.shape or value.stride() != strides or k_cache.shape[-2:] != (heads, head_dim):
        return False
    token_stride, head_stride, feature_stride = strides
    if head_stride != head_dim * feature_stride or 1 not in (token_stride, feature_stride) or slots.numel() != tokens:
        return False  # each token's heads are not one run of features in either layout
    num_slots = k_cache.numel() // (heads * head_dim)
    status = function(
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        key.data_ptr(),
        value.data_ptr(),
        slots.data_ptr(),
        tokens,
        heads * head_dim,
        token_stride,
        feature_stride,
        num_slots,
    )
    if status != 0:
        raise IndexError(f"write_kv: a slot is past the cache's {num_slots} slots")
    return True


def _paged_decode_attention(
    function: Callable[..., int],
    out: torch.Tensor,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    seq_ids: torch.Tensor,
    query_rows: torch.Tensor,
    scale: float,
) -> None:
    """out[query_rows[i]] = attention of query[query_rows[i]] over the first context_lens[i] cached tokens of
    sequence seq_ids[i]: all of them for a decode token, those up to its own for a prefill token.

    query/out [rows, H, D] and the caches float32 and contiguous; block_tables [seqs, max_blocks] and
    context_lens int32; seq_ids and query_rows int64; context_lens, seq_ids and query_rows of one length.
    """
    _check(out, query, k_cache, v_cache, block_tables, context_lens, seq_ids, query_rows)
    _, num_heads, head_dim = query.shape
    status = function(
        out.data_ptr(),
        query.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        block_tables.stride(0),
        context_lens.data_ptr(),
        seq_ids.data_ptr(),
        query_rows.data_ptr(),
        seq_ids.numel(),
        num_heads,
        k_cache.shape[2],
        head_dim,
        k_cache.shape[1],
        scale,
        torch.get_num_threads(),
    )
    if status != 0:
        raise MemoryError("paged_decode_attention: scratch allocation failed")


def _check(
    out: torch.Tensor,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    seq_ids: torch.Tensor,
    query_rows: torch.Tensor,
) -> None:
    """The kernel trusts its pointers: refuse anything it would misread."""
    expected = {
        "out": (out, torch.float32),
        "query": (query, torch.float32),
        "k_cache": (k_cache, torch.float32),
        "v_cache": (v_cache, torch.float32),
        "context_lens": (context_lens, torch.int32),
        "seq_ids": (seq_ids, torch.int64),
        "query_rows": (query_rows, torch.int64),
    }
    for name, (tensor, dtype) in expected.items():
        if tensor.dtype != dtype or tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous CPU {dtype} tensor, got {tensor.dtype} {tensor.device}")
    if not context_lens.numel() == seq_ids.numel() == query_rows.numel():
        raise ValueError("context_lens, seq_ids and query_rows must have one entry per query row")
    if block_tables.dtype != torch.int32 or block_tables.stride(-1) != 1:
        raise ValueError("block_tables: expected int32 with contiguous rows")
    if out.shape != query.shape or k_cache.shape != v_cache.shape or query.shape[2] != k_cache.shape[3]:
        raise ValueError(f"shapes disagree: out {out.shape}, query {query.shape}, caches {k_cache.shape}")
    if query.shape[2] % VECTOR_LANES != 0:
        raise ValueError(f"head_dim {query.shape[2]} is not a multiple of {VECTOR_LANES}")
    if query.shape[1] % k_cache.shape[2] != 0:
        raise ValueError(f"{query.shape[1]} query heads are not a multiple of {k_cache.shape[2]} KV heads")


def _build() -> Path:
    """The shared library of every source in SOURCE_DIR, compiled unless this exact build is cached."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler found (install gcc, or set CC)")
    sources = sorted(SOURCE_DIR.glob("*.c"))
    flags = (*CFLAGS, *os.environ.get(EXTRA_CFLAGS_VARIABLE, "").split())
    code = b"\0".join(path.name.encode() + b"\0" + path.read_bytes() for path in sorted(SOURCE_DIR.glob("*.[ch]")))
    key = hashlib.sha256(b"\0".join([code, " ".join(flags).encode(), _compiler_version(compiler), _cpu_flags()]))
    target = _cache_dir() / f"pagedserve_kernels-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        command = [compiler, *flags, *map(str, sources), "-o", str(built), "-lm"]
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed on {SOURCE_DIR}: {result.stderr.strip()[-2000:]}")
        os.replace(built, target)  # atomic: a concurrent build of the same key just wins or loses the race
    logger.info("compiled the CPU kernels into %s", target)
    return target


def _compiler_version(compiler: str) -> bytes:
    return subprocess.run([compiler, "--version"], capture_output=True, check=True, timeout=30).stdout


def _cpu_flags() -> bytes:
    """The host CPU's feature flags (Linux), so a cache shared between machines never loads a foreign build."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.encode()
    except OSError:
        pass
    return os.uname().machine.encode()


def _cache_dir() -> Path:
    configured = os.environ.get("PAGEDSERVE_KERNEL_CACHE_DIR")
    if configured:
        return Path(configured)
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    directory = base / "pagedserve" / "kernels"
    with contextlib.suppress(OSError):  # unwritable: checked next
        directory.mkdir(parents=True, exist_ok=True)
    if os.access(directory, os.W_OK):
        return directory
    return Path(tempfile.gettempdir()) / f"pagedserve-kernels-{os.getuid()}"  # a read-only home
