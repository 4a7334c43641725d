"""Soak: minutes of mixed traffic with clients that hang up at random or attack, then what it left behind.

Starts a server with an API key on 127.0.0.1 in this process and runs concurrent clients against it: mostly
streaming completions and chats of random lengths, some with n=2, some with a short queue `timeout`; a share of
the requests hang up at a random point; a share are attacks (benchmarks/hostile.py), each planned to get a given
answer, sent in every other half-minute; a share are innocent probes, greedy completions whose text must equal
what they gave alone before the traffic began. It reports unplanned 5xx answers, every other failure (answers
neither complete nor a clean error, attacks answered otherwise than planned), changed probes, the innocent
streams' largest wait between two chunks while attacks were in flight (and, as a control, while none was), and
once the traffic stops: lost KV blocks (referenced with nothing running), leaked queue places (held with nothing
waiting) and the RSS growth after warm-up of the server and engine processes.

    python -m benchmarks.soak [--minutes 10] [--clients 16] [--hang-up-share 0.33] [--hostile-share 0.2]
                              [any engine flag]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field

import httpx
import psutil

from benchmarks.attack_kit import Attack, Target, Unplanned
from benchmarks.hostile import ATTACKS
from benchmarks.soak_report import SoakReport
from pagedserve.engine import QueueFullError
from pagedserve.engine.client.async_engine import AsyncEngine
from pagedserve.server import ServerSettings
from pagedserve.server.engine_args import add_engine_args, engine_config
from tests.servers import serving

MODEL = "soak"
API_KEY = "soak-key"
WORDS = ["the", "a", "cat", "sat", "on", "mat", "and", "then", "it", "ran", "far", "away", "to", "find", "tea"]
DELIBERATE = {"queue_full": 503, "queue_timeout": 503, "timeout": 408}  # shed load, or the client's own timeout
BACKOFF_SECONDS = (0.2, 1.0)  # after a deliberate 503 or 408, like a client honouring Retry-After
IDLE_TIMEOUT = 60.0  # seconds for the engine to settle once traffic stops
PROBES = ("The capital of France is", "Once upon a time", "def fibonacci(n):", "The three primary colors are")
PROBE_SHARE = 0.1
# Engine flags the soak defaults to, for the small shared CPU machine it runs on (any flag overrides them): a step of
# 2,048 prompt tokens takes seconds on a CPU, longer than the gap limit; and two intra-op threads, which meet at a
# barrier in every layer, stall whenever either loses its core to other work (on a busy 2-core machine: 247 of
# 1,711 gaps over 1 s with two threads, 1 of 2,824 with one, no attacks at all).
MACHINE_DEFAULTS = {"max_num_batched_tokens": 64, "num_threads": 1}
# Attacks are sent in every other half-minute: the innocent streams' gaps while none is in flight are the control,
# measured in the same run, on the same (possibly busy) machine.
ATTACK_PHASE_SECONDS = 30.0


def random_request(rng: random.Random) -> tuple[str, dict]:
    text = " ".join(rng.choices(WORDS, k=rng.randint(2, 40)))
    body: dict = {"model": MODEL, "max_tokens": rng.randint(1, 32), "stream": rng.random() < 0.8}
    if rng.random() < 0.2:
        body["n"] = 2
    if rng.random() < 0.1:
        body["timeout"] = rng.uniform(0.05, 1.0)
    if rng.random() < 0.5:
        return "/v1/completions", {**body, "prompt": text}
    return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": text}]}


def judge_error(status: int | None, body: dict, report: SoakReport, what: str) -> bool:
    """An error answer (`status`) or a stream's final error event (None): True when it was deliberate."""
    error = body.get("error")
    if isinstance(error, dict) and error.get("code") in DELIBERATE and status in (None, DELIBERATE[error["code"]]):
        report.deliberate += 1
        return True
    if (status or 500) >= 500:  # a stream's error event stands for the 5xx it could no longer send
        report.unplanned_5xx += 1
    if not isinstance(error, dict) or not isinstance(error.get("code"), str):
        report.failures.append(f"{what}: {status} without an OpenAI error: {str(body)[:200]}")
    else:
        report.failures.append(f"{what}: {status} {error['code']}: {error.get('message')}")
    return False


