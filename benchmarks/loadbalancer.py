"""What the shipped load balancer costs a stream: time to first token and the largest gap between two chunks,
for streams sent straight to a replica and through haproxy (docker/loadbalancer/run-local.sh), alternating.

    python -m benchmarks.loadbalancer [--requests 30] [--max-tokens 64] [--concurrency 1] [--ablate-no-delay]
                                      [-- serve flags]

One `pagedserve serve` (the embedded model) on this machine, the balancer in front of it. --ablate-no-delay also
runs the configuration without `option http-no-delay`, haproxy's default, to show what that option is for.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.loadbalancer import MODEL, RUN_LOCAL, Outcome, find_haproxy, start_load_balancer, stream
from tests.servers import free_port, wait_ready

NO_DELAY = "    option http-no-delay\n"


def start_server(flags: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "pagedserve.server.cli", "serve", "--port", str(port), "--log-level", "warning"]
    server = subprocess.Popen([*command, *flags], stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    if not wait_ready(server, url, timeout=300):
        server.kill()
        sys.exit("the server did not become ready")
    return server, url


def without_no_delay(folder: Path) -> Path:
    """A copy of run-local.sh next to a haproxy.cfg without `option http-no-delay`."""
    config = (RUN_LOCAL.parent / "haproxy.cfg").read_text()
    assert NO_DELAY in config
    (folder / "haproxy.cfg").write_text(config.replace(NO_DELAY, ""))
    shutil.copy2(RUN_LOCAL, folder / RUN_LOCAL.name)
    return folder / RUN_LOCAL.name


def measure(url: str, requests: int, concurrency: int, max_tokens: int) -> list[Outcome]:
    with ThreadPoolExecutor(concurrency) as pool:
        outcomes = list(pool.map(lambda i: stream(url, i, max_tokens), range(requests)))
    failed = [o for o in outcomes if not o.done]
    if failed:
        sys.exit(f"{len(failed)} streams failed: {failed[:3]}")
    return outcomes


def row(name: str, outcomes: list[Outcome]) -> str:
    ttft = sorted((o.first_token - o.started) * 1000 for o in outcomes if o.first_token is not None)
    gaps = sorted(max(o.gaps) * 1000 for o in outcomes)
    events = statistics.median(o.events for o in outcomes)

    def quantile(values: list[float], q: float) -> float:
        return values[min(len(values) - 1, round(q * (len(values) - 1)))]

    return (
        f"| {name} | {quantile(ttft, 0.5):.1f} | {quantile(ttft, 0.9):.1f} | {ttft[-1]:.1f} "
        f"| {quantile(gaps, 0.5):.1f} | {quantile(gaps, 0.9):.1f} | {gaps[-1]:.1f} | {events:.0f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=30, help="streams per route and round (default: 30)")
    parser.add_argument("--rounds", type=int, default=2, help="alternations of the routes (default: 2)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--ablate-no-delay", action="store_true")
    parser.add_argument("serve_flags", nargs="*", help="extra `pagedserve serve` flags (after --)")
    args = parser.parse_args()
    if find_haproxy() is None:
        sys.exit("haproxy is missing (apt-get install haproxy)")

    server, direct = start_server(args.serve_flags)
    balancers = []
    try:
        with tempfile.TemporaryDirectory() as scratch:
            folder = Path(scratch)
            backend = [direct.removeprefix("http://")]
            routes = {"direct": direct}
            balancers.append(start_load_balancer(backend, folder / "haproxy.log"))
            routes["through haproxy.cfg"] = balancers[-1].url
            if args.ablate_no_delay:
                script = without_no_delay(folder)
                balancers.append(start_load_balancer(backend, folder / "no-delay-off.log", script=script))
                routes["through haproxy.cfg without http-no-delay"] = balancers[-1].url
            for balancer in balancers:
                balancer.wait_until({"replica1": "UP"}, timeout=30)
            measure(direct, 4, 1, 8)  # warm-up: first requests pay one-off costs
            results: dict[str, list[Outcome]] = {name: [] for name in routes}
            for _ in range(args.rounds):
                for name, url in routes.items():
                    results[name] += measure(url, args.requests, args.concurrency, args.max_tokens)
    finally:
        for balancer in balancers:
            balancer.stop()
        server.terminate()
        server.wait(60)

    print(
        f"\n{args.rounds} x {args.requests} streams per route, {args.max_tokens} tokens each, "
        f"{args.concurrency} at a time; model {MODEL}\n"
    )
    print("| route | TTFT p50 ms | TTFT p90 ms | TTFT max ms | largest gap p50 ms | p90 ms | max ms | events |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, outcomes in results.items():
        print(row(name, outcomes))


if __name__ == "__main__":
    main()
