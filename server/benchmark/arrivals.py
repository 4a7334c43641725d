"""When each request is sent: all at once, or a gamma process (Poisson at burstiness 1) at a mean rate."""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import time
from collections.abc import AsyncIterator, Sequence
from typing import TypeVar

T = TypeVar("T")


def inter_arrival_delays(count: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds between consecutive requests; their mean is 1/request_rate whatever the burstiness.

    Gamma(shape=burstiness, scale=1/(rate*burstiness)): shape 1 is exponential (Poisson arrivals), a smaller
    shape clusters requests into bursts, a larger one spaces them more evenly.
    """
    if math.isinf(request_rate):
        return [0.0] * count
    rng = random.Random(seed)
    scale = 1.0 / (request_rate * burstiness)
    return [rng.gammavariate(burstiness, scale) for _ in range(count)]


async def paced(items: Sequence[T], delays: Sequence[float]) -> AsyncIterator[T]:
    """Yields each item at its arrival time: sleeps to absolute targets so oversleeping does not add up."""
    start = time.perf_counter()
    for item, target in zip(items, itertools.accumulate(delays)):
        wait = start + target - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        yield item
