"""Engine.decode_now, a plain decode step prepared and run in one call (what serving runs for
a step that finds its lane idle), against the path it stands beside, run(prepare(...)): the
same output bit for bit, the same outcome and session, for every family the engine hosts;
None with nothing kept or left busy for every step it leaves to that path (which then
answers it, errors included); and the errors it raises itself keep nothing."""

from __future__ import annotations

import math

import pytest
import torch

from mha_serve.cache import SessionBusy
from mha_serve.engine import Abandoned, DeadlinePassed, Engine
from mha_serve.engine import compute as engine_compute
from mha_serve.engine.faults import DeviceOutOfMemory, out_of_memory_is_exhausted
from mha_serve.engine.graphs import StaticDecode
from mha_serve.model import MultiHeadAttention
from tests.engine.test_lone_step import LONE_MODELS, NAMES, tokens
from tests.engine_calls import State, req, run, torched
from tests.helpers import suite_torch_device


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(
        LONE_MODELS, device=suite_torch_device(), dtype=torch.float32, max_response_bytes=2**28
    )


def held(engine: Engine, sid: str) -> int:
    return engine.sessions.table.session_stats(sid).num_tokens


def now(engine: Engine, name: str, x: torch.Tensor, sid: str, state=None, **kw):
    """decode_now as serving calls it: the caller holds the session's claim."""
    state = State(claimed=True) if state is None else state
    engine.sessions.claim(sid)
    try:
        outcome = engine.decode_now(req("", x, session_id=sid, **kw), name, state)
    finally:
        engine.sessions.release(sid)
    return None if outcome is None else torched(outcome)


@pytest.mark.parametrize("name", NAMES)
def test_decode_now_equals_the_prepared_step_bit_for_bit(engine, name):
    """Session A decodes 6 tokens through decode_now, session B the same tokens through
    run(prepare(...)) (the lanes' path): the same outputs exactly, the same outcome (a
    batch of one, no weights) and session counts."""
    hosted = engine.get(name)
    x = tokens(engine, name, 14, seed=11)
    a, b = (engine.sessions.create(name, None, None).session_id for _ in range(2))
    for sid in (a, b):
        run(engine, hosted, req(name, x[:, :8], session_id=sid))
    for p in range(8, 14):
        mine = now(engine, name, x[:, p : p + 1], a)
        theirs = run(engine, hosted, req(name, x[:, p : p + 1], session_id=b))
        assert mine is not None, f"{name}: decode_now left token {p} to the lanes"
        assert torch.equal(mine.output, theirs.output), f"{name}: token {p}"
        width = hosted.spec.attention.embed_dim
        assert mine.output.dtype == theirs.output.dtype and mine.output.shape == (1, 1, width)
        assert (mine.batch_size, mine.weights, mine.weight_heads) == (1, None, [])
        assert mine.session.num_tokens == theirs.session.num_tokens == p + 1
        assert mine.session.session_id == a and mine.compute_ms > 0
    for sid in (a, b):
        engine.sessions.close(sid)


@pytest.mark.parametrize(
    ("given", "asked"),
    [
        (torch.float16, None),
        (torch.bfloat16, None),
        (torch.float32, torch.float16),
        (torch.float32, torch.bfloat16),
        (torch.bfloat16, torch.float32),
    ],
)
def test_an_input_or_output_in_another_dtype_equals_the_prepared_step(engine, given, asked):
    """A step whose input is not in the model's dtype (a GPU's bfloat16 model, float32
    steps), or that asks its output in another: converted as the lanes' lone step converts
    them, the same output bit for bit, in the dtype asked."""
    hosted = engine.get("gqa")
    x = tokens(engine, "gqa", 6, seed=17)
    a, b = (engine.sessions.create("gqa", None, None).session_id for _ in range(2))
    for sid in (a, b):
        run(engine, hosted, req("gqa", x[:, :4], session_id=sid))
    for p in (4, 5):
        token = x[:, p : p + 1].to(given)
        mine = now(engine, "gqa", token, a, output_dtype=asked)
        theirs = run(engine, hosted, req("gqa", token, session_id=b, output_dtype=asked))
        assert mine is not None, (given, asked)
        assert mine.output.dtype == theirs.output.dtype == (asked or given)
        assert torch.equal(mine.output, theirs.output), (given, asked, p)
        assert mine.session.num_tokens == theirs.session.num_tokens == p + 1
    for sid in (a, b):
        engine.sessions.close(sid)


