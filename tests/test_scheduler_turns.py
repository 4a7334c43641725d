"""Whose tokens a step takes: a long prompt, however early it came, never starves the streams decoding beside it
nor a newcomer's first token (a scored 3,000-token prompt once stood 30 s of streams still, through the soak)."""

from __future__ import annotations

from pagedserve.engine.outputs import TokenLogprob, scored_positions
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.scheduling.kv_cache_manager import KVCacheManager
from pagedserve.engine.scheduling.request import Request
from pagedserve.engine.scheduling.scheduler import Scheduler, SchedulerOutput

BUDGET = 16
LONG = 400  # prompt tokens: 25 full-budget steps, 50 when scored


def scheduler(num_blocks: int = 256, max_num_seqs: int = 8) -> Scheduler:
    return Scheduler(
        KVCacheManager(num_blocks, block_size=4), max_num_seqs, BUDGET, max_model_len=1024, max_queue_len=8
    )


def request(request_id: str, num_prompt: int, **params: object) -> Request:
    return Request(request_id, list(range(1, num_prompt + 1)), SamplingParams(**params), max_tokens=100)  # type: ignore[arg-type]


def step(sched: Scheduler) -> SchedulerOutput:
    """One step, each request that computed its last known token sampling token 7."""
    out = sched.schedule()
    for item in out.scheduled:  # the prompt positions scored, filled in as the engine would
        req = item.request
        if req.params.prompt_logprobs is not None:
            window = scored_positions(
                req.num_computed_tokens, item.num_new_tokens, len(req.prompt_logprobs), req.num_prompt_tokens
            )
            req.prompt_logprobs += [TokenLogprob(0, 0.0)] * len(window)
    sched.update(out, {item.request.request_id: 7 for item in out.scheduled if item.samples})
    return out


def ids(out: SchedulerOutput) -> set[str]:
    return {item.request.request_id for item in out.scheduled}


def test_a_stream_that_starts_after_a_long_prompt_decodes_every_step_beside_it() -> None:
    """The long prompt came first: before, it took each step's whole budget until computed, and the stream
    admitted after it got no token for all those steps."""
    for params in ({}, {"prompt_logprobs": 20}):
        sched = scheduler()
        sched.add_request(request("long", LONG, **params))
        step(sched)  # the long prompt is running, partly computed
        sched.add_request(request("stream", 4))
        steps = []
        while sched.requests["long"].num_computed_tokens < LONG:
            steps.append(ids(step(sched)))
        assert len(steps) >= LONG // BUDGET - 1, params  # the long prompt took most of each step all along
        first = next((i for i, taken in enumerate(steps) if "stream" in taken), None)
        assert first is not None and first <= 1, (params, steps[:4])  # admitted at once, not after the long prompt
        assert all("stream" in taken for taken in steps[first:]), params  # then a token every step


def test_a_long_prompt_still_progresses_each_step_and_alone_takes_the_whole_budget() -> None:
    sched = scheduler()
    sched.add_request(request("long", LONG))
    alone = step(sched)
    assert alone.num_batched_tokens == BUDGET
    for i in range(3):
        sched.add_request(request(f"s{i}", 4))
    for _ in range(20):
        out = step(sched)
        assert "long" in ids(out) and out.num_batched_tokens <= BUDGET


def test_a_decode_preempted_for_an_older_prompt_gives_its_budget_back_and_leaves_the_step() -> None:
    """Decodes go first, so a prompt chunk after them may preempt one already scheduled this step (the newest
    running request is the victim): it must leave the step's batch, whose blocks it no longer has."""
    sched = scheduler(num_blocks=11, max_num_seqs=4)
    sched.add_request(request("long", 40))  # 10 of the 11 blocks once computed
    step(sched)
    sched.add_request(request("stream", 4))
    preempted = None
    for _ in range(40):
        out = sched.schedule()
        scheduled = ids(out)
        for victim in out.preempted:
            assert victim.request_id not in scheduled
            preempted = victim.request_id
        assert out.num_batched_tokens <= BUDGET
        sched.update(out, {item.request.request_id: 7 for item in out.scheduled if item.samples})
        if preempted:
            break
    assert preempted == "stream"
    assert all(block.ref_cnt >= 0 for block in sched.kv.pool.blocks)
