"""A short soak (the CI cut of benchmarks/soak.py): mixed streaming traffic, clients hanging up, attacks mixed
in, then nothing left.

After ~30 s of 16 clients against a keyed server (a third hanging up at random, some with queue timeouts, a
small queue that sheds load, a fifth of the requests hostile: benchmarks/hostile.py, less the heavy attacks that
take seconds each), no request is running, no KV block is still referenced, no queue place is held, the API
process's and the engine core's RSS have not grown past a bound, the grammar sandboxes hold no more children than
their pools, every answer was complete or a clean error, every attack got its planned answer, and every innocent
greedy probe got the text it had alone. (The stream gap limit is the long soak's: here blocks run short
on purpose, and a preempted stream waits.)
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.hostile import ATTACKS
from benchmarks.soak import API_KEY, MODEL, soak
from benchmarks.soak_server import Served, serve_process

SECONDS = 30
RSS_GROWTH_LIMIT_MB = 100  # after warm-up; a leak per request would pass it within seconds
# The grammar sandboxes' pools, two children each, in the API process and in the engine core (sandbox.py).
MAX_SANDBOX_CHILDREN = 4
# Small enough that queues fill (503s) and blocks run short (preemption) under 16 clients.
FLAGS = ["--num-kv-blocks", "48", "--max-num-seqs", "8", "--max-queue-len", "12", "--num-threads", "1"]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """`pagedserve serve` on the embedded model, in a process of its own, as the long soak runs it."""
    log: Path = tmp_path_factory.mktemp("soak") / "serve.log"
    with serve_process(FLAGS, MODEL, API_KEY, log) as served:
        yield served


def test_soak_leaves_nothing_behind(served: Served) -> None:
    light = tuple(attack for attack in ATTACKS if not attack.heavy)
    report = soak(served, SECONDS, clients=16, seed=1, hostile_share=0.2, api_key=API_KEY, attacks=light)
    summary = "\n".join(report.lines())
    print(summary)
    assert report.completed > 20 and report.hung_up > 10 and report.probes > 2, summary
    assert sum(report.attacks.values()) > 5, summary
    assert not report.failures, summary
    assert report.running_after == 0 and report.kv_usage_after == 0.0 and report.lost_blocks == 0, summary
    assert report.leaked_places == 0 and report.unplanned_5xx == 0 and report.changed_probes == 0, summary
    assert report.rss_growth_mb < RSS_GROWTH_LIMIT_MB, summary
    assert report.sandbox_children <= MAX_SANDBOX_CHILDREN, summary
