"""A full KV cache queues session steps whose room other calls in flight hold, instead of
refusing them (serving/async_engine.py, issue 24: "nothing refused until the spill budget is
reached"): steps batched together that each need a block the others hold all get their
answers, equal to a full causal recompute; without a spill tier (nothing could free those
blocks) the refusal stands at once."""

from __future__ import annotations

import asyncio
import threading

import torch

from mha_serve.cache import CacheExhausted, SessionNotFound
from mha_serve.engine import Engine, ModelSpec
from mha_serve.engine.threads import ComputeThreads
from mha_serve.model import AttentionConfig
from mha_serve.serving import AsyncEngine
from tests.engine_calls import req, torched

E, BLOCK = 32, 4
CONFIG = AttentionConfig(E, 4, 2)
BYTES_PER_BLOCK = 2 * 2 * 8 * BLOCK * 4  # K and V, 2 KV heads x 8 dims, float32


def engine(blocks: int, spill_dir: str = "") -> Engine:
    spec = ModelSpec(
        "m", CONFIG, seed=3, kv_block_size=BLOCK, kv_cache_bytes=blocks * BYTES_PER_BLOCK
    )
    return Engine(
        [spec],
        device=torch.device("cpu"),
        dtype=torch.float32,
        max_response_bytes=1 << 24,
        spill_dir=spill_dir,
        spill_bytes=1 << 24 if spill_dir else 0,
    )


async def batched_steps(eng: Engine, sessions: int, history: dict[str, torch.Tensor]) -> list:
    """Each session's next token, all queued behind a stateless call held on the compute
    thread, so that they form one batch; the outcomes (a reply or the exception)."""
    held, gate = threading.Event(), threading.Event()
    real = eng.run_batch

    def run_batch(hosted, batch):
        if not batch[0].request.session_id:  # the holder
            held.set()
            gate.wait(60)
        return real(hosted, batch)

    eng.run_batch = run_batch
    compute = ComputeThreads(1, 1)
    serving = AsyncEngine(eng, compute, inline=False)
    lane = serving.lanes["m"].fast
    loop = asyncio.get_running_loop()
    try:
        holder = asyncio.ensure_future(
            serving.attend(req("m", torch.zeros(1, 1, E)), torched, received=0.0, deadline=None)
        )
        assert await loop.run_in_executor(None, held.wait, 60)
        steps = []
        for i, sid in enumerate(list(history)[:sessions]):
            x = torch.randn(1, 1, E, generator=torch.Generator().manual_seed(100 + i))
            history[sid] = torch.cat([history[sid], x], dim=1)
            steps.append(
                asyncio.ensure_future(
                    serving.attend(
                        req("m", x, session_id=sid), torched, received=0.0, deadline=None
                    )
                )
            )
        for _ in range(6000):  # bounded: until all are queued behind the held one
            if lane.queued_requests == sessions:
                break
            await asyncio.sleep(0.01)
        assert lane.queued_requests == sessions
        gate.set()
        await holder
        return await asyncio.gather(*steps, return_exceptions=True)
    finally:
        gate.set()
        await serving.close()
        compute.shutdown()


def prefill(eng: Engine, n: int, tokens: int) -> dict[str, torch.Tensor]:
    history = {}
    for i in range(n):
        sid = eng.create_session("m").session_id
        x = torch.randn(1, tokens, E, generator=torch.Generator().manual_seed(i))
        eng.attend(req("m", x, session_id=sid))
        history[sid] = x
    return history


def test_steps_that_hold_each_others_room_all_get_their_answers(tmp_path):
    """4 sessions of one full block each fill a cache of 4 blocks; one batch steps each by a
    token that needs a new block: each one's room is held by the other three (in flight), so
    the batch refuses all four; they wait, try again one at a time, spilling the others,
    and every answer equals a full causal recompute."""
    eng = engine(blocks=4, spill_dir=str(tmp_path / "spill"))
    history = prefill(eng, 4, tokens=BLOCK)
    outcomes = asyncio.run(batched_steps(eng, 4, history))
    for sid, served in zip(history, outcomes, strict=True):
        assert not isinstance(served, Exception), served
        ref = torched(eng.attend(req("m", history[sid], causal=True))).output[:, -1:]
        assert (served.reply.output - ref).abs().max() < 1e-5
        assert served.reply.session.num_tokens == BLOCK + 1
    assert eng.spill_info().num_sessions >= 2  # the others made room by going to disk


def test_without_a_spill_tier_the_refusal_stands():
    """Nothing can free another session's blocks (no spill tier, no eviction): the step is
    refused at once, saying the cache is full; the other session's step is kept."""
    eng = engine(blocks=2)
    history = prefill(eng, 2, tokens=BLOCK)
    outcomes = asyncio.run(batched_steps(eng, 2, history))
    assert all(isinstance(o, CacheExhausted) for o in outcomes), outcomes
    assert "KV cache of model 'm' is full" in str(outcomes[0])
    for sid in history:  # refused steps are not kept
        assert eng.get_session(sid).num_tokens == BLOCK


