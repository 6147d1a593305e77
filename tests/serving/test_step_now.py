"""A plain decode step that finds its lane idle runs in one call on the event loop's thread
(AsyncEngine._step_now: the claim, Engine.decode_now, the lane's count): the same replies, bit
for bit, as the same steps through the lanes' thread (inline off), counted as the lanes count
a step run inline; a busy lane queues the step as before; a step that fails keeps nothing and
leaves its session free; a frontend worker's engine (AsyncEngine.compute) takes it alike."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from prometheus_client import REGISTRY

from mha_serve.batching import Closed
from mha_serve.cache import SessionBusy
from mha_serve.engine import Engine, ModelSpec
from mha_serve.engine.threads import ComputeThreads
from mha_serve.model import AttentionConfig, MultiHeadAttention
from mha_serve.serving import AsyncEngine
from tests.engine_calls import req, torched

E = 32
SPEC = ModelSpec("m", AttentionConfig(E, 4, 2), seed=3)


def engine(dtype: torch.dtype = torch.float32) -> Engine:
    return Engine([SPEC], device=torch.device("cpu"), dtype=dtype, max_response_bytes=1 << 24)


def token(i: int, n: int = 1) -> torch.Tensor:
    return torch.randn(1, n, E, generator=torch.Generator().manual_seed(i))


class Spy:
    """Engine.decode_now's answers: True an outcome, False None (left to the lanes)."""

    def __init__(self, eng: Engine) -> None:
        self.answers: list[bool] = []
        real = eng.decode_now

        def decode_now(*args):
            outcome = real(*args)
            self.answers.append(outcome is not None)
            return outcome

        eng.decode_now = decode_now


async def steps(serving: AsyncEngine, sid: str, n: int) -> list:
    out = []
    for i in range(n):
        served = await serving.attend(
            req("", token(10 + i), session_id=sid),
            torched,
            received=time.perf_counter(),
            deadline=None,
        )
        out.append(served)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
async def test_steps_run_now_equal_the_lanes_steps_bit_for_bit_and_count_alike(dtype):
    """float32 steps, on a float32 model and on a bfloat16 one (a GPU's default: each step's
    input and output converted)."""
    now_engine, lane_engine = engine(dtype), engine(dtype)
    spy = Spy(now_engine)
    compute = ComputeThreads(1, 1)
    fast = AsyncEngine(now_engine, compute)  # inline: plain steps run now
    lanes = AsyncEngine(lane_engine, compute, inline=False)  # every step on the lane's thread
    try:
        sids = []
        for serving in (fast, lanes):
            sid = (await serving.create_session("m", None, None, "me")).session_id
            await serving.attend(
                req("m", token(1, 5), session_id=sid), torched, received=0.0, deadline=None
            )
            sids.append(sid)
        spy.answers.clear()
        mine, theirs = await steps(fast, sids[0], 6), await steps(lanes, sids[1], 6)
        assert spy.answers == [True] * 6
        for a, b in zip(mine, theirs, strict=True):
            assert torch.equal(a.reply.output, b.reply.output)
            assert a.reply.session.num_tokens == b.reply.session.num_tokens
            assert a.model == b.model == "m"
            assert a.timing.batch_size == 1 and a.timing.queue_ms >= 0 and a.timing.compute_ms > 0
            assert a.timing.total_ms >= a.timing.compute_ms
        assert [s.reply.session.num_tokens for s in mine] == list(range(6, 12))
        # counted as a step run inline: 1 (the prompt, through the lane's inline path) + 6
        assert fast.lanes["m"].fast.num_inline == 7 and lanes.lanes["m"].fast.num_inline == 0
        assert fast._answered == 7  # each let go of its session: room waiters would hear it
    finally:
        await fast.close()
        await lanes.close()
        compute.shutdown()