def _others(x: torch.Tensor, other: str) -> dict:
    """Steps decode_now leaves to the lanes: (request fields, model) by what they are; other:
    a session of another model."""
    return {
        "two tokens": (dict(inputs=x[:, :2]), "gqa"),
        "weights": (dict(need_weights=True), "gqa"),
        "a head mask": (dict(head_mask=(1.0,) * 8), "gqa"),
        "lengths": (dict(lengths=(1,)), "gqa"),
        "not causal": (dict(causal=False), "gqa"),
        "a model not hosted": ({}, "nope"),
        "another model's session": ({}, "mha"),
        "a NaN": (dict(inputs=torch.full_like(x[:, :1], math.nan)), "gqa"),
        "an unknown session": (dict(session_id="no-such-session"), "gqa"),
        "a session of another model, named": (dict(session_id=other), "gqa"),
    }


def test_steps_it_does_not_take_are_left_with_nothing_kept(engine):
    """decode_now answers None, keeping nothing and leaving the session free, for any step
    but a plain one token of its model's session in its dtype: the lanes' path (prepare,
    run_steps) takes those, and refuses the bad ones with its own errors."""
    sid = engine.sessions.create("gqa", None, None).session_id
    x = tokens(engine, "gqa", 3, seed=12)
    run(engine, engine.get("gqa"), req("gqa", x[:, :1], session_id=sid))
    other = engine.sessions.create("mqa", None, None).session_id
    for what, (fields, model) in _others(x, other).items():
        inputs = fields.pop("inputs", x[:, 1:2])
        target = fields.pop("session_id", sid)
        outcome = engine.decode_now(
            req("", inputs, session_id=target, **fields), model, State(claimed=target == sid)
        )
        assert outcome is None, what
        assert held(engine, sid) == 1, what
    engine.sessions.claim(sid)  # nothing left it busy
    engine.sessions.release(sid)
    assert now(engine, "gqa", x[:, 1:2], sid).session.num_tokens == 2
    for s in (sid, other):
        engine.sessions.close(s)


def test_a_step_over_the_inline_size_bounds_that_cannot_clear_or_a_busy_session_is_left(
    engine, monkeypatch
):
    """Left to the lanes with nothing kept: a step attending to more keys than run inline
    (runs_inline's limit), one whose bounds cannot clear it (a huge finite input: the batch
    of one measures it; its reservation rolled back), one whose session another call holds
    (reserve refuses it: the lanes answer SessionBusy)."""
    sid = engine.sessions.create("gqa", None, None).session_id
    x = tokens(engine, "gqa", 4, seed=13)
    run(engine, engine.get("gqa"), req("gqa", x[:, :3], session_id=sid))
    per_key = engine.get("gqa").kv_bytes_per_key
    if engine.get("gqa").on_cpu:  # (on a GPU any step runs inline: runs_inline)
        monkeypatch.setattr(engine_compute, "INLINE_MAX_KV_BYTES", 3 * per_key)  # 3 keys
        assert now(engine, "gqa", x[:, 3:], sid) is None and held(engine, sid) == 3
    monkeypatch.setattr(engine_compute, "INLINE_MAX_KV_BYTES", 4 * per_key)  # 4: room
    assert now(engine, "gqa", x[:, 3:] * 1e17, sid) is None and held(engine, sid) == 3
    engine.sessions.claim(sid)  # another call's step holds it
    try:
        step = engine.decode_now(req("", x[:, 3:], session_id=sid), "gqa", State())
        assert step is None and held(engine, sid) == 3
        (busy,) = engine.run_batch(
            engine.get("gqa"), [engine.prepare(req("", x[:, 3:], session_id=sid))]
        )
        assert isinstance(busy, SessionBusy)
    finally:
        engine.sessions.release(sid)
    assert now(engine, "gqa", x[:, 3:], sid).session.num_tokens == 4
    engine.sessions.close(sid)


def static_engine(models) -> Engine:
    return Engine(
        models,
        device=suite_torch_device(),
        dtype=torch.float32,
        max_response_bytes=2**28,
        static_decode="eager",
    )