async def one_request(client: httpx.AsyncClient, rng: random.Random, hang_up_share: float, report: SoakReport) -> bool:
    """Returns True when the server asked to back off."""
    path, body = random_request(rng)
    hang_up_after = rng.randint(1, 6) if rng.random() < hang_up_share else None  # events, or seconds / 6
    what = f"{path} stream={body['stream']} n={body.get('n', 1)}"
    report.requests += 1
    if not body["stream"]:
        try:
            wait = None if hang_up_after is None else hang_up_after / 6
            response = await asyncio.wait_for(client.post(path, json=body), wait)
        except asyncio.TimeoutError:
            report.hung_up += 1
            return False
        if response.status_code != 200:
            return judge_error(response.status_code, response.json(), report, what)
        choices = response.json()["choices"]
        if len(choices) == body.get("n", 1) and all(c["finish_reason"] for c in choices):
            report.completed += 1
        else:
            report.failures.append(f"{what}: incomplete answer {response.text[:200]}")
        return False
    async with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            return judge_error(response.status_code, json.loads(await response.aread()), report, what)
        events: list[str] = []
        last_token_at = None  # the opening chunks (a chat's role) come before any token: the wait is the queue's
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
                if '"role"' not in line:
                    now = time.monotonic()
                    if last_token_at is not None:
                        report.gaps.note(now - last_token_at)
                    last_token_at = now
                if len(events) == hang_up_after:
                    report.hung_up += 1
                    return False  # leaving the block mid-stream closes the connection
    if events and events[-1] == "[DONE]":
        report.completed += 1
    elif events and "error" in json.loads(events[-1]):
        return judge_error(None, json.loads(events[-1]), report, what)
    else:
        report.failures.append(f"{what}: the stream ended without [DONE] or an error: {events[-2:]}")
    return False


@dataclass(frozen=True)
class Traffic:
    hang_up_share: float = 1 / 3
    hostile_share: float = 0.0
    probe_texts: dict[str, str] = field(default_factory=dict)  # prompt -> its greedy text alone
    api_key: str | None = None
    attacks: tuple[Attack, ...] = ATTACKS
    start: float = field(default_factory=time.monotonic)

    def attacking(self) -> bool:
        return int((time.monotonic() - self.start) / ATTACK_PHASE_SECONDS) % 2 == 0


async def attack(target: Target, rng: random.Random, attacks: tuple[Attack, ...], report: SoakReport) -> None:
    chosen = rng.choice(attacks)
    report.attacks[chosen.name] += 1
    report.gaps.attacks_in_flight[chosen.name] += 1
    try:
        status = await chosen.send(target, rng)
    except (httpx.HTTPError, Unplanned) as exc:
        report.failures.append(f"attack {chosen.name!r}: {exc!r}")
        return
    finally:
        report.gaps.attacks_in_flight[chosen.name] -= 1
    if status not in chosen.planned:
        report.unplanned_5xx += status is not None and status >= 500
        report.failures.append(f"attack {chosen.name!r}: answered {status}, planned {sorted(map(str, chosen.planned))}")


def probe_body(prompt: str) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}


async def probe(client: httpx.AsyncClient, rng: random.Random, traffic: Traffic, report: SoakReport) -> bool:
    """An innocent greedy request: its text must be what it was alone. Returns True when asked to back off."""
    prompt = rng.choice(PROBES)
    report.requests += 1
    response = await client.post("/v1/completions", json=probe_body(prompt))
    if response.status_code != 200:
        return judge_error(response.status_code, response.json(), report, f"probe {prompt!r}")
    text = response.json()["choices"][0]["text"]
    report.probes += 1
    report.completed += 1
    if text != traffic.probe_texts[prompt]:
        report.changed_probes += 1
        report.failures.append(f"probe {prompt!r} changed: {text!r}, alone {traffic.probe_texts[prompt]!r}")
    return False


def key_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def client_loop(url: str, seed: int, deadline: float, traffic: Traffic, report: SoakReport) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=120, headers=key_headers(traffic.api_key)) as client:
        target = Target(client, MODEL, traffic.api_key)
        while time.monotonic() < deadline:
            try:
                draw = rng.random()
                hostile = draw < traffic.hostile_share  # in a quiet half-minute: an ordinary request instead
                if hostile and traffic.attacking():
                    await attack(target, rng, traffic.attacks, report)
                    back_off = False
                elif not hostile and draw < traffic.hostile_share + PROBE_SHARE and traffic.probe_texts:
                    back_off = await probe(client, rng, traffic, report)
                else:
                    back_off = await one_request(client, rng, traffic.hang_up_share, report)
                if back_off:
                    await asyncio.sleep(rng.uniform(*BACKOFF_SECONDS))
            except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
                report.failures.append(f"client {seed}: {exc!r}")