async def test_a_step_meeting_a_busy_lane_queues_and_a_claimed_session_refuses_as_before():
    """A stateless call holds the lane's thread: a plain step meanwhile is not run now, it
    queues and is answered after it; a session another call is stepping answers SessionBusy
    (the claim), whichever path."""
    eng = engine()
    spy = Spy(eng)
    held, gate = threading.Event(), threading.Event()
    real = eng.run_batch

    def run_batch(hosted, batch):
        if not batch[0].request.session_id:
            held.set()
            gate.wait(60)
        return real(hosted, batch)

    eng.run_batch = run_batch
    compute = ComputeThreads(1, 1)
    serving = AsyncEngine(eng, compute)
    loop = asyncio.get_running_loop()
    try:
        sid = (await serving.create_session("m", None, None, "me")).session_id
        big = token(2, 40)  # more than run inline: the lane's thread
        holder = asyncio.ensure_future(
            serving.attend(
                req("m", big.expand(3, -1, -1).contiguous()), torched, received=0.0, deadline=None
            )
        )
        assert await loop.run_in_executor(None, held.wait, 60)
        step = asyncio.ensure_future(
            serving.attend(req("m", token(3), session_id=sid), torched, received=0.0, deadline=None)
        )
        for _ in range(6000):  # bounded: until it is queued behind the held call
            if serving.lanes["m"].fast.queued_requests == 1:
                break
            await asyncio.sleep(0.005)
        assert serving.lanes["m"].fast.queued_requests == 1 and spy.answers == []
        gate.set()
        await holder
        assert (await step).reply.session.num_tokens == 1
        eng.sessions.claim(sid)  # another call's step holds it
        try:
            with pytest.raises(SessionBusy):
                await serving.attend(
                    req("", token(4), session_id=sid), torched, received=0.0, deadline=None
                )
        finally:
            eng.sessions.release(sid)
        assert (await steps(serving, sid, 1))[0].reply.session.num_tokens == 2
        assert spy.answers == [True]
    finally:
        gate.set()
        await serving.close()
        compute.shutdown()


async def test_a_failing_step_keeps_nothing_frees_its_session_and_is_counted(monkeypatch):
    eng = engine()
    compute = ComputeThreads(1, 1)
    serving = AsyncEngine(eng, compute)
    try:
        sid = (await serving.create_session("m", None, None, "me")).session_id
        await steps(serving, sid, 2)
        lane = serving.lanes["m"].fast
        inline, answered = lane.num_inline, serving._answered

        def lost(self, *args):
            raise RuntimeError("device lost")

        monkeypatch.setattr(MultiHeadAttention, "decode_one", lost)
        with pytest.raises(RuntimeError, match="device lost"):
            await steps(serving, sid, 1)
        assert (lane.num_inline, serving._answered) == (inline + 1, answered + 1)
        monkeypatch.undo()
        assert (await serving.get_session(sid, "me")).num_tokens == 2
        assert (await steps(serving, sid, 1))[0].reply.session.num_tokens == 3
    finally:
        await serving.close()
        compute.shutdown()


def _bad_steps(sid: str) -> dict:
    """Plain steps the lanes refuse, each by what it is: (request, deadline, engine kwargs)."""
    x = token(20)
    return {
        "weights dtype": (req("", x, session_id=sid, weights_dtype="int8"), None, {}),
        "response too large": (req("", x, session_id=sid), None, {"max_response_bytes": 1024}),
        "deadline passed": (req("", x, session_id=sid), 0.0, {}),
        "a NaN": (req("", torch.full_like(x, float("nan")), session_id=sid), None, {}),
        # not (1, T, E): refused by prepare's shape check, never indexed first (a 0-d input
        # was INTERNAL, IndexError, found by tests/reliability/test_fuzz.py)
        "a scalar": (req("", x[0, 0, 0], session_id=sid), None, {}),
        "one dimension": (req("", x[0, 0], session_id=sid), None, {}),
        "two dimensions": (req("", x[0], session_id=sid), None, {}),
    }


