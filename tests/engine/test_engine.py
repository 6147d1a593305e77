"""The engine without a server: validation messages, size limits, dtypes, and parity with the module."""

from __future__ import annotations

import pytest
import torch

from mha_serve.config import default_models
from mha_serve.engine import Engine, InvalidRequest, ModelNotFound, ModelSpec, TooLarge
from mha_serve.model import AttentionConfig, MultiHeadAttention, init_weights
from tests.engine_calls import attend, req

MiB = 2**20


@pytest.fixture(scope="module")
def engine() -> Engine:
    specs = [
        *default_models(),
        ModelSpec("tiny", AttentionConfig(32, 4, 2), seed=7, max_weights_bytes=4096),
    ]
    return Engine(
        specs, device=torch.device("cpu"), dtype=torch.float32, max_response_bytes=8 * MiB
    )


def x(b: int, n: int, e: int = 512, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(b, n, e, generator=torch.Generator().manual_seed(b * 100 + n)).to(dtype)


def test_output_equals_the_module_with_the_same_seed(engine):
    for spec in default_models():
        module = MultiHeadAttention(spec.attention)
        init_weights(module, spec.seed)
        inputs = x(2, 9)
        result = attend(engine, req(spec.name, inputs, lengths=[9, 4], need_weights=True))
        with torch.inference_mode():
            ref = module(inputs, lengths=torch.tensor([9, 4]), need_weights=True)
        torch.testing.assert_close(result.output, ref.output, atol=1e-6, rtol=0)
        torch.testing.assert_close(result.weights, ref.weights, atol=1e-6, rtol=0)
        assert result.batch_size == 2 and result.weight_heads == list(range(8))


def test_output_dtype_follows_input_unless_asked(engine):
    bf16 = attend(engine, req("gqa", x(1, 5, dtype=torch.bfloat16)))
    assert bf16.output.dtype == torch.bfloat16
    f16 = attend(engine, req("gqa", x(1, 5), output_dtype=torch.float16))
    assert f16.output.dtype == torch.float16
    f32 = attend(engine, req("gqa", x(1, 5)))
    torch.testing.assert_close(f16.output.float(), f32.output, atol=2e-3, rtol=2e-3)


def test_weights_narrowed_and_cast(engine):
    full = attend(engine, req("mqa", x(1, 12), need_weights=True, causal=True))
    part = attend(
        engine,
        req(
            "mqa",
            x(1, 12),
            need_weights=True,
            causal=True,
            weight_heads=[6, 1],
            query_start=4,
            query_end=9,
            weights_dtype=torch.bfloat16,
        ),
    )
    assert part.weights.shape == (1, 2, 5, 12) and part.weights.dtype == torch.bfloat16
    assert part.weight_heads == [6, 1] and part.weight_query_start == 4
    torch.testing.assert_close(
        part.weights.float(), full.weights[:, [6, 1], 4:9], atol=4e-3, rtol=0
    )
    assert torch.all(full.weights[0, :, 3, 4:] == 0)  # causal: row 3 sees keys 0..3 only


def test_model_not_found_lists_models(engine):
    with pytest.raises(
        ModelNotFound, match=r"'big' is not served here; available: mha, gqa, mqa, tiny"
    ):
        engine.prepare(req("big", x(1, 2)))


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (req("mha", torch.zeros(3, 512)), r"got shape \[3, 512\]"),
        (req("mha", x(1, 3, 64)), "expects embed_dim 512, got 64"),
        (req("mha", torch.zeros(1, 0, 512)), "input is empty"),
        (req("mha", x(1, 3).double()), "float32, float16, bfloat16"),
        (req("mha", x(2, 3), lengths=[3]), "1 entries for a batch of 2"),
        (req("mha", x(2, 3), lengths=[3, 4]), r"lengths\[1\] = 4 .* 1..3"),
        (
            req("mha", x(1, 3), head_mask=[1.0] * 7),
            "head_mask has 7 values; model 'mha' has 8 heads",
        ),
        (req("mha", x(1, 3), head_mask=[float("nan")] * 8), "head_mask contains NaN"),
        (
            req("mha", x(1, 3), need_weights=True, weight_heads=[0, 9]),
            "head 9 is out of range",
        ),
        (req("mha", x(1, 3), need_weights=True, query_start=3), r"rows \[3, 0\)"),
        (req("mha", torch.full((1, 2, 512), float("inf"))), "NaN or Inf"),
    ],
)
def test_invalid_calls_say_what_was_expected(engine, call, match):
    with pytest.raises(InvalidRequest, match=match):
        engine.prepare(call)


def test_length_and_batch_limits():
    spec = ModelSpec("small", AttentionConfig(16, 2), max_seq_len=8, max_batch_size=2)
    engine = Engine([spec], device=torch.device("cpu"), dtype=torch.float32, max_response_bytes=MiB)
    with pytest.raises(InvalidRequest, match="seq_len 9 exceeds model 'small' max_seq_len 8"):
        engine.prepare(req("small", x(1, 9, 16)))
    with pytest.raises(InvalidRequest, match="batch 3 exceeds model 'small' max_batch_size 2"):
        engine.prepare(req("small", x(3, 8, 16)))
    engine.prepare(req("small", x(2, 8, 16)))


