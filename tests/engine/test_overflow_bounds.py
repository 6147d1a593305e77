"""A session step that the input bounds clear (engine/forward.py _bounded_rows) reads none
of its tensors, so each bound must hold for every tensor on the way: a step they clear
wrongly would answer NaN as OK, or keep an inf key that poisons its session."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from mha_serve.engine import AttendRequest, Engine, InvalidRequest, ModelSpec
from mha_serve.engine.bounds import cleared
from mha_serve.model import AttentionConfig
from mha_serve.model.config import QKNormConfig, RopeConfig
from mha_serve.model.overflow import (
    MARGIN,
    bound_crossed,
    output_bound,
    projected_bounds,
    score_limit,
    weight_bounds,
)
from tests.engine_calls import attend, req


def engine_of(spec: ModelSpec, dtype: torch.dtype) -> Engine:
    return Engine([spec], device=torch.device("cpu"), dtype=dtype, max_response_bytes=2**30)


def answer_is_finite_or_refused(engine: Engine, call: AttendRequest) -> None:
    try:
        result = attend(engine, call)
    except InvalidRequest:
        assert engine.sessions.table.get(call.session_id).num_tokens == 0  # nothing kept
        return
    assert torch.isfinite(result.output).all(), result.output


def test_a_huge_head_gate_on_a_float16_model_is_not_cleared_by_the_output_bound():
    """head_mask 1e5 is inf in float16: zero values times it are NaN, although the output's
    bound (||Wo||_1 * gate * max|v| = 0 for a zero input without bias) clears it."""
    spec = ModelSpec("m", AttentionConfig(32, 4, 2, bias=False), seed=1)
    engine = engine_of(spec, torch.float16)
    sid = engine.sessions.create("m", None, None).session_id
    x = torch.zeros(1, 2, 32, dtype=torch.float16)
    answer_is_finite_or_refused(engine, req("m", x, session_id=sid, head_mask=[1e5, 1.0, 1.0, 1.0]))


def test_an_input_past_a_float16_models_range_is_not_cleared():
    """A float32 input of 1e5 is inf in a float16 model, whatever its small weights make of
    the bounds on q, k and v (asked for float16 outputs: no conversion checks them)."""
    spec = ModelSpec("m", AttentionConfig(32, 4, 2, bias=False), seed=1)
    engine = engine_of(spec, torch.float16)
    with torch.no_grad():
        engine.get("m").module.wqkv.weight.mul_(1e-4)
    sid = engine.sessions.create("m", None, None).session_id
    x = torch.full((1, 2, 32), 1e5)
    call = req("m", x, session_id=sid, output_dtype=torch.float16)
    answer_is_finite_or_refused(engine, call)


def yarn_engine(attention_factor: float) -> Engine:
    rope = RopeConfig(
        type="yarn", factor=4.0, attention_factor=attention_factor,
        original_max_position_embeddings=64,
    )  # fmt: skip
    cfg = AttentionConfig(8, 1, 1, head_dim=8, bias=False, rope=rope)
    engine = engine_of(ModelSpec("r", cfg, seed=1, kv_cache_dtype="float16"), torch.float32)
    with torch.no_grad():  # k dim 0 = ||x||_2 for a constant x (the bound's tight case)
        w = torch.zeros(24, 8)
        w[0:8] = torch.eye(8) * 1e-9
        w[8] = 1 / math.sqrt(8)
        w[16:24] = torch.eye(8)
        engine.get("r").module.wqkv.weight.copy_(w)
    return engine


@pytest.mark.parametrize("attention_factor", [0.5, 1.0, 5.0])
def test_the_rotary_bound_counts_the_attention_factor(attention_factor):
    engine = yarn_engine(attention_factor)
    module = engine.get("r").module
    x = torch.full((1, 3, 8), 100.0)
    with torch.inference_mode():
        q, k, _ = module.project(x, torch.tensor([[0, 5, 17]]))
    q_b, k_b, _ = projected_bounds(100.0, 8, weight_bounds(module), rotary=True)
    assert float(q.abs().max()) <= q_b and float(k.abs().max()) <= k_b


def test_a_yarn_key_past_float16_is_refused_not_cached():
    """yarn's attention factor 5 scales cos and sin: a key of 15000 before the rotation is
    75000 after it, inf in a float16 cache. Bounded as 2 * 15000 it was kept, answered NaN
    as OK, and every later step of the session was NaN."""
    engine = yarn_engine(5.0)
    sid = engine.sessions.create("r", None, None).session_id
    x = torch.full((1, 1, 8), 15000 / math.sqrt(8))
    answer_is_finite_or_refused(engine, req("r", x, session_id=sid))
    step = attend(engine, req("r", torch.ones(1, 1, 8), session_id=sid))
    assert torch.isfinite(step.output).all()


def test_weight_bounds_follow_weights_replaced_through_data():
    """`param.data = t` (and module.to(dtype)) keeps the parameter's id and version: bounds
    kept for the old tensor would clear steps of weights 1000x larger."""
    engine = engine_of(ModelSpec("m", AttentionConfig(32, 4, 2), seed=1), torch.float32)
    module = engine.get("m").module
    before = weight_bounds(module)
    module.wqkv.weight.data = module.wqkv.weight.data * 1000
    assert weight_bounds(module).q_row == pytest.approx(before.q_row * 1000)


def test_a_tiny_step_over_large_cached_values_is_not_cleared():
    """The output averages the session's cached values, not only the step's own: a tiny
    step (its own values' bound clears the output's) over a cached value of 20000, gated
    by 8, is 160000: inf in float16. The session's bound covers its values too."""
    cfg = AttentionConfig(8, 1, 1, head_dim=8, bias=False)
    engine = engine_of(ModelSpec("m", cfg, seed=1), torch.float16)
    module = engine.get("m").module
    with torch.no_grad():  # q = k = 0 (uniform attention), v = x, output = gated heads
        w = torch.zeros(24, 8)
        w[16:24] = torch.eye(8)
        module.wqkv.weight.copy_(w)
        module.wo.weight.copy_(torch.eye(8))
    sid = engine.sessions.create("m", None, None).session_id
    x = torch.zeros(1, 1, 8, dtype=torch.float16)
    x[..., 0] = 20000
    attend(engine, req("m", x, session_id=sid, head_mask=[1.0]))
    tiny = torch.full((1, 1, 8), 1e-3, dtype=torch.float16)
    try:
        result = attend(engine, req("m", tiny, session_id=sid, head_mask=[8.0]))
    except InvalidRequest:
        assert engine.sessions.table.get(sid).num_tokens == 1  # nothing kept
        return
    assert torch.isfinite(result.output).all(), result.output


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_stateless_requests_the_bounds_clear_take_no_maxima_and_others_are_measured(
    monkeypatch, dtype
):
    """A stateless forward whose inputs the bounds clear builds no OverflowCheck (no maxima,
    no device sync); inputs they cannot clear are measured, and those that do overflow
    are refused, never answered. Both answer what the measured path answers."""
    from mha_serve.model import attention as attention_mod

    built = []
    real = attention_mod.OverflowCheck

    def counted(*args, **kwargs):
        built.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(attention_mod, "OverflowCheck", counted)
    spec = ModelSpec("m", AttentionConfig(32, 4, 2), seed=1)
    engine = engine_of(spec, dtype)
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0)).to(dtype)
    cleared = attend(engine, req("m", x, lengths=[5, 3]))
    assert built == []
    monkeypatch.setattr("mha_serve.engine.compute._proven", lambda *_: False)  # measure
    measured = attend(engine, req("m", x, lengths=[5, 3]))
    assert built == [1] and torch.equal(cleared.output, measured.output)
    monkeypatch.undo()
    huge = torch.full((1, 3, 32), 6e4 if dtype == torch.float16 else 1e20, dtype=dtype)
    with pytest.raises(InvalidRequest):
        attend(engine, req("m", huge))


