"""Two replicas of the image behind the shipped load balancer (docker/loadbalancer/run-local.sh: haproxy with
haproxy.cfg): streams pass through without delay, X-Request-Id goes through both ways, a replica killed
mid-load fails no request that had not yet received a byte, and a replica stopped mid-load fails none.

Each load test prints what happened (pytest -s shows it); benchmarks/README.md quotes a run.
"""

from __future__ import annotations

import statistics
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest
import yaml

from tests.containers import ROOT, Container, built_image, docker, start_container, unavailable
from tests.loadbalancer import LoadBalancer, Outcome, find_haproxy, start_load_balancer, stream

pytestmark = pytest.mark.container

STARTUP_SECONDS = 180
# The replicas run as docker/compose.yaml runs them (its command, its stop grace), with one engine thread each:
# two replicas share 2 cores here.
COMPOSE = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())["services"]["pagedserve"]
REPLICA_ARGS = (*COMPOSE["command"], "--num-threads", "1")
STOP_GRACE = str(int(COMPOSE["stop_grace_period"].removesuffix("s")))
BOTH_UP = {"replica1": "UP", "replica2": "UP"}


@dataclass
class Cluster:
    image: str
    replicas: list[Container]
    balancer: LoadBalancer


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if find_haproxy() is None:
        unavailable("haproxy is missing: apt-get install haproxy (the sandbox script installs it)")
    image = built_image()
    replicas: list[Container] = []
    balancer = None
    try:
        replicas += [start_container(image, *REPLICA_ARGS) for _ in range(2)]
        for replica in replicas:
            replica.wait_ready(STARTUP_SECONDS)
        log = tmp_path_factory.mktemp("loadbalancer") / "haproxy.log"
        balancer = start_load_balancer([f"127.0.0.1:{replica.port}" for replica in replicas], log)
        balancer.wait_until(BOTH_UP, timeout=30)
        yield Cluster(image, replicas, balancer)
    finally:
        if balancer is not None:
            balancer.stop()
        for replica in replicas:
            replica.remove()


def run_load(
    url: str, count: int, concurrency: int, max_tokens: int, after: int, action: Callable[[], None]
) -> tuple[list[Outcome], float]:
    """`count` streams, `concurrency` at a time; once `after` of them have finished, `action` runs on a thread of
    its own (the load goes on). Returns the outcomes and when the action started."""
    finished = 0
    lock = threading.Lock()
    trigger = threading.Event()
    acted: list[float] = []

    def act() -> None:
        trigger.wait()
        acted.append(time.monotonic())
        action()

    def one(index: int) -> Outcome:
        nonlocal finished
        outcome = stream(url, index, max_tokens)
        with lock:
            finished += 1
            if finished == after:
                trigger.set()
        return outcome

    actor = threading.Thread(target=act, daemon=True)
    actor.start()
    with ThreadPoolExecutor(concurrency) as pool:
        outcomes = list(pool.map(one, range(count)))
    trigger.set()
    actor.join(60)
    assert acted, "the action never ran"
    return outcomes, acted[0]


def describe(outcomes: list[Outcome]) -> str:
    failed = [o for o in outcomes if not o.done]
    cut = sorted((o.events, o.error or "no [DONE]") for o in failed)
    return f"{len(outcomes) - len(failed)}/{len(outcomes)} completed; not completed (events received, why): {cut}"


def test_streams_pass_through_without_delay(cluster: Cluster) -> None:
    """haproxy's defaults held each chunk back (~200 ms) until `option http-no-delay`: the balancer must add
    next to nothing to the time to first token or to the gaps between chunks."""
    direct, balanced = cluster.replicas[0].url, cluster.balancer.url
    pairs = [(stream(direct, i, 32), stream(balanced, i, 32)) for i in range(6)]
    for outcome in (o for pair in pairs for o in pair):
        assert outcome.done and outcome.first_token is not None, outcome
    ttft = statistics.median(b.first_token - b.started - (d.first_token - d.started) for d, b in pairs)  # type: ignore[operator]
    gap = statistics.median(max(b.gaps) - max(d.gaps) for d, b in pairs)
    print(f"\nthrough the balancer: time to first token {ttft * 1000:+.1f} ms, largest gap {gap * 1000:+.1f} ms")
    assert ttft < 0.1 and gap < 0.1


