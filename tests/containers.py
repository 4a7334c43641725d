"""Docker for the container tests (marker `container`): the image built once per test run, containers that are
always removed, and whether a missing Docker skips those tests or fails them.

Environment:
  PAGEDSERVE_DOCKER_BUILD_ARGS        extra `docker build` arguments (../shared/tools/docker-sandbox.sh prints
                                      the ones for machines without Docker Hub)
  PAGEDSERVE_REQUIRE_CONTAINER_TESTS  set (by .ci/run): no Docker, haproxy or docker-compose fails the tests
                                      instead of skipping them
  PAGEDSERVE_TEST_IMAGE               the tag to build and test (default pagedserve:test)
"""

from __future__ import annotations

import functools
import itertools
import os
import shlex
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import httpx
import pytest

from tests.servers import free_port

ROOT = Path(__file__).resolve().parents[1]
REQUIRE_ENV = "PAGEDSERVE_REQUIRE_CONTAINER_TESTS"
BUILD_ARGS_ENV = "PAGEDSERVE_DOCKER_BUILD_ARGS"
IMAGE = os.environ.get("PAGEDSERVE_TEST_IMAGE", "pagedserve:test")
BUILD_TIMEOUT = 1200  # uncached, on a busy 2-core machine; cached builds take seconds
LABEL = "pagedserve-test"  # on every container started here: `docker rm -f $(docker ps -aqf label=pagedserve-test)`
_names = itertools.count()


def unavailable(reason: str) -> NoReturn:
    """Skips the test, or fails it where the container tests must run (.ci/run)."""
    if os.environ.get(REQUIRE_ENV):
        pytest.fail(f"{reason} ({REQUIRE_ENV} is set: the container tests must run here)")
    pytest.skip(reason)


def require_tool(name: str, hint: str) -> str:
    found = shutil.which(name)
    if found is None:
        unavailable(f"{name} is missing: {hint}")
    return found


def docker(*args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise RuntimeError(f"docker {shlex.join(args)} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return result


@functools.cache
def _docker_problem() -> str | None:
    if shutil.which("docker") is None:
        return "docker is missing"
    try:
        info = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return "the Docker daemon does not answer"
    return None if info.returncode == 0 else f"no Docker daemon: {info.stderr.strip()[-300:]}"


def require_docker() -> None:
    problem = _docker_problem()
    if problem:
        unavailable(f'{problem} (on machines without Docker Hub: eval "$(../shared/tools/docker-sandbox.sh)")')


# Each stage of the Dockerfile that a later build can reuse gets a tag (IMAGE-deps, ...), so that pruning the
# untagged leftovers of earlier builds (a converted model per code change, ~550 MB) keeps the cache.
STAGES = ("deps", "kernels", "builder", "model", None)


@functools.cache
def _build() -> tuple[str | None, str]:
    """(image, "") once built, else (None, why); built once per test run, Docker's layer cache does the rest."""
    env = dict(os.environ)
    if subprocess.run(["docker", "buildx", "version"], capture_output=True).returncode != 0:
        env["DOCKER_BUILDKIT"] = "0"  # no buildx plugin: the classic builder, which needs none
    # --network host: the build reaches what the host reaches, e.g. a local wheel server on 127.0.0.1.
    build = ["docker", "build", "--network", "host", *shlex.split(os.environ.get(BUILD_ARGS_ENV, ""))]
    deadline = time.monotonic() + BUILD_TIMEOUT
    for stage in STAGES:
        command = [*build, "-t", f"{IMAGE}-{stage}" if stage else IMAGE]
        command += ["--target", stage] if stage else []
        command.append(str(ROOT))
        try:
            result = subprocess.run(
                command, capture_output=True, text=True, timeout=max(deadline - time.monotonic(), 1), env=env
            )
        except subprocess.TimeoutExpired:
            return None, f"docker build took over {BUILD_TIMEOUT} s"
        if result.returncode != 0:
            return None, f"{shlex.join(command)} failed:\n{result.stdout[-4000:]}\n{result.stderr[-3000:]}"
    took = BUILD_TIMEOUT - (deadline - time.monotonic())
    docker("image", "prune", "--force", "--filter", "label=org.opencontainers.image.title=pagedserve", timeout=300)
    print(f"\nbuilt {IMAGE} in {took:.0f} s")
    return IMAGE, ""


def built_image() -> str:
    """The CPU image of this checkout, built (or found in Docker's cache) once per test run."""
    require_docker()
    image, problem = _build()
    if image is None:
        pytest.fail(problem)
    return image


@dataclass
class Container:
    """A running container whose server's port is published on 127.0.0.1:`port`."""

    id: str
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def logs(self) -> str:
        result = docker("logs", self.id, check=False)
        return result.stdout + result.stderr

    def state(self, field: str) -> str:
        return docker("inspect", "-f", f"{{{{.State.{field}}}}}", self.id).stdout.strip()

    def running(self) -> bool:
        return self.state("Running") == "true"

    def wait_ready(self, timeout: float) -> None:
        """Until /ready answers 200; fails with the container's log if it exits or the time runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.running():
            try:
                if httpx.get(f"{self.url}/ready", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        pytest.fail(f"the container did not become ready (running: {self.running()}):\n{self.logs()[-4000:]}")

    def remove(self) -> None:
        docker("rm", "-f", self.id, check=False)


def start_container(
    image: str, *args: str, docker_args: tuple[str, ...] = (), port: int | None = None, container_port: int = 8000
) -> Container:
    """`docker run -d` of `image` with its `container_port` on loopback `port` (default: a free one); `args`
    replace the image's CMD."""
    port = port or free_port()
    name = f"pagedserve-test-{os.getpid()}-{next(_names)}"
    publish = f"127.0.0.1:{port}:{container_port}"
    run = ["run", "-d", "--name", name, "--label", LABEL, "-p", publish, *docker_args, image]
    return Container(docker(*run, *args).stdout.strip(), port)
