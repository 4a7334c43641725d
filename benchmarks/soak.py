"""Soak: minutes of mixed traffic with clients that hang up at random or attack, then what it left behind.

Starts `pagedserve serve` with an API key on 127.0.0.1 as a process of its own (benchmarks/soak_server.py: the
clients' work never holds the server's interpreter, nor the other way round) and runs concurrent clients against
it from this process: mostly
streaming completions and chats of random lengths, some with n=2, some with a short queue `timeout`; a share of
the requests hang up at a random point; a share are attacks (benchmarks/hostile.py), each planned to get a given
answer, sent in every other half-minute; a share are innocent probes, greedy completions whose text must equal
what they gave alone before the traffic began. It reports unplanned 5xx answers, every other failure (answers
neither complete nor a clean error, attacks answered otherwise than planned), changed probes, the innocent
streams' largest wait between two chunks while attacks were in flight (and, as a control, while none was), and
once the traffic stops, read from /metrics: lost KV blocks (referenced with nothing running), leaked queue places
(held with nothing waiting), the RSS growth after warm-up of the API process and the engine core, and the
grammar sandboxes' children alive at the end (pools started on demand: not growth). The machine's load average
is printed beside the gaps.

    python -m benchmarks.soak [--minutes 10] [--clients 16] [--hang-up-share 0.33] [--hostile-share 0.2]
                              [--server-log PATH] [any `pagedserve serve` flag]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from benchmarks.attack_kit import Attack, Target, Unplanned
from benchmarks.hostile import ATTACKS
from benchmarks.soak_report import SoakReport
from benchmarks.soak_server import Served, places_held, serve_process, wait_idle

MODEL = "soak"
API_KEY = "soak-key"
WORDS = ["the", "a", "cat", "sat", "on", "mat", "and", "then", "it", "ran", "far", "away", "to", "find", "tea"]
DELIBERATE = {"queue_full": 503, "queue_timeout": 503, "timeout": 408}  # shed load, or the client's own timeout
BACKOFF_SECONDS = (0.2, 1.0)  # after a deliberate 503 or 408, like a client honouring Retry-After
IDLE_TIMEOUT = 60.0  # seconds for the engine to settle once traffic stops
PLACES_SETTLE_SECONDS = 15.0  # a body timeout's 408 (10 s) may still be due when the traffic stops
LOAD_SAMPLE_SECONDS = 10.0
PROBES = ("The capital of France is", "Once upon a time", "def fibonacci(n):", "The three primary colors are")
PROBE_SHARE = 0.1
# Engine flags the soak defaults to, for the small shared CPU machine it runs on (any flag overrides them): a step of
# 2,048 prompt tokens takes seconds on a CPU, longer than the gap limit, and so, on a busy 2-core machine (load 5),
# does one of 64 beside a 3,000-token prompt (median 0.75 s, longest 1.25 s; 32 tokens: 0.30 s, 0.50 s), which a
# stream decoding beside it waits for; and two intra-op threads, which meet at a barrier in every layer, stall
# whenever either loses its core to other work (247 of 1,711 gaps over 1 s with two threads, 1 of 2,824 with one,
# no attacks at all).
MACHINE_DEFAULTS = {"--max-num-batched-tokens": "32", "--num-threads": "1"}
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


def soak(
    served: Served,
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
    url = served.url
    texts = probe_texts(url, api_key)
    traffic = Traffic(hang_up_share, hostile_share, texts, api_key, attacks)
    start = traffic.start

    async def run() -> int:
        """Returns the RSS at the end of warm-up."""
        deadline = start + seconds
        loops = [client_loop(url, seed * 1000 + i, deadline, traffic, report) for i in range(clients)]
        tasks = [asyncio.ensure_future(loop) for loop in loops]
        load = asyncio.ensure_future(sample_load(deadline, report))
        await asyncio.sleep(seconds / 5)
        rss = resident_bytes(served.services())
        await asyncio.gather(*tasks, load)
        return rss

    rss_after_warm_up = asyncio.run(run())
    report.seconds = time.monotonic() - start
    gauges = wait_idle(served, IDLE_TIMEOUT)
    report.running_after = int(gauges["num_requests_running"] + gauges["num_requests_waiting"])
    report.kv_usage_after = gauges["kv_cache_usage_perc"]
    report.lost_blocks = int(gauges["num_kv_blocks"] - gauges["num_free_kv_blocks"])
    report.leaked_places = places_held(served, PLACES_SETTLE_SECONDS)
    report.rss_growth_mb = (resident_bytes(served.services()) - rss_after_warm_up) / 2**20
    sandboxes = served.sandboxes()
    report.sandbox_children, report.sandbox_mb = len(sandboxes), resident_bytes(sandboxes) / 2**20
    return report


async def sample_load(deadline: float, report: SoakReport) -> None:
    """The machine's 1-minute load average every few seconds: gaps on a shared machine are read beside it."""
    while time.monotonic() < deadline:
        report.load_averages.append(os.getloadavg()[0])
        await asyncio.sleep(min(LOAD_SAMPLE_SECONDS, max(0.0, deadline - time.monotonic())))


def resident_bytes(processes: list[psutil.Process]) -> int:
    total = 0
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):  # a compile sandbox may have exited meanwhile
            total += process.memory_info().rss
    return total


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--hang-up-share", type=float, default=1 / 3)
    parser.add_argument("--hostile-share", type=float, default=0.2, help="share of requests that are attacks")
    parser.add_argument("--traffic-seed", type=int, default=0, help="the clients' random choices")
    parser.add_argument("--attacks", nargs="*", metavar="TEXT", help="only the attacks whose names hold a TEXT")
    parser.add_argument("--server-log", type=Path, help="where the server's log goes (default: a temporary file)")
    args, serve_flags = parser.parse_known_args()
    attacks = tuple(a for a in ATTACKS if not args.attacks or any(text in a.name for text in args.attacks))
    with tempfile.TemporaryDirectory() as scratch:
        log = args.server_log or Path(scratch) / "serve.log"
        print(f"load average before: {' '.join(f'{load:.2f}' for load in os.getloadavg())}", flush=True)
        with serve_process(with_machine_defaults(serve_flags), MODEL, API_KEY, log) as served:
            report = soak(
                served,
                args.minutes * 60,
                args.clients,
                args.hang_up_share,
                args.traffic_seed,
                args.hostile_share,
                API_KEY,
                attacks,
            )
    print("\n".join(report.lines()))
    sys.exit(0 if report.passed() else 1)


def with_machine_defaults(serve_flags: list[str]) -> list[str]:
    """`serve_flags` (any `pagedserve serve` flag), after the soak's defaults for the flags they do not give."""
    given = {flag.split("=", 1)[0] for flag in serve_flags if flag.startswith("--")}
    defaults = [item for flag, value in MACHINE_DEFAULTS.items() if flag not in given for item in (flag, value)]
    return [*defaults, *serve_flags]


if __name__ == "__main__":
    main()