def test_with_eviction_the_waiting_step_evicts_the_other_and_it_says_so():
    """With eviction instead of a spill tier (lossy by choice), two steps that each need the
    block the other holds: one waits for the other to be answered, then evicts it, the least
    recently used idle session; so one step is kept and the other session's step, once its
    turn comes, says it was evicted. Neither is refused for room."""
    spec = ModelSpec("m", CONFIG, seed=3, kv_block_size=BLOCK, kv_cache_bytes=2 * BYTES_PER_BLOCK)
    eng = Engine(
        [spec],
        device=torch.device("cpu"),
        dtype=torch.float32,
        max_response_bytes=1 << 24,
        evict_idle_sessions=True,
    )
    history = prefill(eng, 2, tokens=BLOCK)
    outcomes = asyncio.run(batched_steps(eng, 2, history))
    kept = [o for o in outcomes if not isinstance(o, Exception)]
    evicted = [o for o in outcomes if isinstance(o, SessionNotFound)]
    assert len(kept) == 1 and len(evicted) == 1, outcomes
    assert evicted[0].reason == "evicted" and "was evicted" in str(evicted[0])
    assert kept[0].reply.session.num_tokens == BLOCK + 1


def test_a_spilled_sessions_read_waits_for_room_as_a_step_does(tmp_path):
    """GetSession (a fork, a truncate alike) of a spilled session whose room only sessions
    in flight hold waits for them as a step of it would, then brings it back; it was refused
    RESOURCE_EXHAUSTED at once."""
    eng = engine(blocks=2, spill_dir=str(tmp_path / "spill"))
    (spilled,) = prefill(eng, 1, tokens=BLOCK - 1)
    assert eng.spill_idle() == [spilled]
    busy = list(prefill(eng, 2, tokens=BLOCK - 1))  # the cache's two blocks
    for sid in busy:
        eng.sessions.claim(sid)  # a step of each in flight: neither can be spilled

    assert read_waiting_for_room(eng, spilled, busy[0]) == BLOCK - 1
    assert not eng.is_spilled(spilled) and eng.is_spilled(busy[0])


def test_a_read_whose_session_is_spilled_again_before_it_runs_waits_for_room(tmp_path):
    """GetSession brings its spilled session back on the compute thread, then reads it on the
    event loop; a step of another session in between (its own restore) may send it back to
    disk. The read then waits for room as at first, and brings it back off the loop: it was
    brought back on the loop, and refused RESOURCE_EXHAUSTED at once when the room it needed
    was held by calls in flight."""
    eng = engine(blocks=2, spill_dir=str(tmp_path / "spill"))
    spilled, other = prefill(eng, 2, tokens=BLOCK - 1)
    assert sorted(eng.spill_idle()) == sorted([spilled, other])
    (busy,) = prefill(eng, 1, tokens=BLOCK - 1)
    eng.sessions.claim(busy)  # a step of it in flight: never spilled
    real = eng.restore_session
    threads: list[int] = []

    def restore(session_id, owner=None):
        threads.append(threading.get_ident())
        took = real(session_id, owner)
        if session_id == spilled and len(threads) == 1:  # then a step of `other` arrives:
            real(other)  # its restore sends `spilled` (the only idle one) back to disk
            eng.sessions.claim(other)  # and it computes
        return took

    eng.restore_session = restore

    loop_thread = threading.get_ident()
    assert read_waiting_for_room(eng, spilled, other) == BLOCK - 1
    assert len(threads) == 3 and loop_thread not in threads  # refused once, then back: off the loop
    assert not eng.is_spilled(spilled) and eng.is_spilled(other)


def read_waiting_for_room(eng: Engine, spilled: str, busy: str) -> int:
    """GetSession of `spilled` while `busy`'s step holds the room it needs: it must wait for
    room (not be refused at once); once that step is answered, its tokens."""

    async def read() -> int:
        compute = ComputeThreads(1, 1)
        serving = AsyncEngine(eng, compute, inline=False)
        try:
            task = asyncio.ensure_future(serving.get_session(spilled))
            for _ in range(6000):  # bounded: until it waits for room (or is answered)
                if serving._room_waiters or task.done():
                    break
                await asyncio.sleep(0.01)
            assert not task.done(), task.exception()  # (refused at once before)
            eng.sessions.release(busy)  # that step answered: its session may go to disk
            serving._session_answered()
            return (await asyncio.wait_for(task, 60)).num_tokens
        finally:
            await serving.close()
            compute.shutdown()

    return asyncio.run(read())
