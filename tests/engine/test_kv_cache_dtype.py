"""kv_cache_dtype: a float32 model that stores its sessions' K/V in bfloat16 or float16.

Tolerances, against one float32 causal forward over the whole sequence (outputs of these
models reach |y| ~ 2.6, std ~ 0.1): measured max errors were 2.2e-3..3.0e-3 of max |y| for
bfloat16 and 2.6e-4..2.7e-4 for float16, so the bounds are 1e-2 and 1e-3 of max |y|. The
error grows with the size of the attention scores (a key's rounding error is multiplied by
the query): with queries 8x larger it measured 7.1e-3..1.8e-2 and 8.3e-4..2.0e-3, bounded
by 3e-2 and 3e-3 below.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mha_serve.config import default_models
from mha_serve.engine import Engine, InvalidRequest, ModelSpec
from mha_serve.model import AttentionConfig
from tests.engine_calls import req, run, run_batch

REL_TOL = {"bfloat16": 1e-2, "float16": 1e-3}  # of max |reference output|
PEAKY_REL_TOL = {"bfloat16": 3e-2, "float16": 3e-3}  # the same, with queries 8x larger
WEIGHTS_ATOL = {"bfloat16": 1e-2, "float16": 1e-3}  # weights lie in [0, 1]


def engine_with(kv_cache_dtype: str, specs: list[ModelSpec] | None = None) -> Engine:
    specs = [
        dataclasses.replace(s, kv_cache_dtype=kv_cache_dtype) for s in specs or default_models()
    ]
    return Engine(specs, device=torch.device("cpu"), dtype=torch.float32, max_response_bytes=2**30)


@pytest.fixture(scope="module", params=["bfloat16", "float16"])
def narrow(request) -> tuple[str, Engine]:
    return request.param, engine_with(request.param)


def seq(n: int, seed: int, embed: int = 512) -> torch.Tensor:
    return torch.randn(1, n, embed, generator=torch.Generator().manual_seed(seed))


def decode_error(engine: Engine, name: str) -> float:
    """Max |steps - float32 recompute| / max |recompute|: a prefill, then single-token
    steps from 984 to 1063 keys."""
    hosted = engine.get(name)
    n, prefill = 1064, 984
    x = seq(n, seed=3)
    sid = engine.sessions.create(name, None, None).session_id
    outs = [run(engine, hosted, req(name, x[:, :prefill], session_id=sid)).output]
    for t in range(prefill, n):
        r = run(engine, hosted, req(name, x[:, t : t + 1], session_id=sid))
        assert r.output.dtype == torch.float32  # the model's dtype, whatever the cache's
        outs.append(r.output)
    ref = run(engine, hosted, req(name, x, causal=True)).output
    engine.sessions.table.close(sid)
    return float((torch.cat(outs, dim=1) - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("name", ["mha", "gqa", "mqa"])
def test_narrow_cache_steps_stay_within_tolerance_of_float32_recompute(narrow, name):
    kv_dtype, engine = narrow
    assert engine.sessions.caches[name].dtype == getattr(torch, kv_dtype)
    err = decode_error(engine, name)
    assert 0 < err <= REL_TOL[kv_dtype], f"max error {err:.2e} of max |y|"  # > 0: rounded


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", ["mha", "gqa", "mqa"])
def test_narrow_cache_error_with_sharper_attention(kv_dtype, name):
    """Queries 8x larger: sharper softmax, larger scores, so the keys' rounding costs more."""
    engine = engine_with(kv_dtype, [s for s in default_models() if s.name == name])
    embed = engine.get(name).spec.attention.embed_dim
    with torch.no_grad():
        engine.get(name).module.wqkv.weight[:embed] *= 8  # the query rows
    err = decode_error(engine, name)
    assert err <= PEAKY_REL_TOL[kv_dtype], f"max error {err:.2e} of max |y|"


def test_narrow_cache_weights_stay_within_tolerance(narrow):
    kv_dtype, engine = narrow
    hosted = engine.get("gqa")
    x = seq(50, seed=4)
    sid = engine.sessions.create("gqa", None, None).session_id
    run(engine, hosted, req("gqa", x[:, :40], session_id=sid))
    step = run(engine, hosted, req("gqa", x[:, 40:], session_id=sid, need_weights=True))
    ref = run(engine, hosted, req("gqa", x, causal=True, need_weights=True))
    assert step.weights.dtype == torch.float32 and step.weights.shape == (1, 8, 10, 50)
    err = (step.weights - ref.weights[:, :, 40:]).abs().max()
    assert err <= WEIGHTS_ATOL[kv_dtype], f"weights max error {err:.2e}"
    assert torch.allclose(step.weights.sum(-1), torch.ones(1, 8, 10), atol=1e-5)
    engine.sessions.table.close(sid)


def test_a_narrow_cache_holds_twice_the_tokens_of_the_same_budget():
    wide = engine_with("auto").sessions.caches
    for kv_dtype in ("bfloat16", "float16"):
        narrow = engine_with(kv_dtype).sessions.caches
        for name in ("mha", "gqa", "mqa"):
            assert wide[name].dtype == torch.float32
            assert narrow[name].bytes_per_token * 2 == wide[name].bytes_per_token
            assert narrow[name].num_blocks == 2 * wide[name].num_blocks
            assert narrow[name].nbytes <= narrow[name].budget_bytes


