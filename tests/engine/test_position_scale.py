"""A model whose queries are scaled by position (QueryScaleConfig) in the engine: the bounds
that clear a step unmeasured take the scale at the largest position the model serves; a
chunked layer (Llama 4's) is served up to its chunk. Paths against each other:
tests/engine/test_attend.py and test_lone_step.py's POSITION_MODELS."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mha_serve.engine import InvalidRequest, ModelSpec
from mha_serve.engine.bounds import cleared
from mha_serve.model import AttentionConfig
from mha_serve.model.config import QueryScaleConfig
from tests.engine.test_overflow_bounds import answer_is_finite_or_refused, engine_of
from tests.engine_calls import attend, req


def test_a_scaled_models_bound_takes_its_largest_position():
    """The bounds that clear a session step without measuring it take the scale at
    max_seq_len - 1 (it grows with the position): an input that clears the unscaled model
    does not clear one whose scale there is large, and its steps answer finite or are
    refused, never inf as OK."""
    qs = QueryScaleConfig(2000.0, 1)  # at 4095: 1 + 2000 log(4096), about 16600
    config = AttentionConfig(32, 4, 2, bias=False, causal=True, query_scale=qs)
    plain = ModelSpec("m", dataclasses.replace(config, query_scale=None), seed=1)
    scaled = ModelSpec("m", config, seed=1)
    engines = {name: engine_of(spec, torch.float16) for name, spec in (("p", plain), ("s", scaled))}
    assert qs.factor(4095) > 16_000
    x_absmax = 3.0
    assert cleared(engines["p"].get("m"), torch.float16, x_absmax, 0.0, 1.0) is not None
    assert cleared(engines["s"].get("m"), torch.float16, x_absmax, 0.0, 1.0) is None
    engine = engines["s"]
    sid = engine.sessions.create("m", None, None).session_id
    x = torch.rand(1, 40, 32, generator=torch.Generator().manual_seed(5)) * x_absmax
    answer_is_finite_or_refused(engine, req("m", x.half(), session_id=sid))


def test_a_chunked_layer_is_served_up_to_its_chunk():
    """Chunked attention equals causal attention up to one chunk: a model longer than
    that is refused at start, naming the chunk; within it, a request past the chunk is
    refused naming it too, and one that fits serves."""
    config = AttentionConfig(32, 4, 2, causal=True, chunk_size=64)
    with pytest.raises(ValueError, match="past the layer's attention_chunk_size 64"):
        ModelSpec("m", config, max_seq_len=65)
    engine = engine_of(ModelSpec("m", config, max_seq_len=64), torch.float32)
    with pytest.raises(InvalidRequest, match=r"max_seq_len 64 \(its attention_chunk_size is 64\)"):
        attend(engine, req("m", torch.randn(1, 65, 32)))
    assert attend(engine, req("m", torch.randn(1, 64, 32))).output.shape == (1, 64, 32)


def test_a_scaled_mla_models_expanded_queries_are_bounded_scaled():
    """Mistral 4's MLA with queries scaled by position: its prompts attend expanded
    (mla.expands), which scales q_nope itself, not only q' = [rope(q_rope); W_uk^T q_nope].
    With q_nope large and W_uk tiny the absorbed q' and every score stay small, but the
    scaled q_nope passes float16's max: the bounds must not clear such a step (they cleared
    it when only q' and the scores took the scale), and its prompt answers finite or is
    refused, never inf or a wrong number as OK."""
    from tests.model.test_mla import C, E, H, N, R, V, config

    qs = QueryScaleConfig(2000.0, 1)  # at 4095: about 16600
    spec = ModelSpec("m", config(q_lora=False, bias=False, query_scale=qs), seed=1)
    engine = engine_of(spec, torch.float16)
    module = engine.get("m").module
    with torch.no_grad():
        q = module.q.weight.view(H, N + R, E)
        q[:, :N] = 1.0  # q_nope = sum(x): up to E * max|x|
        q[:, N:] = 0.0  # no rope part
        kv_b = module.kv_b.weight.view(H, N + V, C)
        kv_b[:, :N] = 1e-7  # W_uk: the absorbed q' = W_uk^T q_nope stays tiny
    x_absmax = 3.0
    plain = dataclasses.replace(spec.attention, query_scale=None)
    unscaled = engine_of(ModelSpec("m", plain, seed=1), torch.float16)
    unscaled.get("m").module.load_state_dict(module.state_dict())
    assert cleared(unscaled.get("m"), torch.float16, x_absmax, 0.0, 1.0) is not None
    assert cleared(engine.get("m"), torch.float16, x_absmax, 0.0, 1.0) is None
    sid = engine.sessions.create("m", None, None).session_id
    x = torch.full((1, 80, E), x_absmax).half()  # q_nope 144 at every row, scaled past 65504
    answer_is_finite_or_refused(engine, req("m", x, session_id=sid))