def test_request_ids_pass_through(cluster: Cluster) -> None:
    body = {"model": "SmolLM2-135M-Instruct", "prompt": "1, 2,", "max_tokens": 2}
    url = f"{cluster.balancer.url}/v1/completions"
    given = httpx.post(url, json=body, headers={"X-Request-Id": "failover-test-given"}, timeout=60)
    assert given.status_code == 200 and given.headers["x-request-id"] == "failover-test-given"
    made = httpx.post(url, json=body, timeout=60)
    assert made.status_code == 200
    minted = made.headers["x-request-id"]
    assert uuid.UUID(minted).version == 4 and "-" in minted, "the balancer's id (pagedserve's own have no dashes)"
    deadline = time.monotonic() + 5
    while minted not in (log := cluster.balancer.log.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert minted in log and "failover-test-given" in log, log[-2000:]
    assert any(minted in replica.logs() for replica in cluster.replicas)


def test_a_killed_replica_fails_only_the_streams_it_had_started(cluster: Cluster) -> None:
    """40 streams, 8 at a time; replica1 gets SIGKILL once 10 have finished. Requests it had accepted but not
    answered, and every later one, must go to replica2 (haproxy retries them); streams already under way on it
    cannot be saved: their clients see the connection end without [DONE]."""
    victim = cluster.replicas[0]
    before = cluster.balancer.backend()
    marked_down: list[float] = []

    def kill() -> None:
        docker("kill", victim.id)
        killed = time.monotonic()
        while cluster.balancer.server_status()["replica1"] == "UP" and time.monotonic() - killed < 30:
            time.sleep(0.05)
        marked_down.append(time.monotonic() - killed)

    outcomes, killed_at = run_load(cluster.balancer.url, count=40, concurrency=8, max_tokens=64, after=10, action=kill)
    after = cluster.balancer.backend()
    failed = [o for o in outcomes if not o.done]
    print(
        f"\nkill: {describe(outcomes)}; replica1 marked down {marked_down[0]:.2f} s after the kill; haproxy "
        f"retries {int(after['wretr']) - int(before['wretr'])}, redispatches "
        f"{int(after['wredis']) - int(before['wredis'])}"
    )
    assert not [o for o in failed if o.head is None or o.status != 200], "a request failed before its first byte"
    assert all(o.started < killed_at for o in failed), "a request sent after the kill failed"
    assert len(failed) <= 8
    assert cluster.balancer.server_status()["replica1"] != "UP"


def test_a_stopped_replica_fails_nothing(cluster: Cluster) -> None:
    """A rolling restart: replica1 comes back (a new container on its port), then replica2 gets `docker stop`
    with compose's grace mid-load. Its /ready turns 503 at once (haproxy stops choosing it), requests that reach
    it while it drains are answered 503 and retried on replica1, and its streams finish."""
    port = cluster.replicas[0].port
    cluster.replicas.append(start_container(cluster.image, *REPLICA_ARGS, port=port))
    cluster.replicas[-1].wait_ready(STARTUP_SECONDS)
    cluster.balancer.wait_until(BOTH_UP, timeout=30)
    stopping = cluster.replicas[1]
    before = cluster.balancer.backend()
    outcomes, _ = run_load(
        cluster.balancer.url, count=24, concurrency=6, max_tokens=32, after=6,
        action=lambda: docker("stop", "-t", STOP_GRACE, stopping.id, timeout=120),
    )  # fmt: skip
    after = cluster.balancer.backend()
    print(
        f"\nstop: {describe(outcomes)}; replica2 exit {stopping.state('ExitCode')}; haproxy retries "
        f"{int(after['wretr']) - int(before['wretr'])}, redispatches {int(after['wredis']) - int(before['wredis'])}"
    )
    assert all(o.done for o in outcomes), describe(outcomes)
    assert stopping.state("ExitCode") == "0"
