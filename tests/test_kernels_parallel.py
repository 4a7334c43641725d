"""The native kernels' thread pool (kernels/csrc/parallel.c): every item once, concurrent callers, fork."""

from __future__ import annotations

import ctypes
import multiprocessing
import platform
import queue as queue_module
import shutil
import sys
import threading
from collections.abc import Callable

import pytest
import torch

from pagedserve.kernels.cpu_linear import skinny_linear_kernel
from pagedserve.kernels.cpu_native import native_library

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")

Body = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)


def _run_parallel_for(items: int, grain: int, threads: int, chunk: Callable[[int, int], None]) -> None:
    """parallel_for with a Python body: chunk(begin, end) for each chunk it hands out, on whichever thread."""
    library = native_library()
    assert library is not None
    body = Body(lambda _context, begin, end: chunk(begin, end))  # kept alive until the call returns
    library.parallel_for.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int, Body, ctypes.c_void_p]
    library.parallel_for(items, grain, threads, body, None)


def _parallel_for(items: int, grain: int, threads: int) -> list[tuple[int, int]]:
    """The [begin, end) ranges parallel_for hands out."""
    ranges: list[tuple[int, int]] = []
    lock = threading.Lock()

    def record(begin: int, end: int) -> None:
        with lock:
            ranges.append((begin, end))

    _run_parallel_for(items, grain, threads, record)
    return ranges


@pytest.mark.parametrize("items", [0, 1, 7, 100, 1000])
@pytest.mark.parametrize("grain", [1, 3, 64])
@pytest.mark.parametrize("threads", [1, 2, 4])
def test_every_item_runs_exactly_once(items: int, grain: int, threads: int) -> None:
    ranges = _parallel_for(items, grain, threads)
    covered = sorted(i for begin, end in ranges for i in range(begin, end))
    assert covered == list(range(items))
    assert all(end - begin <= max(grain, 1) for begin, end in ranges) or len(ranges) == 1  # one inline run


def _linear_case(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(576, 48, generator=generator).t()
    weight = torch.randn(960, 576, generator=generator)
    return x, weight, torch.nn.functional.linear(x, weight)


def test_callers_on_several_threads_get_their_own_results() -> None:
    """Kernels release the GIL: two engines (or a server and a test) may call them at once."""
    kernel = skinny_linear_kernel()
    assert kernel is not None
    failures: list[str] = []

    def run(seed: int) -> None:
        x, weight, expected = _linear_case(seed)
        for _ in range(30):
            if not torch.allclose(kernel(x, weight, None), expected, rtol=1e-5, atol=1e-4):
                failures.append(f"caller {seed}")

    callers = [threading.Thread(target=run, args=(seed,)) for seed in range(4)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join(timeout=120)
    assert not any(caller.is_alive() for caller in callers), "a caller hung"
    assert failures == []


def _linear_in_child(x: torch.Tensor, weight: torch.Tensor, queue: multiprocessing.Queue) -> None:
    """Only the kernel runs here: torch's own OpenMP is not fork-safe, so the parent checks the result."""
    kernel = skinny_linear_kernel()
    assert kernel is not None
    out = kernel(x, weight, None)  # feature-major: out.t() is the contiguous buffer
    queue.put(out.t().numpy().tobytes())


def test_a_forked_child_starts_its_own_workers() -> None:
    """A child has the parent's pool state but not its threads: kernels there must not wait for them."""
    kernel = skinny_linear_kernel()
    assert kernel is not None
    x, weight, expected = _linear_case(0)
    kernel(x, weight, None)  # the parent's workers exist now
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_linear_in_child, args=(x, weight, queue))
    child.start()
    try:
        data = queue.get(timeout=120)  # before join(): the child exits only once its result is read
    except queue_module.Empty:
        pytest.fail("the forked child hung in a kernel")
    finally:
        child.join(timeout=10)
        if child.is_alive():
            child.kill()
    result = torch.frombuffer(bytearray(data), dtype=torch.float32).view(weight.shape[0], -1).t()
    torch.testing.assert_close(result, expected, rtol=1e-5, atol=1e-4)


def _flushes_subnormals() -> bool:
    """Whether this thread's float arithmetic turns a subnormal result into zero (x86's flush-to-zero mode)."""
    smallest_normal = sys.float_info.min
    return smallest_normal / 4 == 0.0


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the mode is x86's MXCSR")
@pytest.mark.parametrize("threads", [1, 2])
def test_loops_flush_subnormals_and_the_caller_keeps_its_mode(threads: int) -> None:
    """A model's activations can sink into the subnormal range, where each operation costs a microcode assist:
    the pool's loops run with subnormals flushed to zero, and the calling thread gets its own mode back."""
    flushed: list[bool] = []
    lock = threading.Lock()

    def record(_begin: int, _end: int) -> None:
        with lock:
            flushed.append(_flushes_subnormals())

    assert not _flushes_subnormals()
    _run_parallel_for(64, 1, threads, record)
    assert flushed and all(flushed)
    assert not _flushes_subnormals()