def probe_texts(url: str, api_key: str | None) -> dict[str, str]:
    """Each probe's greedy text, asked alone on the idle server."""
    with httpx.Client(base_url=url, timeout=120, headers=key_headers(api_key)) as client:
        return {p: client.post("/v1/completions", json=probe_body(p)).json()["choices"][0]["text"] for p in PROBES}


def wait_idle(engine: AsyncEngine, timeout: float = IDLE_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while engine.snapshot().num_unfinished and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.1)  # the engine thread publishes its snapshot after the last delta


def free_queue_places(engine: AsyncEngine, settle: float = 10.0) -> int:
    """How many queue places a new request could reserve now. A place comes back just after its answer is sent
    (and a body timeout's 408 may still be due): polled until it stops rising, for up to `settle` seconds."""
    deadline, best = time.monotonic() + settle, -1
    while (free := _count_free_places(engine)) > best and time.monotonic() < deadline:
        best = free
        time.sleep(0.5)
    return max(best, free)


def _count_free_places(engine: AsyncEngine) -> int:
    held = []
    with contextlib.suppress(QueueFullError):
        while (reservation := engine.reserve_place()) is not None:
            held.append(reservation)
    for reservation in held:
        reservation.release()
    return len(held)


def soak(
    url: str,
    engine: AsyncEngine,
    seconds: float,
    clients: int = 16,
    hang_up_share: float = 1 / 3,
    seed: int = 0,
    hostile_share: float = 0.0,
    api_key: str | None = None,
    attacks: tuple[Attack, ...] = ATTACKS,
) -> SoakReport:
    """Runs the traffic for `seconds` (the first fifth is warm-up), waits for the engine to settle, reports.
    `api_key`: the server's, which the clients send (an attack sends it twice)."""
    report = SoakReport(attack_kinds=[kind.name for kind in attacks])
    processes = [psutil.Process(), *([psutil.Process(engine.info.pid)] if engine.info.pid != os.getpid() else [])]
    texts, places_before = probe_texts(url, api_key), free_queue_places(engine)
    traffic = Traffic(hang_up_share, hostile_share, texts, api_key, attacks)
    start = traffic.start

    async def run() -> int:
        """Returns the RSS at the end of warm-up."""
        deadline = start + seconds
        loops = [client_loop(url, seed * 1000 + i, deadline, traffic, report) for i in range(clients)]
        tasks = [asyncio.ensure_future(loop) for loop in loops]
        await asyncio.sleep(seconds / 5)
        rss = resident_bytes(processes)
        await asyncio.gather(*tasks)
        return rss

    rss_after_warm_up = asyncio.run(run())
    report.seconds = time.monotonic() - start
    wait_idle(engine)
    snapshot = engine.snapshot()
    report.running_after = snapshot.num_unfinished
    report.kv_usage_after = snapshot.kv_cache_usage
    report.lost_blocks = engine.info.num_kv_blocks - snapshot.num_free_blocks
    report.leaked_places = places_before - free_queue_places(engine)
    report.rss_growth_mb = (resident_bytes(processes) - rss_after_warm_up) / 2**20
    return report


def resident_bytes(processes: list[psutil.Process]) -> int:
    return sum(process.memory_info().rss for process in processes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--hang-up-share", type=float, default=1 / 3)
    parser.add_argument("--hostile-share", type=float, default=0.2, help="share of requests that are attacks")
    parser.add_argument("--traffic-seed", type=int, default=0, help="the clients' random choices")
    parser.add_argument("--attacks", nargs="*", metavar="TEXT", help="only the attacks whose names hold a TEXT")
    add_engine_args(parser)
    parser.set_defaults(**MACHINE_DEFAULTS)
    args = parser.parse_args()
    engine = AsyncEngine.from_config(engine_config(args)).start()
    if not engine.wait_ready():
        sys.exit(f"the engine failed to load: {engine.unavailable_reason()}")
    try:
        with serving(engine, ServerSettings([MODEL], api_key=API_KEY)) as url:  # `pagedserve serve`'s protocol
            report = soak(
                url,
                engine,
                args.minutes * 60,
                args.clients,
                args.hang_up_share,
                args.traffic_seed,
                args.hostile_share,
                API_KEY,
                tuple(a for a in ATTACKS if not args.attacks or any(text in a.name for text in args.attacks)),
            )
    finally:
        engine.shutdown()
    print("\n".join(report.lines()))
    sys.exit(0 if report.passed() else 1)


if __name__ == "__main__":
    main()