def plain_cleared(hosted, cache_dtype, input_absmax, cached_absmax, gate):
    """cleared() written with the bound functions themselves (the reference)."""
    cfg = hosted.spec.attention
    wb = weight_bounds(hosted.module)
    limit = score_limit(hosted.dtype, cache_dtype) / MARGIN / cfg.score_factor
    out_limit = torch.finfo(hosted.dtype).max / MARGIN
    q_b, k_b, v_b = projected_bounds(input_absmax, cfg.embed_dim, wb, rotary=cfg.rope is not None)
    # (a norm's bound holds for a finite projection only: the projections before the norms)
    unnormed = dataclasses.replace(wb, q_norm=0.0, k_norm=0.0, v_norm=0.0)
    raw = projected_bounds(input_absmax, cfg.embed_dim, unnormed, rotary=False)
    if (wb.q_norm or wb.k_norm or wb.v_norm) and not max(raw) < out_limit:
        return None
    v_all = max(v_b, cached_absmax)
    if (
        not max(q_b, k_b, v_b) < limit
        or not max(input_absmax, gate, gate * v_all) < out_limit
        or bound_crossed(q_b, max(k_b, cached_absmax), cfg.head_dim, limit * MARGIN)
        or not output_bound(v_all, gate, wb) < out_limit
    ):
        return None
    return max(k_b, v_b)


