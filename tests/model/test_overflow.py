"""Overflow of attention scores is decided by a bound and an exact float64 check, never by
what a kernel makes of inf: the same rows are refused on every machine."""

from __future__ import annotations

import math

import pytest
import torch

from mha_serve.model import AttentionConfig, MultiHeadAttention, init_weights, overflow
from mha_serve.model.overflow import (
    MARGIN,
    bound_crossed,
    overflowing_rows,
    row_absmax,
    score_limit,
    scores_overflow,
)

F32_MAX = torch.finfo(torch.float32).max


def test_row_absmax_propagates_nan_and_inf():
    a = torch.randn(3, 2, 4, 5)
    a[1, 0, 2, 3] = float("nan")
    a[2, 1, 0, 0] = -float("inf")
    (got,) = row_absmax(a)
    assert got[0] == a[0].abs().max().item()
    assert math.isnan(got[1]) and got[2] == math.inf


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_bound_is_crossed_by_non_finite_maxima(value):
    assert bound_crossed(value, 1.0, 64, F32_MAX)
    assert bound_crossed(1.0, value, 64, F32_MAX)
    assert not bound_crossed(1e3, 1e3, 64, F32_MAX)


def naive_overflow(q, k, limit, first_pos):
    """Every (head, row, key) pair's sum of |q_i k_i| in float64, by loops over heads."""
    H, R, _ = q.shape
    G = H // k.shape[0]
    for h in range(H):
        sums = q[h].abs().double() @ k[h // G].abs().double().T  # (R, S)
        for i in range(R):
            seen = sums[i] if first_pos is None else sums[i, : first_pos + i + 1]
            if not bool((seen < limit / MARGIN).all()):
                return True
    return False


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("first_pos", [None, 0, 3])
def test_exact_check_equals_a_naive_loop(kv_heads, first_pos):
    """Random rows of huge values placed at random: the chunked, grouped check says what
    the loop over heads says (rows per chunk forced small to cross chunk edges)."""
    g = torch.Generator().manual_seed(kv_heads * 10 + (first_pos or 0))
    outcomes = set()
    for trial in range(100):
        q = torch.randn(4, 5, 8, generator=g)
        k = torch.randn(kv_heads, (first_pos or 0) + 5, 8, generator=g)
        # Scales from 1e18 to 1e19: sums of |q_i k_i| from about 1e36 to 1e39, both sides
        # of the limit.
        scale_q, scale_k = (10 ** (18 + torch.rand(2, generator=g))).tolist()
        q[torch.randint(4, (1,), generator=g), torch.randint(5, (1,), generator=g)] *= scale_q
        row = torch.randint(k.shape[1], (1,), generator=g)
        k[torch.randint(kv_heads, (1,), generator=g), row] *= scale_k
        expected = naive_overflow(q, k, F32_MAX, first_pos)
        saved = overflow.EXACT_CHUNK_ELEMENTS
        overflow.EXACT_CHUNK_ELEMENTS = 4 * k.shape[1] * 2  # two rows per chunk
        try:
            got = scores_overflow(q, k, F32_MAX, first_pos=first_pos)
        finally:
            overflow.EXACT_CHUNK_ELEMENTS = saved
        assert got == expected, f"trial {trial}"
        outcomes.add(got)
    assert outcomes == {True, False}, "the trials must cover both answers"


def test_exact_check_clears_what_the_bound_cannot():
    """Huge queries and keys in different dimensions: the bound is crossed, no product is."""
    q = torch.zeros(1, 1, 4)
    k = torch.zeros(1, 1, 4)
    q[0, 0, 0] = 1e30
    k[0, 0, 1] = 1e30
    assert bound_crossed(1e30, 1e30, 4, F32_MAX)
    assert not scores_overflow(q, k, F32_MAX, first_pos=None)


def test_cancelling_products_still_overflow():
    """q . k = 0 exactly, but a partial sum is 1e40: a kernel summing in float32 makes NaN."""
    q = torch.tensor([[[1e20, 1e20]]])
    k = torch.tensor([[[1e20, -1e20]]])
    assert (q.double() @ k.double().transpose(1, 2)).item() == 0
    assert scores_overflow(q, k, F32_MAX, first_pos=None)


def test_causal_mask_spares_keys_a_query_never_sees():
    """Query 0 is huge and key 2 is huge: only a bidirectional query 0 sees key 2."""
    q = torch.ones(1, 3, 4)
    k = torch.ones(1, 3, 4)
    q[0, 0] = 1e20
    k[0, 2] = 1e20
    assert not scores_overflow(q, k, F32_MAX, first_pos=0)
    assert scores_overflow(q, k, F32_MAX, first_pos=None)
    assert scores_overflow(q, k, F32_MAX, first_pos=2)  # row 0 at position 2 sees key 2


def test_score_limit_is_the_narrowest_dtype():
    assert score_limit(torch.float32, torch.float16) == 65504.0
    assert score_limit(torch.float32) == F32_MAX


@pytest.fixture(scope="module")
def module() -> MultiHeadAttention:
    m = MultiHeadAttention(AttentionConfig(embed_dim=64, num_heads=8, num_kv_heads=2))
    init_weights(m, 0)
    return m.eval()


def test_forward_flags_only_the_overflowing_row(module):
    """A batch of one huge and one normal sequence: only the huge one is flagged, and the
    normal one's output equals its forward alone."""
    x = torch.randn(2, 6, 64, generator=torch.Generator().manual_seed(1))
    x[0] = 1e20
    with torch.inference_mode():
        out = module(x)
        alone = module(x[1:])
    assert out.overflow.rows() == [0]
    assert alone.overflow.rows() == []
    torch.testing.assert_close(out.output[1:], alone.output, atol=1e-6, rtol=1e-6)


def test_moderate_values_are_not_flagged(module):
    """1e6 is far from overflow (scores about 1e13): nothing is refused."""
    x = torch.full((1, 4, 64), 1e6)
    with torch.inference_mode():
        assert module(x).overflow.rows() == []


def test_overflowing_rows_catches_non_finite_values():
    q = torch.ones(2, 1, 3, 4)
    k = torch.ones(2, 1, 3, 4)
    v = torch.ones(2, 1, 3, 4)
    v[1, 0, 2, 0] = float("inf")
    assert overflowing_rows(q, k, v, [None, None]) == [1]


@pytest.mark.parametrize("rotary", [False, True])
def test_input_bounds_hold_for_q_k_v_and_the_output(rotary):
    """The bounds a session step uses instead of measuring (projected_bounds, output_bound)
    are never below the real maxima, for random inputs, weights, head gates and positions."""
    from mha_serve.model.config import RopeConfig
    from mha_serve.model.overflow import output_bound, projected_bounds, weight_bounds

    rope = RopeConfig() if rotary else None
    module = MultiHeadAttention(AttentionConfig(64, 8, 2, rope=rope)).eval()
    init_weights(module, 3)
    g = torch.Generator().manual_seed(4)
    for trial in range(20):
        x = torch.randn(2, 7, 64, generator=g) * 10 ** (trial % 5)
        gate = torch.rand(8, generator=g) * 3
        positions = torch.randint(0, 5000, (2, 7), generator=g)
        with torch.inference_mode():
            q, k, v = module.project(x, positions)
            out = module(x, causal=True, head_mask=gate).output
        wb = weight_bounds(module)
        q_b, k_b, v_b = projected_bounds(float(x.abs().max()), 64, wb, rotary=rotary)
        assert float(q.abs().max()) <= q_b and float(k.abs().max()) <= k_b
        assert float(v.abs().max()) <= v_b
        if not rotary:  # the stateless forward rotates at 0..L-1: same bound either way
            assert float(out.abs().max()) <= output_bound(v_b, float(gate.max()), wb)


def test_weight_bounds_follow_the_weights():
    module = MultiHeadAttention(AttentionConfig(64, 8)).eval()
    init_weights(module, 5)
    from mha_serve.model.overflow import weight_bounds

    before = weight_bounds(module)
    assert weight_bounds(module) is before  # computed once per version of the weights
    with torch.no_grad():
        module.wqkv.weight.mul_(1000)
    assert weight_bounds(module).q_row == pytest.approx(before.q_row * 1000)


def test_window_spares_keys_it_hides():
    """Key 0 is huge: query 4 with a window of 3 never sees it, causal or not; query 2 does."""
    q = torch.ones(1, 5, 4)
    k = torch.ones(1, 5, 4)
    k[0, 0] = 1e20
    q *= 1e20
    assert scores_overflow(q, k, F32_MAX, first_pos=0)  # no window: row 0 sees key 0
    assert not scores_overflow(q[:, 3:], k, F32_MAX, first_pos=3, window=3)
    bidirectional = q.clone()
    bidirectional[0, :3] = 1.0  # rows 0..2 see key 0 (|i - 0| < 3), rows 3 and 4 do not
    assert not scores_overflow(bidirectional, k, F32_MAX, first_pos=None, window=3)
    assert scores_overflow(bidirectional, k, F32_MAX, first_pos=None, window=4)
    assert scores_overflow(q[:, 2:], k, F32_MAX, first_pos=2, window=3)
    # keys read from position 2 (a session's window read): key positions shift with them
    assert not scores_overflow(q[:, 4:], k[:, 2:], F32_MAX, first_pos=4, window=3, first_key=2)
    k[0, 2] = 1e20
    assert scores_overflow(q[:, 4:], k[:, 2:], F32_MAX, first_pos=4, window=3, first_key=2)


def test_forward_limit_counts_a_scale_above_one():
    """Scores 1e38 are finite in float32, scaled by 10 they are not: refused by the limit
    over the config's score_factor, though the unscaled product fits."""
    cfg = AttentionConfig(8, 1, bias=False, softmax_scale=10.0)
    module = MultiHeadAttention(cfg).eval()
    with torch.no_grad():
        module.wqkv.weight.zero_()
        module.wqkv.weight[0, 0] = module.wqkv.weight[8, 0] = 1.0  # q_0 = k_0 = x_0
        module.wo.weight.copy_(torch.eye(8))
    x = torch.zeros(1, 2, 8)
    x[0, :, 0] = 1e19  # q . k = 1e38: under float32's max, scaled 1e39 over it
    with torch.inference_mode():
        assert module(x).overflow.rows() == [0]
        x[0, :, 0] = 1e18
        assert module(x).overflow.rows() == []


@pytest.mark.parametrize("scope", ["head", "projection"])
def test_qk_norm_bounds_q_and_k_whatever_the_input(scope):
    from mha_serve.model.config import QKNormConfig, RopeConfig
    from mha_serve.model.overflow import projected_bounds, weight_bounds

    module = MultiHeadAttention(
        AttentionConfig(64, 8, 2, rope=RopeConfig(), qk_norm=QKNormConfig(scope))
    ).eval()
    init_weights(module, 6)
    wb = weight_bounds(module)
    g = torch.Generator().manual_seed(7)
    for trial in range(10):
        x = torch.randn(2, 7, 64, generator=g) * 10 ** (3 * trial - 10)
        x[0, 0] = 0.0
        x[1, 1, 1:] = 0.0  # one nonzero value: |x_i| / rms reaches sqrt(n)
        with torch.inference_mode():
            q, k, _ = module.project(x, torch.randint(0, 5000, (2, 7), generator=g))
        q_b, k_b, _ = projected_bounds(float(x.abs().max()), 64, wb, rotary=True)
        assert float(q.abs().max()) <= q_b and float(k.abs().max()) <= k_b
    assert q_b == wb.rotation * wb.q_norm < 1e3, "the bound does not grow with the input"