def test_the_static_decode_takes_every_plain_step_of_a_model_it_supports():
    """With static_decode on, plain decode steps of a model it supports are the static
    path's (engine/graphs.py): decode_now leaves them, and the engine says so (decodes_now)."""
    engine = static_engine(LONE_MODELS[:1])
    name = LONE_MODELS[0].name
    sid = engine.sessions.create(name, None, None).session_id
    x = tokens(engine, name, 2, seed=14)
    run(engine, engine.get(name), req(name, x[:, :1], session_id=sid))
    assert now(engine, name, x[:, 1:], sid) is None and held(engine, sid) == 1
    assert not engine.decodes_now(name)  # (serving does not even ask: AsyncEngine._steps_now)


UNFIXED = [m for m in LONE_MODELS if not StaticDecode.supports(m.attention)]


@pytest.mark.parametrize("spec", UNFIXED, ids=[m.name for m in UNFIXED])
def test_a_model_the_static_decode_declines_keeps_decode_now(spec):
    """With static_decode on, a model it does not support (a q/k norm, MLA) runs its plain
    steps as any step: decode_now takes them as with it off (it left every one to the
    lanes before), the same outputs bit for bit as the lanes' path, and the engine says
    so. Its lone steps take the lone-step path too (run_steps)."""
    assert UNFIXED, "LONE_MODELS has no model the static decode declines"
    engine = static_engine([spec])
    name = spec.name
    hosted = engine.get(name)
    x = tokens(engine, name, 8, seed=16)
    a, b = (engine.sessions.create(name, None, None).session_id for _ in range(2))
    for sid in (a, b):
        run(engine, hosted, req(name, x[:, :5], session_id=sid))
    assert engine.decodes_now(name)
    for p in range(5, 8):
        mine = now(engine, name, x[:, p : p + 1], a)
        theirs = run(engine, hosted, req(name, x[:, p : p + 1], session_id=b))
        assert mine is not None, f"{name}: decode_now left token {p} to the lanes"
        assert torch.equal(mine.output, theirs.output), f"{name}: token {p}"
    assert held(engine, a) == held(engine, b) == 8
    batched = []  # the batch's forward, which the lone-step path skips
    real_forward = engine.sessions._forward
    engine.sessions._forward = lambda *a, **k: batched.append(1) or real_forward(*a, **k)
    run(engine, hosted, req(name, x[:, 7:8], session_id=b))
    assert not batched, f"{name}: a lone plain step took the batch's forward"


@pytest.mark.parametrize(
    ("state", "error"),
    [
        (State(claimed=True, cancelled=True), Abandoned),
        (State(claimed=True, deadline=0.0), DeadlinePassed),
    ],
)
def test_a_step_abandoned_by_its_caller_raises_and_keeps_nothing(engine, state, error):
    sid = engine.sessions.create("mha", None, None).session_id
    x = tokens(engine, "mha", 3, seed=15)
    run(engine, engine.get("mha"), req("mha", x[:, :2], session_id=sid))
    with pytest.raises(error):
        now(engine, "mha", x[:, 2:], sid, state)
    assert held(engine, sid) == 2
    assert now(engine, "mha", x[:, 2:], sid).session.num_tokens == 3
    engine.sessions.close(sid)


def test_a_failing_forward_raises_keeps_nothing_and_out_of_memory_is_exhausted(engine, monkeypatch):
    """The forward raising (a bug, a device error): raised, the step rolled back, the
    session free; a device out-of-memory, through the wrapper serving calls it with, is
    RESOURCE_EXHAUSTED (DeviceOutOfMemory), as the lanes answer it."""
    sid = engine.sessions.create("mqa", None, None).session_id
    x = tokens(engine, "mqa", 3, seed=16)
    run(engine, engine.get("mqa"), req("mqa", x[:, :2], session_id=sid))

    def fails(error):
        def decode_one(self, *args):
            raise error

        return decode_one

    monkeypatch.setattr(MultiHeadAttention, "decode_one", fails(RuntimeError("device lost")))
    with pytest.raises(RuntimeError, match="device lost"):
        now(engine, "mqa", x[:, 2:], sid)
    assert held(engine, sid) == 2
    monkeypatch.setattr(MultiHeadAttention, "decode_one", fails(torch.OutOfMemoryError("oom")))
    guarded = out_of_memory_is_exhausted(engine.decode_now)
    engine.sessions.claim(sid)
    try:
        with pytest.raises(DeviceOutOfMemory):
            guarded(req("", x[:, 2:], session_id=sid), "mqa", State(claimed=True))
    finally:
        engine.sessions.release(sid)
    assert held(engine, sid) == 2
    monkeypatch.undo()
    assert now(engine, "mqa", x[:, 2:], sid).session.num_tokens == 3
    engine.sessions.close(sid)