@pytest.mark.parametrize(
    "cfg",
    [
        AttentionConfig(32, 4, 2),
        AttentionConfig(32, 4, 1, bias=False, rope=RopeConfig(), softmax_scale=2.0),
        AttentionConfig(32, 4, 2, qk_norm=QKNormConfig(), softcap=30.0),
    ],
    ids=["gqa", "rope-scaled", "qknorm-softcap"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cleared_equals_the_bounds_written_plainly_and_follows_the_weights(cfg, dtype):
    """cleared() keeps its constants per version of the weights and cache dtype: its answer
    is the plain bounds' exactly, before and after the weights change (in place, through
    .data, by module.to(dtype)), for either cache dtype, any gate and cached bound."""
    engine = engine_of(ModelSpec("m", cfg, seed=1), dtype)
    hosted = engine.get("m")
    module = hosted.module
    inputs = [0.0, 1e-3, 0.7, 3.0, 50.0, 900.0, 4e4, 1e20]

    def same_everywhere():
        for cache_dtype in (dtype, torch.bfloat16):
            for x in inputs:
                for cached in (0.0, 2.0, 1e4):
                    for gate in (1.0, 8.0):
                        want = plain_cleared(hosted, cache_dtype, x, cached, gate)
                        assert cleared(hosted, cache_dtype, x, cached, gate) == want
                        assert (
                            cleared(hosted, cache_dtype, x, cached, gate, weight_bounds(module))
                            == want
                        )

    same_everywhere()
    answers = [cleared(hosted, dtype, x, 0.0, 1.0) for x in inputs]
    with torch.no_grad():
        module.wqkv.weight.mul_(1024)  # in place
    same_everywhere()
    assert [cleared(hosted, dtype, x, 0.0, 1.0) for x in inputs] != answers
    module.wqkv.weight.data = module.wqkv.weight.data / 1024  # a new tensor under it
    same_everywhere()
    assert [cleared(hosted, dtype, x, 0.0, 1.0) for x in inputs] == answers
    module.wo.weight.data = module.wo.weight.data * 1e6
    same_everywhere()
    module.to(torch.bfloat16 if dtype == torch.float32 else torch.float32)  # its dtype
    same_everywhere()


@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_a_sink_that_is_not_finite_clears_nothing_and_no_nan_is_answered(bad):
    """A sink is a logit in its head's softmax. Finite, the bounds need nothing of it (the
    kernel subtracts each row's largest logit, the sink's included, and the weights sum to
    less than 1). +inf or NaN makes the head's every row NaN whatever the input: the bounds
    must then clear nothing, and a session step or a stateless call is refused, never
    answered NaN as OK. (Loading refuses such a checkpoint; this is the engine's own guard
    for weights changed after.)"""
    spec = ModelSpec("m", AttentionConfig(32, 4, 2, sinks=True), seed=1)
    engine = engine_of(spec, torch.float32)
    hosted = engine.get("m")
    x = torch.randn(1, 3, 32, generator=torch.Generator().manual_seed(0))
    assert cleared(hosted, torch.float32, 2.5, 0.0, 1.0) is not None
    with torch.no_grad():
        hosted.module.sinks[1] = bad
    for gate in (1.0, 0.0):
        assert cleared(hosted, torch.float32, 2.5, 0.0, gate) is None
    sid = engine.sessions.create("m", None, None).session_id
    answer_is_finite_or_refused(engine, req("m", x, session_id=sid))
    with pytest.raises(InvalidRequest):
        attend(engine, req("m", x))


def mla_engine(dtype: torch.dtype) -> Engine:
    from tests.engine.test_attend import MLA_MODEL

    return engine_of(MLA_MODEL, dtype)


def test_an_mla_merge_past_float16_is_not_cleared_by_the_output_bound():
    """Multi-head latent attention merges each head's latent output through its W_uv before
    wo: W_uv 1e5 times larger makes that merge inf in float16, although wo 1e-4 times
    smaller keeps the output's bound (||wo||_1 times the merge's) far below the limit. A
    step or a stateless call must be refused or finite, never NaN answered as OK."""
    engine = mla_engine(torch.float16)
    module = engine.get("mla").module
    mla = module.config.mla
    H, N, V = module.config.num_heads, mla.nope_dim, mla.v_head_dim
    with torch.no_grad():
        module.kv_b.weight.view(H, N + V, -1)[:, N:] *= 1e5  # (at most 2.3e4 each)
        module.wo.weight.mul_(1e-4)
    x = torch.randn(1, 3, 64, generator=torch.Generator().manual_seed(0)).half()
    sid = engine.sessions.create("mla", None, None).session_id
    answer_is_finite_or_refused(engine, req("mla", x, session_id=sid))
    with pytest.raises(InvalidRequest):
        attend(engine, req("mla", x, output_dtype=torch.float16))


def test_mla_bounds_follow_each_of_its_weights():
    """Each of MLA's weights, biases and norm gains counts in its bounds' key: 1024 times
    larger in place, or through .data, none is still cleared by the old bounds."""
    engine = mla_engine(torch.float32)
    module = engine.get("mla").module
    for name, p in module.named_parameters():
        before = weight_bounds(module).latent
        with torch.no_grad():
            p.mul_(1024)
        assert weight_bounds(module).latent != before, name
        p.data = p.data / 1024
        assert weight_bounds(module).latent == before, name


@pytest.mark.parametrize("scope", ["head", "projection"])
def test_a_qk_norm_with_eps_0_clears_nothing_and_a_zero_token_is_refused(scope):
    """With eps 0 a zero token (q and k biases 0) is normed 0 / 0 = NaN whatever the gains:
    its scores are NaN, which this CPU's fused kernel turns into zero attention, a finite
    answer that is not the layer's (transformers' is NaN). The norms then bound nothing, so
    the step is measured and refused, never answered OK."""
    spec = ModelSpec("m", AttentionConfig(32, 4, 2, qk_norm={"eps": 0.0, "scope": scope}), seed=1)
    engine = engine_of(spec, torch.float32)
    hosted = engine.get("m")
    with torch.no_grad():
        hosted.module.wqkv.bias[:48] = 0  # q's and k's; v's stay
    assert cleared(hosted, torch.float32, 0.0, 0.0, 1.0) is None
    sid = engine.sessions.create("m", None, None).session_id
    x = torch.zeros(1, 2, 32)
    with pytest.raises(InvalidRequest):
        attend(engine, req("m", x, session_id=sid))
    assert engine.sessions.table.get(sid).num_tokens == 0
    with pytest.raises(InvalidRequest):
        attend(engine, req("m", x))


def test_a_qk_norm_over_a_projection_past_float16_is_not_cleared():
    """A q/k norm bounds |k| by its gain times sqrt(head_dim) whatever the input, but only
    for a finite projection: k_proj's rows 1e3 times larger make it inf in float16 for an
    input of 100, and the norm of inf is NaN (NaN scores, which this CPU's fused kernel
    turns into zero attention). The norm's bound cleared such a step and answered NaN as
    OK; now it is measured and refused."""
    cfg = AttentionConfig(32, 4, 2, bias=False, qk_norm=QKNormConfig())
    engine = engine_of(ModelSpec("m", cfg, seed=1), torch.float16)
    hosted = engine.get("m")
    with torch.no_grad():
        hosted.module.wqkv.weight[32:48].mul_(1e3)  # k_proj's rows (H D = 32; KVH D = 16)
    assert cleared(hosted, torch.float16, 1.0, 0.0, 1.0) is not None
    assert cleared(hosted, torch.float16, 100.0, 0.0, 1.0) is None
    for x in (0.0, 1e-3, 1.0, 100.0, 4e4, 1e20):  # (the bounds written plainly agree)
        for cache_dtype in (torch.float16, torch.bfloat16):
            want = plain_cleared(hosted, cache_dtype, x, 2.0, 1.0)
            assert cleared(hosted, cache_dtype, x, 2.0, 1.0) == want
    sid = engine.sessions.create("m", None, None).session_id
    x = torch.full((1, 2, 32), 100.0, dtype=torch.float16)
    answer_is_finite_or_refused(engine, req("m", x, session_id=sid))
    with pytest.raises(InvalidRequest):
        attend(engine, req("m", x))


def test_a_value_norm_over_a_projection_past_float16_is_not_cleared():
    """A value norm bounds |v| by sqrt(head_dim) whatever the input, but only for a finite
    projection: v_proj's rows 1e3 times larger make it inf in float16 for an input of 100,
    and the norm of inf is NaN (a value kept in the cache would poison the session). Such a
    step is measured and refused, never cleared by the norm's bound."""
    cfg = AttentionConfig(32, 4, 2, bias=False, qk_norm=QKNormConfig(), v_norm=True)
    engine = engine_of(ModelSpec("m", cfg, seed=1), torch.float16)
    hosted = engine.get("m")
    with torch.no_grad():
        hosted.module.wqkv.weight[48:64].mul_(1e3)  # v_proj's rows (H D = 32; KVH D = 16)
    assert cleared(hosted, torch.float16, 1.0, 0.0, 1.0) is not None
    assert cleared(hosted, torch.float16, 100.0, 0.0, 1.0) is None
    for x in (0.0, 1e-3, 1.0, 100.0, 4e4, 1e20):  # (the bounds written plainly agree)
        for cache_dtype in (torch.float16, torch.bfloat16):
            want = plain_cleared(hosted, cache_dtype, x, 2.0, 1.0)
            assert cleared(hosted, cache_dtype, x, 2.0, 1.0) == want
    sid = engine.sessions.create("m", None, None).session_id
    x = torch.full((1, 2, 32), 100.0, dtype=torch.float16)
    answer_is_finite_or_refused(engine, req("m", x, session_id=sid))
    with pytest.raises(InvalidRequest):
        attend(engine, req("m", x))