@pytest.mark.parametrize("what", list(_bad_steps("")))
async def test_a_plain_step_the_lanes_refuse_gets_their_error_whichever_path(what):
    """The same error (type and message) with steps run now as through the lanes' path
    (run inline by the lane: the same engine without the one-call step), nothing kept, the
    session free and counted once as answered."""
    errors, kept = [], []
    for now in (True, False):
        _, _, kw = _bad_steps("")[what]
        eng = Engine(
            [SPEC], device=torch.device("cpu"), dtype=torch.float32,
            max_response_bytes=kw.get("max_response_bytes", 1 << 24),
        )  # fmt: skip
        compute = ComputeThreads(1, 1)
        serving = AsyncEngine(eng, compute)
        serving._steps_now = set(serving.lanes) if now else set()
        try:
            sid = (await serving.create_session("m", None, None, "me")).session_id
            request, deadline, _ = _bad_steps(sid)[what]
            answered = serving._answered
            with pytest.raises(Exception) as refused:
                await serving.attend(request, torched, received=0.0, deadline=deadline)
            errors.append((type(refused.value), str(refused.value)))
            assert serving._answered - answered <= 1
            eng.sessions.claim(sid)  # not left busy
            eng.sessions.release(sid)
            kept.append((await serving.get_session(sid, "me")).num_tokens)
        finally:
            await serving.close()
            compute.shutdown()
    assert errors[0] == errors[1] and kept == [0, 0], (errors, kept)


async def test_a_step_after_close_is_refused_as_the_lanes_refuse_it():
    """Lanes closed (the server stopping): Closed (UNAVAILABLE), not run now."""
    eng = engine()
    spy = Spy(eng)
    compute = ComputeThreads(1, 1)
    serving = AsyncEngine(eng, compute)
    sid = (await serving.create_session("m", None, None, "me")).session_id
    await serving.close()
    try:
        with pytest.raises(Closed):
            await steps(serving, sid, 1)
        assert spy.answers == [] and eng.sessions.table.session_stats(sid).num_tokens == 0
    finally:
        compute.shutdown()


async def test_a_step_run_now_counts_its_arrival_and_its_batch_of_one():
    """The lane's arrival statistics (its wait for company) and the batch metrics see a
    step run now as they see one run inline by the lane."""
    eng = engine()
    compute = ComputeThreads(1, 1)
    serving = AsyncEngine(eng, compute)
    labels = {"model": "m", "lane": "fast"}

    def batches() -> float:
        return REGISTRY.get_sample_value("mha_serve_batch_requests_count", labels) or 0.0

    try:
        sid = (await serving.create_session("m", None, None, "me")).session_id
        await steps(serving, sid, 1)
        arrivals = serving.lanes["m"].fast.arrivals
        first, counted = arrivals.last_arrival, batches()
        assert first is not None
        await steps(serving, sid, 2)
        assert arrivals.last_arrival > first and arrivals.gap_ewma is not None
        assert batches() == counted + 2
        assert REGISTRY.get_sample_value("mha_serve_batch_size_bucket", {**labels, "le": "1.0"})
    finally:
        await serving.close()
        compute.shutdown()


async def test_a_frontend_workers_engine_runs_the_step_now_alike():
    """AsyncEngine.compute (what the engine process answers a frontend worker with) takes a
    plain step now too: the same Computed as attend's."""
    eng, other = engine(), engine()
    spy = Spy(eng)
    compute = ComputeThreads(1, 1)
    serving, ref = AsyncEngine(eng, compute), AsyncEngine(other, compute, inline=False)
    try:
        sids = [(await s.create_session("m", None, None, "me")).session_id for s in (serving, ref)]
        computed = await serving.compute(
            req("", token(5), session_id=sids[0]), received=0.0, deadline=None, caller="me"
        )
        want = await ref.compute(
            req("", token(5), session_id=sids[1]), received=0.0, deadline=None, caller="me"
        )
        assert spy.answers == [True]
        assert computed.model == want.model == "m"
        assert torch.equal(torched(computed.outcome).output, torched(want.outcome).output)
        assert computed.outcome.session.num_tokens == want.outcome.session.num_tokens == 1
    finally:
        await serving.close()
        await ref.close()
        compute.shutdown()
