"""The native CPU kernels built ahead of time (kernels/native_build.py), as the container image ships them: a
runtime without a compiler loads the best CPU level's library from a read-only folder, and never one built
from other sources."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from pagedserve.kernels import cpu_native, native_build
from tests.test_kernels_native import _forget_built_kernels


@pytest.fixture
def no_compiler(monkeypatch, tmp_path):
    """CC fails, the first-use cache is empty and private, and no kernel is memoised."""
    monkeypatch.setenv("CC", "false")
    monkeypatch.setenv("PAGEDSERVE_KERNEL_CACHE_DIR", str(tmp_path / "cache"))
    _forget_built_kernels()
    yield
    _forget_built_kernels()


def build_level(directory: Path, level: native_build.CpuLevel) -> Path:
    target = directory / native_build.level_library_name(level)
    flags = (*native_build.COMMON_FLAGS, f"-march={level.name}")
    native_build.compile_library(native_build.find_compiler(), flags, target)
    return target


@pytest.fixture(scope="module")
def shipped(tmp_path_factory) -> Path:
    """A read-only folder holding the library of the host's best level, built once (by the real compiler)."""
    levels = native_build.host_levels()
    if not levels:
        pytest.skip("no CPU level is listed for this machine")
    directory = tmp_path_factory.mktemp("prebuilt")
    build_level(directory, levels[0])
    directory.chmod(0o555)
    return directory


def test_the_shipped_library_runs_without_a_compiler(shipped, no_compiler, monkeypatch, caplog) -> None:
    monkeypatch.setenv(cpu_native.PREBUILT_DIR_ENV, str(shipped))
    with caplog.at_level(logging.INFO, logger="pagedserve.kernels.cpu_native"):
        write_kv = cpu_native.write_kv_kernel()
    (library,) = shipped.iterdir()
    assert write_kv is not None and f"native CPU kernels ready ({library})" in caplog.text
    key, value = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    k_cache, v_cache = torch.zeros(4, 4, 2, 8), torch.zeros(4, 4, 2, 8)
    assert write_kv(key, value, k_cache, v_cache, torch.tensor([0, 5, -1]))
    assert torch.equal(k_cache.view(-1, 2, 8)[[0, 5]], key[:2]) and torch.equal(v_cache.view(-1, 2, 8)[5], value[1])


def test_a_library_of_other_sources_is_never_loaded(shipped, no_compiler, tmp_path, monkeypatch, caplog) -> None:
    """The name carries the sources' digest: after an upgrade the stale file is passed over (here: compiling,
    which fails without a compiler, so the torch path runs)."""
    stale = tmp_path / "stale"
    stale.mkdir()
    (library,) = shipped.iterdir()
    level = library.name.split("-", 1)[1].rsplit("-", 1)[0]
    (stale / f"{native_build.LIBRARY_STEM}-{level}-0000000000000000.so").write_bytes(library.read_bytes())
    monkeypatch.setenv(cpu_native.PREBUILT_DIR_ENV, str(stale))
    with caplog.at_level(logging.INFO, logger="pagedserve.kernels.cpu_native"):
        assert cpu_native.native_library() is None
    assert "using the slower torch path" in caplog.text


def test_the_best_level_the_cpu_runs_is_chosen(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(native_build.os, "uname", lambda: type("uname", (), {"machine": "x86_64"})())
    v3 = next(level for level in native_build.LEVELS if level.name == "x86-64-v3")
    for level in native_build.LEVELS:
        (tmp_path / native_build.level_library_name(level)).touch()
    monkeypatch.setattr(native_build, "cpu_flags", lambda: v3.flags | {"avx512f"})  # AVX-512 in part: not v4
    assert native_build.find_prebuilt(tmp_path) == tmp_path / native_build.level_library_name(v3)
    monkeypatch.setattr(native_build, "cpu_flags", lambda: frozenset({"sse2"}))  # below every level
    assert native_build.find_prebuilt(tmp_path) is None


def test_a_shipped_library_that_does_not_load_is_compiled_instead(tmp_path, monkeypatch, caplog) -> None:
    """E.g. a folder mounted noexec: a warning, then the first-use build (here with the real compiler)."""
    levels = native_build.host_levels()
    if not levels:
        pytest.skip("no CPU level is listed for this machine")
    (tmp_path / native_build.level_library_name(levels[0])).write_bytes(b"not a shared object")
    monkeypatch.setenv(cpu_native.PREBUILT_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("PAGEDSERVE_KERNEL_CACHE_DIR", str(tmp_path / "cache"))
    _forget_built_kernels()
    try:
        with caplog.at_level(logging.INFO, logger="pagedserve.kernels.cpu_native"):
            assert cpu_native.native_library() is not None
    finally:
        _forget_built_kernels()
    assert "do not load" in caplog.text and "compiled the CPU kernels into" in caplog.text
