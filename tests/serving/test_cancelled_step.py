"""A session step cancelled while its batch computes (the client gone, or its deadline
passed) is rolled back; the session's next step, sent at once, waits for that rollback and
is answered, whichever lane each runs in (a step with weights runs in the weights lane, a
plain one in the fast lane: two threads)."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from mha_serve.engine import Engine, ModelSpec
from mha_serve.engine.threads import ComputeThreads
from mha_serve.model import AttentionConfig
from mha_serve.serving import AsyncEngine
from tests.engine_calls import req, torched

E = 32
CONFIG = AttentionConfig(E, 4, 2)


def _engine() -> Engine:
    spec = ModelSpec("m", CONFIG, seed=3, kv_block_size=4, kv_cache_bytes=1 << 20)
    cpu = torch.device("cpu")
    return Engine([spec], device=cpu, dtype=torch.float32, max_response_bytes=1 << 24)


def _x(tokens: int, seed: int) -> torch.Tensor:
    return torch.randn(1, tokens, E, generator=torch.Generator().manual_seed(seed))


def _serving_watched(eng: Engine, compute: ComputeThreads) -> tuple[AsyncEngine, asyncio.Event]:
    """An AsyncEngine over eng (never inline: every step on its lane's thread), and an
    event set when a call starts to wait for a cancelled step (_after_abandoned)."""
    serving = AsyncEngine(eng, compute, inline=False)
    entered, real_wait = asyncio.Event(), serving._after_abandoned

    async def after_abandoned(session_id: str) -> None:
        entered.set()
        await real_wait(session_id)

    serving._after_abandoned = after_abandoned
    return serving, entered


async def _cancel_then_step(
    eng: Engine, sid: str, first_weights: bool, then_weights: bool, *, cancel_next: bool = False
):
    """A step of sid (with weights or not) held on its lane's thread, cancelled there; the
    next step sent at once, then the hold let go: the next step's outcome, and whether it
    waited for the cancelled one. cancel_next: the next step is cancelled too while it
    waits, and a third one sent after the hold: its outcome."""
    held, gate = threading.Event(), threading.Event()
    real = eng.run_batch

    def run_batch(hosted, batch):
        if batch[0].request.inputs.data[0, 0, 0] == 7.0:  # the step to cancel
            held.set()
            gate.wait(60)
        return real(hosted, batch)

    eng.run_batch = run_batch
    compute = ComputeThreads(1, 1)
    serving, entered = _serving_watched(eng, compute)
    loop = asyncio.get_running_loop()
    try:
        first = _x(1, 1)
        first[0, 0, 0] = 7.0
        doomed = asyncio.ensure_future(
            serving.attend(
                req("m", first, session_id=sid, need_weights=first_weights),
                torched,
                received=0.0,
                deadline=None,
            )
        )
        assert await loop.run_in_executor(None, held.wait, 60)
        doomed.cancel()
        await asyncio.gather(doomed, return_exceptions=True)
        nxt = asyncio.ensure_future(
            serving.attend(
                req("m", _x(1, 2), session_id=sid, need_weights=then_weights),
                torched,
                received=0.0,
                deadline=None,
            )
        )
        # The hold ends once the next step waits for the cancelled one (or it failed).
        waiting = asyncio.ensure_future(entered.wait())
        await asyncio.wait({nxt, waiting}, timeout=60, return_when=asyncio.FIRST_COMPLETED)
        waiting.cancel()
        if cancel_next:
            nxt.cancel()
            await asyncio.gather(nxt, return_exceptions=True)
            gate.set()
            nxt = serving.attend(
                req("m", _x(1, 2), session_id=sid), torched, received=0.0, deadline=None
            )
        gate.set()
        return await asyncio.wait_for(nxt, 60), entered.is_set()
    finally:
        gate.set()
        await serving.close()
        compute.shutdown()


@pytest.mark.parametrize(
    ("first_weights", "then_weights"), [(True, False), (False, True), (False, False)]
)
def test_the_next_step_after_a_cancelled_one_is_answered_in_either_lane(
    first_weights, then_weights
):
    """A cancelled step with weights, then a plain step: the plain one (the fast lane's
    thread) found the weights lane's step still reserved and was refused ABORTED ("another
    step in flight"), though its client had cancelled that one. Now it waits for the
    rollback; the answer equals a recompute of the history without the cancelled token."""
    eng = _engine()
    sid = eng.create_session("m").session_id
    prompt = _x(3, 0)
    eng.attend(req("m", prompt, session_id=sid))
    served, waited = asyncio.run(_cancel_then_step(eng, sid, first_weights, then_weights))
    assert waited  # the next step came while the cancelled one computed
    assert served.reply.session.num_tokens == 4
    history = torch.cat([prompt, _x(1, 2)], dim=1)
    ref = torched(eng.attend(req("m", history, causal=True))).output[:, -1:]
    assert (served.reply.output - ref).abs().max() < 1e-5


def test_a_step_cancelled_while_it_waits_for_a_cancelled_one_lets_the_session_go():
    """The waiting step is cancelled too (its deadline): it let go of the session's claim,
    so the step after it is answered (it once kept the claim: every later step ABORTED)."""
    eng = _engine()
    sid = eng.create_session("m").session_id
    prompt = _x(3, 0)
    eng.attend(req("m", prompt, session_id=sid))
    served, waited = asyncio.run(_cancel_then_step(eng, sid, True, False, cancel_next=True))
    assert waited and served.reply.session.num_tokens == 4
    history = torch.cat([prompt, _x(1, 2)], dim=1)
    ref = torched(eng.attend(req("m", history, causal=True))).output[:, -1:]
    assert (served.reply.output - ref).abs().max() < 1e-5


async def _cancel_then_truncate(eng: Engine, sid: str, num_tokens: int):
    """A prompt chunk of sid held on its lane's thread after it reserved its room (the
    session then has a step pending), cancelled there (its deadline passed), and a
    TruncateSession sent at once: the truncate's outcome (raised if refused) and whether it
    waited for the cancelled step."""
    held, gate = threading.Event(), threading.Event()
    real = eng.sessions._step_reserved

    def step_reserved(hosted, request, inputs, *rest):
        if inputs[0, 0, 0] == 7.0:  # the step to cancel: reserved, not yet computed
            held.set()
            gate.wait(60)
        return real(hosted, request, inputs, *rest)

    eng.sessions._step_reserved = step_reserved
    compute = ComputeThreads(1, 1)
    serving, entered = _serving_watched(eng, compute)
    loop = asyncio.get_running_loop()
    try:
        chunk = _x(2, 1)
        chunk[0, 0, 0] = 7.0
        doomed = asyncio.ensure_future(
            serving.attend(req("m", chunk, session_id=sid), torched, received=0.0, deadline=None)
        )
        assert await loop.run_in_executor(None, held.wait, 60)
        doomed.cancel()
        await asyncio.gather(doomed, return_exceptions=True)
        truncate = asyncio.ensure_future(serving.truncate_session(sid, num_tokens))
        # The hold ends once the truncate waits for the cancelled step (or it failed).
        waiting = asyncio.ensure_future(entered.wait())
        await asyncio.wait({truncate, waiting}, timeout=60, return_when=asyncio.FIRST_COMPLETED)
        waiting.cancel()
        gate.set()
        return await asyncio.wait_for(truncate, 60), entered.is_set()
    finally:
        gate.set()
        await serving.close()
        compute.shutdown()


def test_a_truncate_sent_after_a_cancelled_step_waits_for_its_rollback():
    """A step whose deadline passed while it computed (its room reserved), then a
    TruncateSession at once: it was refused ABORTED ("has a step in flight; truncate it once
    the step is answered"), though that step had been answered DEADLINE_EXCEEDED (seen by
    the fuzz). Now the truncate waits for the rollback, as a step does; the session then
    holds the kept prefix and steps on from it exactly."""
    eng = _engine()
    sid = eng.create_session("m").session_id
    prompt = _x(3, 0)
    eng.attend(req("m", prompt, session_id=sid))
    stats, waited = asyncio.run(_cancel_then_truncate(eng, sid, 2))
    assert waited  # the truncate came while the cancelled step computed
    assert stats.num_tokens == 2
    served = torched(eng.attend(req("m", _x(1, 2), session_id=sid)))
    assert served.session.num_tokens == 3
    history = torch.cat([prompt[:, :2], _x(1, 2)], dim=1)
    ref = torched(eng.attend(req("m", history, causal=True))).output[:, -1:]
    assert (served.output - ref).abs().max() < 1e-5
