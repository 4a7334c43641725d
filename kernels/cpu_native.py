"""Native CPU kernels: a library built ahead of time where one ships, else compiled on first use with the system
C compiler for the host CPU.

Decode attention on a CPU is bound by memory traffic, and torch has no paged-attention op: the torch path
must gather a sequence's blocks into a contiguous copy before SDPA. `csrc/paged_decode_attention.c` reads
the blocks in place instead. (The other kernels in csrc/ are bound in kernels/cpu_layer_ops.py,
kernels/cpu_linear.py and kernels/quantized.py; all of them run their loops on the thread pool of
csrc/parallel.c.) Where the library comes from, first found first:

1. ahead of time (kernels/native_build.py): the best CPU level's library in $PAGEDSERVE_KERNEL_PREBUILT_DIR
   or in this package's `prebuilt/` folder, if built from these very sources. The container image ships
   them read-only and carries no compiler;
2. at first use, the way Triton builds its launchers: with `cc` and -march=native, into a cache keyed by the
   sources, the flags, the compiler and the CPU, so later starts load it in milliseconds.

Without either (no compiler, or PAGEDSERVE_NATIVE_KERNELS=0) the torch path runs, after one error line.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar, cast

import torch

from pagedserve.kernels.native_build import (
    COMMON_FLAGS,
    LIBRARY_STEM,
    compile_library,
    cpu_flags,
    find_compiler,
    find_prebuilt,
    source_code,
)

logger = logging.getLogger(__name__)
_BOUND_KERNELS: list[Any] = []
LoaderT = TypeVar("LoaderT", bound=Callable[..., Any])

# -march=native: a library compiled here is only ever loaded by the machine that built it (the cache key
# includes the CPU's flags).
CFLAGS = (*COMMON_FLAGS, "-march=native")
PREBUILT_DIR_ENV = "PAGEDSERVE_KERNEL_PREBUILT_DIR"
# Flags appended to CFLAGS (and to the cache key), e.g. "-mno-avx512f" or "-mno-avx": a build for a narrower
# instruction set than the host's, so that tests exercise the AVX2 and portable paths on any x86 machine. A
# library built ahead of time is not used while they are set.
EXTRA_CFLAGS_VARIABLE = "PAGEDSERVE_NATIVE_CFLAGS"
DecodeAttention = Callable[..., None]
WriteKV = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], bool]
# The kernel reads keys, values and queries in whole vectors of this many floats: head_dim must be a multiple.
VECTOR_LANES = 8


def bound_kernel(function: LoaderT) -> LoaderT:
    """Memoises a function that loads the library or binds one of its kernels, and registers it so that
    `forget_bound_kernels` can drop them all (after a change of build flags, cache folder or environment)."""
    cached = functools.cache(function)
    _BOUND_KERNELS.append(cached)
    return cast(LoaderT, cached)


def forget_bound_kernels() -> None:
    """The next use of any kernel loads (or builds) the library again."""
    for cached in _BOUND_KERNELS:
        cached.cache_clear()


def native_kernels_enabled() -> bool:
    return os.environ.get("PAGEDSERVE_NATIVE_KERNELS", "1") not in ("0", "false", "no", "off")


@bound_kernel
def native_library() -> ctypes.CDLL | None:
    """The compiled kernels (built now unless cached), or None where they cannot be built or are switched off."""
    if not native_kernels_enabled():
        return None
    try:
        library, path = _load()
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


@bound_kernel
def decode_attention_kernel() -> DecodeAttention | None:
    """`paged_decode_attention` bound to the compiled library, or None where it cannot be built."""
    pointer, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    argtypes = [pointer] * 5 + [i64] + [pointer] * 3 + [i64] + [i32] * 4 + [ctypes.c_float, i32, ctypes.c_float, i32]
    function = native_function("paged_decode_attention_f32", argtypes)
    return None if function is None else functools.partial(_paged_decode_attention, function)


@bound_kernel
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
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> None:
    """out[query_rows[i]] = attention of query[query_rows[i]] over the first context_lens[i] cached tokens of
    sequence seq_ids[i]: all of them for a decode token, those up to its own for a prefill token; only the last
    `sliding_window` of those where it is set, with scores soft-capped at `soft_cap` where it is set.

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
        sliding_window or 0,
        soft_cap or 0.0,
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


def _extra_flags() -> list[str]:
    return os.environ.get(EXTRA_CFLAGS_VARIABLE, "").split()


def prebuilt_dirs() -> list[Path]:
    """Where libraries built ahead of time are looked for, in order (none while extra flags ask for a build of
    their own)."""
    if _extra_flags():
        return []
    configured = os.environ.get(PREBUILT_DIR_ENV)
    return [*([Path(configured)] if configured else []), Path(__file__).parent / "prebuilt"]


def _load() -> tuple[ctypes.CDLL, Path]:
    """The library built ahead of time for this CPU where one is found and loads, else one compiled here."""
    for directory in prebuilt_dirs():
        prebuilt = find_prebuilt(directory)
        if prebuilt is None:
            continue
        try:
            return ctypes.CDLL(str(prebuilt)), prebuilt
        except OSError as exc:
            logger.warning("the CPU kernels built ahead of time in %s do not load (%s): compiling them", prebuilt, exc)
        break
    path = _build()
    return ctypes.CDLL(str(path)), path


def _build() -> Path:
    """The shared library of every source in SOURCE_DIR, compiled unless this exact build is cached."""
    compiler = find_compiler()
    flags = (*CFLAGS, *_extra_flags())
    host = " ".join(sorted(cpu_flags())).encode() or os.uname().machine.encode()
    key = hashlib.sha256(b"\0".join([source_code(), " ".join(flags).encode(), _compiler_version(compiler), host]))
    target = _cache_dir() / f"{LIBRARY_STEM}-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    compile_library(compiler, flags, target)
    logger.info("compiled the CPU kernels into %s", target)
    return target


def _compiler_version(compiler: str) -> bytes:
    return subprocess.run([compiler, "--version"], capture_output=True, check=True, timeout=30).stdout


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
