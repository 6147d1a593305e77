"""Batched against unbatched: run_batch over mixed calls equals each call run alone."""

from __future__ import annotations

import pytest
import torch

from mha_serve.config import default_models
from mha_serve.engine import Engine
from mha_serve.engine.types import output_dtype
from tests.engine_calls import req, run, run_batch
from tests.helpers import suite_torch_device

ATOL = 1e-5  # float32: a padded, masked batch vs each call alone


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(
        default_models(), device=suite_torch_device(), dtype=torch.float32, max_response_bytes=2**28
    )


def rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", ["mha", "gqa", "mqa"])
@pytest.mark.parametrize("causal", [False, True])
def test_mixed_lengths_batch_equals_calls_alone(engine, name, causal):
    hosted = engine.get(name)
    calls = [
        req(name, rand(1, 16, 512, seed=1), causal=causal),
        req(name, rand(3, 5, 512, seed=2), causal=causal, lengths=[5, 2, 4]),
        req(name, rand(2, 9, 512, seed=3).half(), causal=causal, lengths=[9, 9]),
        req(name, rand(1, 1, 512, seed=4), causal=causal, output_dtype=torch.bfloat16),
    ]
    keys = {engine.batch_key(hosted, c) for c in calls}
    assert len(keys) == 1
    batched = run_batch(engine, hosted, calls)
    for call, got in zip(calls, batched, strict=True):
        alone = run(engine, hosted, call)
        assert got.output.shape == call.inputs.shape and got.output.dtype == alone.output.dtype
        diff = (got.output.float() - alone.output.float()).abs()
        tol = ATOL if alone.output.dtype == torch.float32 else 1e-2
        assert diff.max() <= tol, f"max {diff.max():.2e} mean {diff.mean():.2e}"
        assert got.batch_size == 7


@pytest.mark.parametrize(
    "dtypes",
    [
        [torch.float16] * 3,  # one dtype for all: the batch converted once, then copied
        [torch.float16, torch.float32, torch.bfloat16],  # each step's slice converted
    ],
    ids=["one-dtype", "mixed"],
)
def test_batch_output_reaches_each_caller_in_its_dtype(engine, dtypes):
    """A batch's output reaches the host in one copy (engine.types.on_host): stateless calls
    and session steps, in one dtype or several, each equal to the same call run alone."""
    hosted = engine.get("gqa")
    calls = [req("gqa", rand(1, 6, 512, seed=10 + i), output_dtype=d) for i, d in enumerate(dtypes)]
    for call, got in zip(calls, run_batch(engine, hosted, calls), strict=True):
        alone = run(engine, hosted, call)
        assert got.output.dtype == alone.output.dtype == output_dtype(call)
        assert (got.output.float() - alone.output.float()).abs().max() <= 1e-2
    twins = []  # (batched session, the same session stepped alone)
    for i in range(len(dtypes)):
        pair = [engine.create_session("gqa").session_id for _ in range(2)]
        for sid in pair:
            run(engine, hosted, req("gqa", rand(1, 20 + i, 512, seed=20 + i), session_id=sid))
        twins.append(pair)
    steps = [rand(1, 1, 512, seed=30 + i) for i in range(len(dtypes))]
    calls = [
        req("gqa", x, session_id=a, output_dtype=d)
        for x, (a, _), d in zip(steps, twins, dtypes, strict=True)
    ]
    batched = run_batch(engine, hosted, calls)
    for x, (_, b), d, got in zip(steps, twins, dtypes, batched, strict=True):
        alone = run(engine, hosted, req("gqa", x, session_id=b, output_dtype=d))
        assert got.output.dtype == alone.output.dtype == d and got.batch_size == len(dtypes)
        assert (got.output.float() - alone.output.float()).abs().max() <= 1e-2
    for pair in twins:
        for sid in pair:
            engine.close_session(sid)


def test_batch_key_separates_masking_and_head_gates(engine):
    hosted = engine.get("gqa")
    x = rand(1, 3, 512, seed=5)
    base = engine.batch_key(hosted, req("gqa", x))
    assert base == engine.batch_key(hosted, req("gqa", x, causal=False))  # the default
    assert base != engine.batch_key(hosted, req("gqa", x, causal=True))
    assert base != engine.batch_key(hosted, req("gqa", x, head_mask=[1.0] * 8))


def test_shared_head_mask_applies_to_every_call(engine):
    hosted = engine.get("mha")
    mask = [1.0, 0.0] * 4
    calls = [req("mha", rand(1, n, 512, seed=n), head_mask=mask) for n in (3, 8)]
    for call, got in zip(calls, run_batch(engine, hosted, calls), strict=True):
        torch.testing.assert_close(got.output, run(engine, hosted, call).output, atol=ATOL, rtol=0)


@pytest.mark.parametrize("session", [False, True])
def test_calls_of_several_keys_are_not_one_batch(engine, session):
    """run_batch applies its first call's masking and head gates to every call: calls of
    another key in the same batch (the batcher never makes one) would get them, a wrong
    answer; they are refused instead."""
    hosted = engine.get("mha")
    sid = [engine.create_session("mha").session_id for _ in range(2)] if session else [None] * 2
    masks = ([1.0, 0.0] * 4, None)
    calls = [
        req("mha", rand(1, 2, 512, seed=i), head_mask=m, session_id=s)
        for i, (m, s) in enumerate(zip(masks, sid, strict=True))
    ]
    with pytest.raises(ValueError, match="one batch key"):
        run_batch(engine, hosted, calls)
    for s in sid:
        if s is not None:  # nothing kept
            assert engine.get_session(s).num_tokens == 0
            engine.close_session(s)


def test_what_runs_inline_on_the_cpu_and_on_a_device(engine):
    """A lone small request runs on the event loop's thread when its lane is idle: on the
    CPU only while the keys it reads are few (the forward is the loop's own work); on a
    device at any context (the loop only launches the kernels). Weights and many new tokens
    never run inline."""
    import dataclasses

    hosted = engine.get("mha")
    sid = engine.create_session("mha").session_id
    run(engine, hosted, req("mha", rand(1, 4096, 512, seed=1), session_id=sid))  # 8 MiB of K/V
    long_step = engine.prepare(req("", rand(1, 1, 512, seed=2), session_id=sid))
    short = engine.prepare(req("mha", rand(1, 16, 512, seed=3)))
    weights = engine.prepare(req("mha", rand(1, 4, 512, seed=4), need_weights=True))
    many = engine.prepare(req("mha", rand(2, 16, 512, seed=5)))
    on_device = dataclasses.replace(hosted, device=torch.device("cuda"))  # (the rule only)
    if hosted.device.type == "cpu":
        assert [Engine.runs_inline(p) for p in (long_step, short, weights, many)] == [
            False,
            True,
            False,
            False,
        ]
    moved = [dataclasses.replace(p, hosted=on_device) for p in (long_step, short, weights, many)]
    assert [Engine.runs_inline(p) for p in moved] == [True, True, False, False]
    engine.close_session(sid)