def test_weight_budget_refuses_up_front_and_narrowing_fits(engine):
    # tiny: 4 heads x 16 x 16 x 4 bytes = 4096 bytes fits the 4096-byte budget; batch 2 does not.
    engine.prepare(req("tiny", x(1, 16, 32), need_weights=True))
    with pytest.raises(TooLarge, match=r"would be 8.0 KiB .* limit is 4.0 KiB; narrow the request"):
        engine.prepare(req("tiny", x(2, 16, 32), need_weights=True))
    engine.prepare(req("tiny", x(2, 16, 32), need_weights=True, weights_dtype=torch.float16))
    engine.prepare(req("tiny", x(2, 16, 32), need_weights=True, weight_heads=[0, 1]))


def test_output_larger_than_response_limit_is_too_large(engine):
    # 8 MiB response limit; 5 x 1024 x 512 x 4 bytes = 10 MiB of output.
    with pytest.raises(TooLarge, match="the output alone is 10.0 MiB") as refused:
        engine.prepare(req("mha", torch.zeros(5, 1024, 512)))
    # What fits, what is kept back, and what to change: not "fewer sequences" to a step.
    message = str(refused.value)
    assert "(5 x 1024 x 512 float32)" in message and "64.0 KiB is kept" in message
    assert "at most 7.9 MiB of output" in message and "fewer or shorter sequences" in message
    assert "ask for output_dtype float16 or bfloat16" in message
    with pytest.raises(TooLarge, match="the output alone is 9.0 MiB") as narrow:  # float16
        engine.prepare(req("mha", torch.zeros(9, 1024, 512), output_dtype=torch.float16))
    assert "output_dtype" not in str(narrow.value)  # already narrow: not offered again
    sid = engine.create_session("mha").session_id
    with pytest.raises(TooLarge, match="the output alone is 8.0 MiB") as step:
        engine.prepare(req("mha", torch.zeros(1, 4096, 512), session_id=sid))
    assert "send fewer tokens per step" in str(step.value)
    assert "sequences" not in str(step.value)


def test_bad_engine_configs_fail_with_the_fix():
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="no models configured"):
        Engine([], device=cpu, dtype=torch.float32, max_response_bytes=MiB)
    twice = [ModelSpec("a", AttentionConfig(16, 2)), ModelSpec("a", AttentionConfig(16, 4))]
    with pytest.raises(ValueError, match="repeated: a"):
        Engine(twice, device=cpu, dtype=torch.float32, max_response_bytes=MiB)
    with pytest.raises(ValueError, match="max_seq_len must be a positive integer"):
        ModelSpec("b", AttentionConfig(16, 2), max_seq_len=0)
    with pytest.raises(ValueError, match="model name"):
        ModelSpec("has space", AttentionConfig(16, 2))


def test_device_and_dtype_may_be_named_as_the_config_names_them():
    """Names as the config has them ("cpu", "auto", "float16"): the same engine as torch's
    objects; a name that is none, the config's error."""
    spec = [ModelSpec("a", AttentionConfig(16, 2), seed=1)]
    named = Engine(spec, device="cpu", dtype="float16", max_response_bytes=MiB)
    hosted = named.get("a")
    assert (hosted.device, hosted.dtype) == (torch.device("cpu"), torch.float16)
    auto = Engine(spec, device="cpu", dtype="auto", max_response_bytes=MiB).get("a")
    assert auto.dtype == torch.float32  # auto on the CPU
    with pytest.raises(ValueError, match="dtype 'float64' is not one of auto"):
        Engine(spec, device="cpu", dtype="float64", max_response_bytes=MiB)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_all_finite_matches_torch_on_every_dtype(dtype):
    from mha_serve.engine.checks import all_finite

    x = torch.randn(3, 7, dtype=torch.float32).to(dtype)
    assert all_finite(x)
    for bad in (float("nan"), float("inf"), float("-inf")):
        y = x.clone()
        y[2, 5] = bad
        assert not all_finite(y) and not bool(torch.isfinite(y).all())
        assert not all_finite(y[1:, 1::2])  # a strided view is checked too
    assert all_finite(torch.full((4,), 65504.0, dtype=dtype))  # largest float16, still finite


def test_create_and_fork_answer_a_session_whose_ttl_is_shorter_than_the_call():
    """The engine answers CreateSession/ForkSession with the session as made, never
    NOT_FOUND for it however short its TTL (a clock a second on at every reading: each call
    outlasts a TTL of half a second); its next call finds it expired."""
    from mha_serve.cache import SessionNotFound

    ticks = iter(range(10**6))
    engine = Engine(
        [ModelSpec("tiny", AttentionConfig(32, 4, 2), seed=7)],
        device=torch.device("cpu"),
        dtype=torch.float32,
        max_response_bytes=MiB,
        clock=lambda: float(next(ticks)),
    )
    made = engine.create_session("tiny", ttl_s=0.5)
    assert made.num_tokens == 0 and made.ttl_s == 0.5
    with pytest.raises(SessionNotFound, match="expired"):
        engine.get_session(made.session_id)
    parent = engine.create_session("tiny", ttl_s=100.0)
    child = engine.fork_session(parent.session_id, ttl_s=0.5)
    assert child.session_id != parent.session_id and child.ttl_s == 0.5
