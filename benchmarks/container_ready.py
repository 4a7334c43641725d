"""How long a fresh container of the image takes to serve: from `docker run -d` to the first 200 from /ready, and
where that time went, read from the container's log (Docker's timestamps, from the moment the process started).

    python -m benchmarks.container_ready [--image pagedserve:test] [--runs 3] [-- docker run arguments]

Each run starts a new container (nothing cached in it but what the image holds), polls /ready every 50 ms, then
removes it. Build the image first (`make test-container` tags it pagedserve:test).
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import subprocess
import sys
import time

import httpx

from tests.servers import free_port

# Log lines that mark a stage of the start, as (label, text the line contains).
MILESTONES = (
    ("listening", "Uvicorn running on"),
    ("kernels", "native CPU kernels ready"),
    ("model loaded", "loaded "),
    ("KV cache sized", "KV cache:"),
    ("ready", "ready to serve"),
)


def docker(*args: str) -> str:
    return subprocess.run(["docker", *args], capture_output=True, text=True, check=True, timeout=120).stdout


def timestamp(text: str) -> float:
    """Seconds since the epoch of Docker's RFC 3339 timestamp (nanoseconds cut to microseconds)."""
    head, _, fraction = text.rstrip("Z").partition(".")
    moment = datetime.datetime.fromisoformat(f"{head}.{fraction[:6] or '0'}+00:00")
    return moment.timestamp()


def milestones(container: str) -> dict[str, float]:
    """Seconds from the process's start to the first log line of each milestone."""
    started = timestamp(docker("inspect", "-f", "{{.State.StartedAt}}", container).strip())
    result = subprocess.run(["docker", "logs", "--timestamps", container], capture_output=True, text=True, timeout=60)
    found: dict[str, float] = {}
    for line in (result.stdout + result.stderr).splitlines():
        stamp, _, text = line.partition(" ")
        for label, marker in MILESTONES:
            if label not in found and marker in text:
                found[label] = timestamp(stamp) - started
    return found


def one_run(image: str, docker_args: list[str], timeout: float) -> tuple[float, dict[str, float]]:
    port = free_port()
    started = time.monotonic()
    container = docker("run", "-d", "-p", f"127.0.0.1:{port}:8000", *docker_args, image).strip()
    try:
        while time.monotonic() - started < timeout:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200:
                    return time.monotonic() - started, milestones(container)
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        sys.exit(f"not ready after {timeout:.0f} s:\n{docker('logs', container)[-3000:]}")
    finally:
        subprocess.run(["docker", "rm", "-f", container], capture_output=True, timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--image", default="pagedserve:test")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=180)
    parser.add_argument("docker_args", nargs="*", help="after --: more `docker run` arguments, e.g. --read-only")
    args = parser.parse_args()
    labels = [label for label, _ in MILESTONES]
    print(f"{args.image}, {args.runs} fresh containers; seconds from the process's start to each log line")
    print("| run | `docker run` to /ready 200 | " + " | ".join(labels) + " |")
    print("|---:|---:|" + "---:|" * len(labels))
    ready = []
    for run in range(1, args.runs + 1):
        took, stages = one_run(args.image, args.docker_args, args.timeout)
        ready.append(took)
        cells = " | ".join(f"{stages[label]:.1f}" if label in stages else "" for label in labels)
        print(f"| {run} | {took:.1f} | {cells} |", flush=True)
    print(f"\nready: median {statistics.median(ready):.1f} s, min {min(ready):.1f} s, max {max(ready):.1f} s")


if __name__ == "__main__":
    main()