def test_float16_overflow_fails_the_step_and_keeps_the_session():
    """|x| beyond 65504 is inf in float16: a step whose keys or values overflow is refused
    with that reason and nothing of it is kept, while the other step of its batch goes on.
    (The K/V are checked themselves: an inf key that only makes a score -inf leaves that
    step's output finite, yet would poison every later step of the session.)"""
    engine = engine_with("float16", [ModelSpec("tiny", AttentionConfig(32, 4, 2), seed=1)])
    hosted = engine.get("tiny")
    with torch.no_grad():  # only the keys grow large: queries and values stay as they were
        hosted.module.wqkv.weight[32:48] *= 1e6
    x = seq(12, seed=5, embed=32)
    ok, bad = (engine.sessions.create("tiny", None, None).session_id for _ in range(2))
    run(engine, hosted, req("tiny", x[:, :8] * 1e-6, session_id=ok))
    run(engine, hosted, req("tiny", x[:, :8] * 1e-6, session_id=bad))
    calls = [
        req("tiny", x[:, 8:9] * 1e-6, session_id=ok),
        req("tiny", x[:, 8:9], session_id=bad),  # keys ~1e6: inf in float16
    ]
    with torch.inference_mode():
        q, k, _ = hosted.module.project(x[:, 8:9])
        assert torch.isfinite(q.half()).all() and not torch.isfinite(k.half()).all()
    kept, refused = run_batch(engine, hosted, calls)
    assert not isinstance(kept, Exception) and kept.session.num_tokens == 9
    assert isinstance(refused, InvalidRequest)
    assert "keys or values overflowed to inf/NaN in the KV cache's float16" in str(refused)
    assert engine.sessions.table.session_stats(bad).num_tokens == 8  # nothing of it kept
    step = run(engine, hosted, req("tiny", x[:, 8:9] * 1e-6, session_id=bad))
    assert step.session.num_tokens == 9 and torch.isfinite(step.output).all()


def test_a_float16_models_own_cache_refuses_an_inf_key_too():
    """kv_cache_dtype auto on a float16 model: its K/V are float16 as computed. A key that
    overflows to inf where the query makes its score -inf leaves the step's output finite;
    kept, it would make every later step of the session fail. It is refused instead."""
    spec = ModelSpec("tiny16", AttentionConfig(32, 4, 2), seed=1)  # q rows 0-31, k rows 32-47
    engine = Engine(
        [spec], device=torch.device("cpu"), dtype=torch.float16, max_response_bytes=2**30
    )
    hosted = engine.get("tiny16")
    assert engine.sessions.caches["tiny16"].dtype == torch.float16
    with torch.no_grad():  # feature 0 drives query dim 0 down and key dim 0 hugely up
        w = hosted.module.wqkv.weight
        w[:, 0] = 0
        w[0, 0], w[32, 0] = -1.0, 60000.0
        if hosted.module.wqkv.bias is not None:
            hosted.module.wqkv.bias[[0, 32]] = 0
    x = seq(12, seed=6, embed=32).half()
    x[..., 0] = 0
    sid = engine.sessions.create("tiny16", None, None).session_id
    run(engine, hosted, req("tiny16", x[:, :4], session_id=sid))
    poison = x[:, 4:5].clone()
    poison[..., 0] = 2.0  # key dim 0: 120000, inf in float16; query dim 0: -2, score -inf
    with pytest.raises(InvalidRequest, match="overflowed to inf/NaN in the KV cache's float16"):
        run(engine, hosted, req("tiny16", poison, session_id=sid))
    assert engine.sessions.table.session_stats(sid).num_tokens == 4  # nothing of it kept
    for t in range(5, 12):  # later steps (queries of either sign) still work
        step = run(engine, hosted, req("tiny16", x[:, t : t + 1], session_id=sid))
        assert torch.isfinite(step.output).all()
    assert step.session.num_tokens == 11


def test_a_cache_dtype_not_narrower_than_the_model_is_refused():
    """A bfloat16 model (CUDA's default) gains nothing from a float32 or float16 cache."""
    for kv_dtype in ("float32", "float16"):
        specs = [ModelSpec("m", AttentionConfig(32, 4, 2), kv_cache_dtype=kv_dtype)]
        with pytest.raises(ValueError, match=f"kv_cache_dtype {kv_dtype} is not narrower"):
            Engine(
                specs, device=torch.device("cpu"), dtype=torch.bfloat16, max_response_bytes=2**20
            )
    specs = [ModelSpec("m", AttentionConfig(32, 4, 2), kv_cache_dtype="bfloat16")]
    engine = Engine(
        specs, device=torch.device("cpu"), dtype=torch.bfloat16, max_response_bytes=2**20
    )
    assert engine.sessions.caches["m"].dtype == torch.bfloat16  # the model's own: exact


def test_an_unknown_kv_cache_dtype_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, float32, float16"):
        ModelSpec("m", AttentionConfig(32, 4, 2), kv_cache_dtype="int8")
