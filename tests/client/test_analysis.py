"""Attention entropy and peak weight: the known cases, and that padding never counts."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mha_client.analysis import attention_entropy, head_entropy, head_max_weight


def _uniform(batch: int, heads: int, rows: int, lengths: list[int], seq_len: int) -> np.ndarray:
    """Weights spread evenly over each sequence's real keys, zero past its length."""
    w = np.zeros((batch, heads, rows, seq_len), dtype=np.float32)
    for b, n in enumerate(lengths):
        w[b, :, :, :n] = 1.0 / n
    return w


def test_uniform_over_n_keys_is_log_n():
    w = _uniform(1, 2, 4, [4], 4)
    np.testing.assert_allclose(attention_entropy(w), [[math.log(4)] * 2], rtol=1e-6)


def test_one_hot_is_zero():
    w = np.zeros((2, 3, 5, 5), dtype=np.float32)
    w[..., 0] = 1.0
    np.testing.assert_array_equal(attention_entropy(w), np.zeros((2, 3)))


def test_three_d_weights_give_one_value_per_head():
    w = _uniform(1, 3, 2, [8], 8)[0]  # (h, R, S)
    out = attention_entropy(w)
    assert out.shape == (3,)
    np.testing.assert_allclose(out, math.log(8), rtol=1e-6)


def test_padding_rows_and_keys_do_not_count():
    w = _uniform(2, 1, 6, [6, 3], 6)
    # Garbage in padded rows of the short sequence must not change its entropy.
    w[1, :, 3:, :] = 1.0 / 6
    out = attention_entropy(w, lengths=[6, 3])
    np.testing.assert_allclose(out[:, 0], [math.log(6), math.log(3)], rtol=1e-6)


def test_query_start_shifts_which_rows_are_real():
    # Rows 4..5 of a sequence of length 5: only row 4 is real.
    w = np.zeros((1, 1, 2, 6), dtype=np.float32)
    w[0, 0, 0, :5] = 1.0 / 5  # row 4: uniform over the 5 real keys
    w[0, 0, 1, 0] = 1.0  # row 5 is padding; one-hot would pull the mean towards 0
    out = attention_entropy(w, lengths=[5], query_start=4)
    np.testing.assert_allclose(out, [[math.log(5)]], rtol=1e-6)


def test_no_real_rows_gives_nan():
    w = _uniform(1, 1, 2, [2], 4)
    assert np.isnan(attention_entropy(w, lengths=[2], query_start=2)).all()


def test_head_entropy_weighs_every_real_row_once():
    w = _uniform(2, 1, 4, [4, 2], 4)
    # Sequence 0 has 4 real rows at log 4, sequence 1 has 2 at log 2.
    expected = (4 * math.log(4) + 2 * math.log(2)) / 6
    np.testing.assert_allclose(head_entropy(w, [4, 2]), [expected], rtol=1e-6)


def test_head_max_weight():
    w = _uniform(2, 2, 3, [3, 2], 3)
    np.testing.assert_allclose(head_max_weight(w), [0.5, 0.5])
    assert head_max_weight(w[0]).shape == (2,)


def test_bad_shapes_say_what_was_expected():
    with pytest.raises(ValueError, match=r"expected \(batch, heads, rows, keys\)"):
        attention_entropy(np.zeros((4, 4)))
    with pytest.raises(ValueError, match="3 lengths for a batch of 2"):
        attention_entropy(np.zeros((2, 1, 1, 1)), lengths=[1, 1, 1])
