"""Building csrc/ into one shared library with the system C compiler: for the host CPU at first use
(kernels/cpu_native.py), or ahead of time for each CPU level of a machine type, into a folder that an image
ships read-only next to a runtime without a compiler.

Ahead of time, `-march=native` is not an option: the image runs on CPUs other than the one that built it. So
one library per level (x86-64-v2, -v3 with AVX2 and FMA, -v4 with AVX-512; armv8-a), named by the level and a
digest of the sources and flags; at run time the best level whose features the CPU has is taken, and only
if its digest matches the installed sources.

The standard library only: an image's build stage runs this file by its path (`python native_build.py DIR`),
with no torch installed.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

SOURCE_DIR = Path(__file__).parent / "csrc"
# OpenMP only for its `simd` loop hints: threads come from csrc/parallel.c. FMA contraction, no errno and no FP
# traps let the compiler use fused multiply-adds, vectorised sqrt and compare-and-select; results differ from
# torch's by rounding only. The -march flag comes on top: native at first use, a level ahead of time.
COMMON_FLAGS = (
    "-O3",
    "-ffp-contract=fast",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fopenmp-simd",
    "-pthread",
    "-fPIC",
    "-shared",
    "-std=c11",
)
LIBRARY_STEM = "pagedserve_kernels"


@dataclass(frozen=True)
class CpuLevel:
    """A -march level and the /proc/cpuinfo flags a CPU needs to run code built for it."""

    name: str
    machine: str  # os.uname().machine
    flags: frozenset[str]


_V2 = frozenset({"cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3"})
_V3 = _V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}  # abm: LZCNT
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
LEVELS = (  # best first within a machine type
    CpuLevel("x86-64-v4", "x86_64", _V4),
    CpuLevel("x86-64-v3", "x86_64", _V3),
    CpuLevel("x86-64-v2", "x86_64", _V2),
    CpuLevel("armv8-a", "aarch64", frozenset()),
)


def find_compiler() -> str:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler found (install gcc, or set CC)")
    return compiler


def source_code() -> bytes:
    """Every source and header, with its name: what a build's key covers."""
    return b"\0".join(path.name.encode() + b"\0" + path.read_bytes() for path in sorted(SOURCE_DIR.glob("*.[ch]")))


def level_library_name(level: CpuLevel) -> str:
    """The ahead-of-time library's file name: its level and a digest of the sources and every flag."""
    flags = " ".join((*COMMON_FLAGS, f"-march={level.name}")).encode()
    digest = hashlib.sha256(source_code() + b"\0" + flags).hexdigest()[:16]
    return f"{LIBRARY_STEM}-{level.name}-{digest}.so"


def cpu_flags() -> frozenset[str]:
    """The host CPU's feature flags (Linux's /proc/cpuinfo); empty where it cannot be read."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def host_levels() -> list[CpuLevel]:
    """The levels this CPU runs, best first."""
    machine, flags = os.uname().machine, cpu_flags()
    return [level for level in LEVELS if level.machine == machine and level.flags <= flags]


def find_prebuilt(directory: Path) -> Path | None:
    """The best library in `directory` that this CPU runs and that was built from the installed sources."""
    for level in host_levels():
        path = directory / level_library_name(level)
        if path.is_file():
            return path
    return None


def compile_library(compiler: str, flags: tuple[str, ...], target: Path) -> None:
    """Compiles every source into `target`, atomically: a concurrent build of the same file wins or loses."""
    target.parent.mkdir(parents=True, exist_ok=True)
    sources = [str(path) for path in sorted(SOURCE_DIR.glob("*.c"))]
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        command = [compiler, *flags, *sources, "-o", str(built), "-lm"]
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed on {SOURCE_DIR}: {result.stderr.strip()[-2000:]}")
        os.replace(built, target)


def prebuild(directory: Path) -> list[Path]:
    """One library per CPU level of this machine type, into `directory`."""
    compiler = find_compiler()
    machine = os.uname().machine
    built = []
    for level in (level for level in LEVELS if level.machine == machine):
        target = directory / level_library_name(level)
        compile_library(compiler, (*COMMON_FLAGS, f"-march={level.name}"), target)
        built.append(target)
    if not built:
        raise RuntimeError(f"no CPU levels are listed for {machine}")
    return built


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python native_build.py DIRECTORY", file=sys.stderr)
        return 2
    for path in prebuild(Path(argv[0])):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
