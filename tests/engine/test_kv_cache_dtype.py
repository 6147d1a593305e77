"""kv_cache_dtype: a float32 model that stores its sessions' K/V in bfloat16 or float16.

Tolerances, against one float32 causal forward over the whole sequence (outputs of these
models reach |y| ~ 2.6, std ~ 0.1): measured max errors were 2.2e-3..3.0e-3 of max |y| for
bfloat16 and 2.6e-4..2.7e-4 for float16, so the bounds are 1e-2 and 1e-3 of max |y|.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mha_serve.config import default_models
from mha_serve.engine import AttendCall, Engine, InvalidRequest, ModelSpec
from mha_serve.model import AttentionConfig, cached

REL_TOL = {"bfloat16": 1e-2, "float16": 1e-3}  # of max |reference output|
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


@pytest.mark.parametrize("name", ["mha", "gqa", "mqa"])
def test_narrow_cache_steps_stay_within_tolerance_of_float32_recompute(narrow, name):
    """Prefill, then single-token steps past GROUPED_MIN_KEYS (both decode kernels)."""
    kv_dtype, engine = narrow
    hosted = engine.get(name)
    cache = engine.sessions.caches[name]
    assert cache.dtype == getattr(torch, kv_dtype)
    n, prefill = cached.GROUPED_MIN_KEYS + 40, cached.GROUPED_MIN_KEYS - 40
    x = seq(n, seed=3)
    sid = engine.sessions.create(name, None, None).id
    outs = [engine.run(hosted, AttendCall(name, x[:, :prefill], session_id=sid)).output]
    for t in range(prefill, n):
        r = engine.run(hosted, AttendCall(name, x[:, t : t + 1], session_id=sid))
        assert r.output.dtype == torch.float32  # the model's dtype, whatever the cache's
        outs.append(r.output)
    ref = engine.run(hosted, AttendCall(name, x, causal=True)).output
    err = (torch.cat(outs, dim=1) - ref).abs().max()
    assert err <= REL_TOL[kv_dtype] * ref.abs().max(), f"max error {err:.2e}"
    assert err > 0  # K/V really were rounded: a float32 cache is exact to ~1e-6 here
    engine.sessions.table.close(sid)


def test_narrow_cache_weights_stay_within_tolerance(narrow):
    kv_dtype, engine = narrow
    hosted = engine.get("gqa")
    x = seq(50, seed=4)
    sid = engine.sessions.create("gqa", None, None).id
    engine.run(hosted, AttendCall("gqa", x[:, :40], session_id=sid))
    step = engine.run(hosted, AttendCall("gqa", x[:, 40:], session_id=sid, need_weights=True))
    ref = engine.run(hosted, AttendCall("gqa", x, causal=True, need_weights=True))
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
    """|K| beyond 65504 is inf in float16: that step is refused, nothing of it is kept."""
    spec = ModelSpec("tiny", AttentionConfig(32, 4, 2), seed=1, kv_cache_dtype="float16")
    engine = engine_with("float16", [spec])
    hosted = engine.get("tiny")
    x = seq(12, seed=5, embed=32)
    sid = engine.sessions.create("tiny", None, None).id
    engine.run(hosted, AttendCall("tiny", x[:, :8], session_id=sid))
    with pytest.raises(InvalidRequest, match="kv_cache_dtype is float16.*overflowed"):
        engine.run(hosted, AttendCall("tiny", x[:, 8:9] * 1e7, session_id=sid))
    assert engine.sessions.table.session_stats(sid).num_tokens == 8
    steps = [
        engine.run(hosted, AttendCall("tiny", x[:, t : t + 1], session_id=sid)) for t in (8, 9)
    ]
    ref = engine.run(hosted, AttendCall("tiny", x[:, :10], causal=True)).output[:, 8:]
    got = torch.cat([s.output for s in steps], dim=1)
    assert (got - ref).abs().max() <= REL_TOL["float16"] * ref.abs().max()


def test_an_unknown_kv_cache_dtype_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, float32, float16"):
        ModelSpec("m", AttentionConfig(32, 4, 2), kv_cache_dtype="int8")
