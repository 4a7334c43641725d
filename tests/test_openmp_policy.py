"""torch's OpenMP wait policy: set before torch loads, or a warning that it came too late."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from pagedserve.engine import openmp_policy


def _import_engine(statements: str) -> str:
    env = {key: value for key, value in os.environ.items() if key != "OMP_WAIT_POLICY"}
    code = f"{statements}\nimport os\nfrom engine import openmp_policy\n"
    code += "print(openmp_policy.SET_TOO_LATE, os.environ['OMP_WAIT_POLICY'])"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return done.stdout.strip()


def test_engine_first_sets_the_policy_in_time() -> None:
    assert _import_engine("") == "False PASSIVE"


def test_torch_first_is_detected() -> None:
    assert _import_engine("import torch") == "True PASSIVE"


def test_warning_only_when_too_late_on_the_cpu(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    caplog.set_level(logging.WARNING, logger=openmp_policy.__name__)
    monkeypatch.setattr(openmp_policy, "SET_TOO_LATE", False)
    openmp_policy.warn_if_set_too_late("cpu")
    monkeypatch.setattr(openmp_policy, "SET_TOO_LATE", True)
    openmp_policy.warn_if_set_too_late("cuda")
    assert not caplog.records
    openmp_policy.warn_if_set_too_late("cpu")
    assert len(caplog.records) == 1 and "OMP_WAIT_POLICY" in caplog.records[0].getMessage()
