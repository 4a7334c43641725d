"""What the soak (benchmarks/soak.py) counts, and how it prints and judges it."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

MAX_GAP_SECONDS = 1.0  # an innocent stream may wait this long between two chunks, whatever the attacks do


@dataclass
class Gaps:
    seconds: list[float] = field(default_factory=list)

    @property
    def largest(self) -> float:
        return max(self.seconds, default=0.0)

    def line(self) -> str:
        ordered = sorted(self.seconds)
        p99 = ordered[int(0.99 * (len(ordered) - 1))] if ordered else 0.0
        over = sum(gap >= MAX_GAP_SECONDS for gap in ordered)
        return f"largest {self.largest:.3f} s, p99 {p99:.3f} s, {over} of {len(ordered)} over {MAX_GAP_SECONDS:.0f} s"


@dataclass
class StreamGaps:
    """The waits between two token chunks of the innocent streams: while any attack was in flight, and (the
    control, from the same run: the soak pauses its attacks every other half-minute) while none was. Which
    attacks were in flight during the longest, and during each over the limit."""

    attacked: Gaps = field(default_factory=Gaps)
    quiet: Gaps = field(default_factory=Gaps)
    attacks_in_flight: Counter[str] = field(default_factory=Counter)
    during_largest: list[str] = field(default_factory=list)
    during_over_limit: Counter[str] = field(default_factory=Counter)

    def note(self, gap: float) -> None:
        in_flight = sorted(name for name, running in self.attacks_in_flight.items() if running)
        if not in_flight:
            self.quiet.seconds.append(gap)
            return
        if gap > self.attacked.largest:
            self.during_largest = in_flight
        self.attacked.seconds.append(gap)
        if gap >= MAX_GAP_SECONDS:
            self.during_over_limit.update(in_flight)

    def lines(self) -> list[str]:
        over = dict(self.during_over_limit.most_common())
        return [
            f"innocent streams' inter-chunk gap during attacks: {self.attacked.line()}",
            f"  attacks in flight at the largest: {', '.join(self.during_largest) or 'none'}",
            *([f"  attacks in flight during the gaps over the limit: {over}"] if over else []),
            f"  the same with no attack in flight (control): {self.quiet.line()}",
        ]


@dataclass
class SoakReport:
    attack_kinds: list[str] = field(default_factory=list)
    seconds: float = 0.0
    requests: int = 0
    completed: int = 0
    hung_up: int = 0
    deliberate: int = 0  # 503 queue_full / queue_timeout, 408 timeout: answers or final error events
    attacks: Counter[str] = field(default_factory=Counter)  # sent, by kind
    probes: int = 0  # innocent probes answered in full (and compared)
    changed_probes: int = 0
    unplanned_5xx: int = 0  # 5xx answers (or error events ending a stream) nobody planned
    failures: list[str] = field(default_factory=list)  # everything unplanned, the above included
    gaps: StreamGaps = field(default_factory=StreamGaps)
    running_after: int = 0
    kv_usage_after: float = 0.0
    lost_blocks: int = 0  # referenced with no request left
    leaked_places: int = 0  # queue places held with no request left
    rss_growth_mb: float = 0.0  # the API process's and the engine core's, from the end of warm-up to the end
    sandbox_children: int = 0  # grammar sandboxes' children alive at the end (a bounded pool, started on demand)
    sandbox_mb: float = 0.0  # their resident memory
    load_averages: list[float] = field(default_factory=list)  # the machine's 1-minute load, sampled during the run

    def _load_range(self) -> str:
        loads = self.load_averages
        return f"{min(loads):.2f}-{max(loads):.2f}, mean {sum(loads) / len(loads):.2f}" if loads else "not sampled"

    def passed(self) -> bool:
        clean = not (self.failures or self.lost_blocks or self.leaked_places or self.running_after)
        return clean and self.gaps.attacked.largest < MAX_GAP_SECONDS

    def lines(self) -> list[str]:
        rate = self.requests / self.seconds if self.seconds else 0.0
        unsent = [kind for kind in self.attack_kinds if not self.attacks[kind]]
        return [
            f"{self.requests} requests in {self.seconds:.0f} s ({rate:.1f}/s): {self.completed} complete, "
            f"{self.hung_up} hung up, {self.deliberate} deliberate 503/408, {sum(self.attacks.values())} attacks "
            f"({len(self.attack_kinds) - len(unsent)} of {len(self.attack_kinds)} kinds), "
            f"{self.probes} innocent probes compared",
            *([f"  attacks never sent: {', '.join(unsent)}"] if unsent else []),
            f"unplanned 5xx: {self.unplanned_5xx}",
            f"changed innocent probes: {self.changed_probes}",
            f"failures (unplanned 5xx, broken answers, attacks answered otherwise than planned, probes changed): "
            f"{len(self.failures)}",
            *(f"  {failure}" for failure in self.failures[:10]),
            *self.gaps.lines(),
            f"machine load during the run (1-minute load average, {len(self.load_averages)} samples): "
            f"{self._load_range()}",
            f"after: {self.running_after} requests unfinished, KV usage {self.kv_usage_after:.3f}, "
            f"{self.lost_blocks} lost KV blocks, {self.leaked_places} leaked queue places",
            f"RSS growth after warm-up (server + engine core): {self.rss_growth_mb:+.1f} MB",
            f"grammar sandboxes alive at the end: {self.sandbox_children} "
            f"({self.sandbox_mb:.0f} MB, not in the growth)",
            *(f"  {kind}: {self.attacks[kind]}" for kind in self.attack_kinds),
        ]
