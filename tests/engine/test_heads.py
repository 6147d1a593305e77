"""engine.heads.analyze: validated as an Attend (limits, sessions and head masks refused)."""

from __future__ import annotations

import pytest
import torch

from mha_serve.engine import Engine, InvalidRequest, TooLarge
from mha_serve.engine.heads import analyze
from mha_serve.engine.types import ModelSpec
from mha_serve.model import AttentionConfig
from tests.engine_calls import req


@pytest.fixture(scope="module")
def engine() -> Engine:
    spec = ModelSpec("m", AttentionConfig(32, 4, 2), max_weights_bytes=4 * 16 * 16 * 4)
    return Engine([spec], device=torch.device("cpu"), dtype=torch.float32, max_response_bytes=2**24)


def test_analysis_of_the_hosted_module(engine):
    x = torch.randn(1, 16, 32)
    analysis = analyze(engine, req("m", x), include_weights=True)
    ms = analysis.compute_ms
    assert len(analysis.importance) == 4 and analysis.weights.shape == (4, 16, 16) and ms > 0


@pytest.mark.parametrize(
    ("call", "error", "piece"),
    [
        (req("m", torch.randn(1, 17, 32)), TooLarge, "attention weights would be"),
        (req("m", torch.randn(1, 4, 32), head_mask=[1.0] * 4), InvalidRequest, "head_mask"),
        (req("m", torch.randn(1, 4, 32), session_id="s"), InvalidRequest, "session_id"),
        (req("m", torch.randn(1, 4, 16)), InvalidRequest, "embed_dim 32"),
    ],
)
def test_refused_like_an_attend(engine, call, error, piece):
    with pytest.raises(error, match=piece):
        analyze(engine, call, include_weights=False)


def test_weights_over_the_limit_get_the_analysis_advice(engine):
    """An Attend over max_weights_bytes is told to narrow weights.heads or its rows; the
    analysis refuses weights options, so its refusal says what it can change instead."""
    x = torch.randn(1, 17, 32)
    with pytest.raises(TooLarge) as e:
        analyze(engine, req("m", x), include_weights=False)
    message = str(e.value)
    assert "send fewer or shorter sequences, or raise the model's max_weights_bytes" in message
    assert "weights.heads" not in message and "attention weights would be" in message
    with pytest.raises(TooLarge, match=r"fewer heads \(weights.heads\)"):
        engine.prepare(req("m", x, need_weights=True))
