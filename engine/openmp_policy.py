"""The wait policy of torch's OpenMP threads, which must be chosen before torch loads.

torch's OpenMP workers (MKL matmuls at prefill, torch's own ops) would spin while they wait, taking the core
from the thread doing the work whenever anything else runs (the engine's kernel pool, the HTTP thread, a
tokenizer, another process): matmuls then slow down up to 10x, and the kernel pool's worker, which yields
while it waits (kernels/csrc/parallel.c), loses its core to them (22-28% of offline throughput on 2 cores,
one profiled A/B). So they sleep; waking them costs a little on each parallel region, which even on a quiet
host a spin no longer wins back (GOMP_SPINCOUNT; benchmarks/omp_wait.py and the README). OpenMP reads the
policy once, when torch loads: imported after torch, this module can only say so. The engine core process
(engine/core/process.py) inherits os.environ as set here, so its torch always starts with the policy.
"""

from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger(__name__)

# Before anything imports torch (so no torch import here): engine/__init__.py imports this module first.
SET_TOO_LATE = "torch" in sys.modules and "OMP_WAIT_POLICY" not in os.environ
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def warn_if_set_too_late(device_type: str) -> None:
    """Logs a warning where the policy could not take effect and it matters: an engine on the CPU."""
    if SET_TOO_LATE and device_type == "cpu":
        logger.warning(
            "torch was imported before engine, so OMP_WAIT_POLICY=PASSIVE came too late: torch's OpenMP "
            "threads spin after each parallel region and take CPU from the engine's kernels. Set "
            "OMP_WAIT_POLICY in the environment, or import engine before torch."
        )
