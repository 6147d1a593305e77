"""A model with an output gate (Qwen3-Next's options) through the engine's session steps:
per session, in padded groups, read in place by the flash kernel (its CPU reference) and
as lone steps, each gated by its own tokens' gate, answering as a recompute of the whole
sequence; decode steps in fixed shapes and decode_one decline it; gate logits past float16
saturate (the overflow bounds need not count the gate)."""

from __future__ import annotations

import torch

from mha_serve.engine import Engine, ModelSpec
from mha_serve.engine.bounds import cleared
from mha_serve.engine.graphs import StaticDecode
from mha_serve.model import AttentionConfig
from tests.engine.test_attend import PASTS, close, decode_together
from tests.engine.test_flash_decode import Spy, reference_varlen
from tests.engine.test_lone_step import paths  # noqa: F401 (a fixture)
from tests.engine_calls import req, run
from tests.helpers import suite_torch_device

GATED = ModelSpec(
    "gated",
    AttentionConfig(
        64,
        4,
        2,
        32,
        causal=True,
        rope={"theta": 100.0, "partial": 0.25},
        qk_norm={"scope": "head"},
        output_gate=True,
    ),
    seed=13,
    kv_block_size=4,
)


def gated_engine(batched: bool, flash: bool = False) -> Engine:
    engine = Engine(
        [GATED],
        device=suite_torch_device(),
        dtype=torch.float32,
        max_response_bytes=2**28,
        batched_attention=batched,
        flash_decode=False,
    )
    with torch.no_grad():  # a gate far from 1/2: a row given another's gate would show
        engine.get("gated").module.wgate.weight.mul_(8.0)
    return engine


def test_gated_steps_per_session_batched_and_in_place_equal_a_recompute():
    per_session, batched, in_place = gated_engine(False), gated_engine(True), gated_engine(True)
    spy = Spy(reference_varlen)
    in_place.sessions.flash_kernels["gated"] = spy
    want, full = decode_together(per_session, "gated", rounds=3)
    for name, engine in (("batched", batched), ("in place", in_place)):
        got, _ = decode_together(engine, "gated", rounds=3)
        for r, (g_round, w_round) in enumerate(zip(got, want, strict=True)):
            for i, (a, w) in enumerate(zip(g_round, w_round, strict=True)):
                close(a, w, f"{name} round {r} session {i} vs per session")
    assert sum(spy.rows) == 6 * 3, spy.rows
    hosted = per_session.get("gated")
    for i, x in enumerate(full):
        ref = run(per_session, hosted, req("gated", x, causal=True)).output  # (1, L, E)
        steps = torch.cat([want[r][i] for r in range(len(want))], dim=1)
        close(steps, ref[:, PASTS[i] :], f"session {i}: steps vs recompute")


def test_lone_gated_steps_equal_a_recompute(paths):  # noqa: F811 (the fixture)
    engine = gated_engine(False)
    hosted = engine.get("gated")
    assert not hosted.module.decodes_in_one
    x = torch.randn(1, 9, 64, generator=torch.Generator().manual_seed(2))
    sid = engine.sessions.create("gated", None, None).session_id
    outs = [run(engine, hosted, req("gated", x[:, :5], session_id=sid)).output]
    for t in range(5, 9):
        outs.append(run(engine, hosted, req("gated", x[:, t : t + 1], session_id=sid)).output)
    assert "alone" in paths, paths
    ref = run(engine, hosted, req("gated", x, causal=True)).output
    close(torch.cat(outs, dim=1), ref, "lone steps vs recompute")


def test_fixed_shape_decode_declines_a_gated_model():
    assert not StaticDecode.supports(GATED.attention)


def test_gate_logits_past_float16_saturate_and_the_cleared_step_answers_finite():
    """The overflow bounds leave the gate out (it is in [0, 1]): a float16 model whose gate
    logits overflow (|wgate x| past 65504) gets +-inf logits, sigmoid 1 or 0, not NaN; its
    steps, cleared by the bounds, answer what the same model computes in float32."""
    spec = ModelSpec("g16", GATED.attention, seed=3)
    engines = {
        dtype: Engine([spec], device=torch.device("cpu"), dtype=dtype, max_response_bytes=2**28)
        for dtype in (torch.float16, torch.float32)
    }
    for engine in engines.values():
        with torch.no_grad():
            engine.get("g16").module.wgate.weight.mul_(1e5)  # (rows of |w| ~ 1e4)
    half = engines[torch.float16].get("g16").module
    x = torch.randn(1, 6, 64, generator=torch.Generator().manual_seed(4))
    logits = torch.nn.functional.linear(x.half(), half.wgate.weight, half.wgate.bias)
    assert logits.isinf().any() and not logits.isnan().any()
    hosted = engines[torch.float16].get("g16")  # (the bounds clear it: no maxima are read)
    assert cleared(hosted, torch.float16, float(x.abs().max()), 0.0, 1.0) is not None
    outs = {}
    for dtype, engine in engines.items():
        hosted = engine.get("g16")
        sid = engine.sessions.create("g16", None, None).session_id
        steps = [run(engine, hosted, req("g16", x[:, :4], session_id=sid)).output]
        steps += [run(engine, hosted, req("g16", x[:, 4:6], session_id=sid)).output]
        outs[dtype] = torch.cat(steps, dim=1).float()
    assert torch.isfinite(outs[torch.float16]).all()
    close(outs[torch.float16], outs[torch.float32], "float16 vs float32", atol=2e-2)
