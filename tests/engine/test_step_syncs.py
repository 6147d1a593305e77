"""A decode step's host work does not grow with its batch: no op that waits for the device
(nonzero, boolean indexing, .item()) and no host-built tensor per session, and a batched
step's torch ops about constant in its number of sessions. On a GPU a step's cost is its
host work (every op a launch, every read a stall), so these counts are its cost there; they
are counted on the CPU under torch.profiler, where the same Python runs the same ops."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from mha_serve.engine import Engine, ModelSpec
from mha_serve.model import AttentionConfig
from tests.engine_calls import req

# Ops that make the host wait for the device on CUDA: nonzero (and boolean indexing, which
# runs it: aten::index with a mask), a scalar read back (.item(), int(t), `if t:`).
SYNC_OPS = ("aten::nonzero", "aten::index", "aten::item", "aten::_local_scalar_dense")
# A tensor built from Python data (torch.tensor): on CUDA each is one host-to-device copy.
HOST_BUILT = "aten::lift_fresh"
# A batched step's torch ops may grow by at most this many per added session. 0 today: a
# step's per-session work is host lists and numpy views; one torch op per session (a slice
# is two aten ops with its as_strided) breaks it.
MAX_OPS_PER_SESSION = 0.5
CONTEXT = 24

SPEC = ModelSpec(
    "small", AttentionConfig(64, 4, 2), seed=1, kv_cache_bytes=1 << 22, kv_block_size=8
)


def step_ops(n: int, *, batched: bool, dtype: torch.dtype, ragged: bool = False):
    """aten op counts of one decode step (run_batch, after prepare) of n sessions."""
    engine = Engine(
        [SPEC],
        device=torch.device("cpu"),
        dtype=dtype,
        max_response_bytes=2**26,
        batched_attention=batched,
    )
    hosted = engine.get("small")
    g = torch.Generator().manual_seed(0)
    ids = []
    for i in range(n):
        sid = engine.create_session("small").session_id
        past = CONTEXT + (i % 3 if ragged else 0)
        engine.attend(req("small", torch.randn(1, past, 64, generator=g), session_id=sid))
        ids.append(sid)
    token = torch.randn(1, 1, 64, generator=g)

    def prepared():
        return [engine.prepare(req("small", token, session_id=s)) for s in ids]

    engine.run_batch(hosted, prepared())  # warm
    calls = prepared()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        outcomes = engine.run_batch(hosted, calls)
    assert all(o.batch_size == n and o.session.num_tokens > CONTEXT for o in outcomes)
    return collections.Counter(e.name for e in prof.events() if e.name.startswith("aten::"))


def syncs(ops: collections.Counter) -> dict[str, int]:
    return {name: ops[name] for name in SYNC_OPS if ops[name]}


@pytest.mark.parametrize("ragged", [False, True], ids=["equal", "ragged"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_step_host_work_is_constant_in_sessions(dtype, ragged):
    """4 and 16 sessions attend in one padded group (ragged: unequal lengths, a mask): no
    sync-implying op, the same host-built tensors (the write's and the gather's index,
    the mask's lengths), and at most MAX_OPS_PER_SESSION more ops per session. bfloat16
    outputs sent as float32 (a widening conversion) included."""
    few, many = (step_ops(n, batched=True, dtype=dtype, ragged=ragged) for n in (4, 16))
    assert syncs(few) == syncs(many) == {}
    assert few[HOST_BUILT] == many[HOST_BUILT] <= 3, (few[HOST_BUILT], many[HOST_BUILT])
    total_few, total_many = sum(few.values()), sum(many.values())
    grown = {k: many[k] - few[k] for k in many if many[k] != few[k]}
    assert total_many - total_few <= MAX_OPS_PER_SESSION * 12, grown


def test_per_session_step_has_no_sync_op():
    """The per-session path (one kernel per session) runs per-session ops by design, but
    none that waits for the device, and no host-built tensor per session."""
    few, many = (step_ops(n, batched=False, dtype=torch.float32) for n in (4, 16))
    assert syncs(few) == syncs(many) == {}
    assert few[HOST_BUILT] == many[HOST_BUILT] <= 1


def test_lone_step_builds_no_host_tensor():
    """A lone decode step: its K/V written by slice copies, read in place, no index data."""
    ops = step_ops(1, batched=False, dtype=torch.float32)
    assert syncs(ops) == {} and ops[HOST_BUILT] == 0, ops
