"""A short soak (the CI cut of benchmarks/soak.py): mixed streaming traffic, clients hanging up, attacks mixed
in, then nothing left.

After ~30 s of 16 clients against a keyed server (a third hanging up at random, some with queue timeouts, a
small queue that sheds load, a fifth of the requests hostile: benchmarks/hostile.py, less the heavy attacks that
take seconds each), no request is running, no KV block is still referenced, no queue place is held, RSS has not
grown past a bound, every answer was complete or a clean error, every attack got its planned answer, and every
innocent greedy probe got the text it had alone. (The stream gap limit is the long soak's: here blocks run short
on purpose, and a preempted stream waits.)
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from benchmarks.hostile import ATTACKS
from benchmarks.soak import API_KEY, MODEL, soak
from pagedserve.engine import EngineConfig
from pagedserve.engine.client.async_engine import AsyncEngine
from pagedserve.engine.worker.model_loader import LoadedModel
from pagedserve.server import ServerSettings
from tests.servers import running_engine, serving

SECONDS = 30
RSS_GROWTH_LIMIT_MB = 100  # after warm-up; a leak per request would pass it within seconds
# Small enough that queues fill (503s) and blocks run short (preemption) under 16 clients.
CONFIG = EngineConfig(num_kv_blocks=48, max_num_seqs=8, max_queue_len=12)


@pytest.fixture(scope="module")
def engine(smol_loaded: LoadedModel) -> Iterator[AsyncEngine]:
    with running_engine(CONFIG, smol_loaded) as engine:
        yield engine


def test_soak_leaves_nothing_behind(engine: AsyncEngine) -> None:
    light = tuple(attack for attack in ATTACKS if not attack.heavy)
    with serving(engine, ServerSettings([MODEL], api_key=API_KEY)) as url:
        report = soak(url, engine, SECONDS, clients=16, seed=1, hostile_share=0.2, api_key=API_KEY, attacks=light)
    summary = "\n".join(report.lines())
    print(summary)
    assert report.completed > 20 and report.hung_up > 10 and report.probes > 2, summary
    assert sum(report.attacks.values()) > 5, summary
    assert not report.failures, summary
    assert report.running_after == 0 and report.kv_usage_after == 0.0 and report.lost_blocks == 0, summary
    assert report.leaked_places == 0 and report.unplanned_5xx == 0 and report.changed_probes == 0, summary
    assert report.rss_growth_mb < RSS_GROWTH_LIMIT_MB, summary
