"""Summaries of returned attention weights (entropy, peak weight) that ignore padding."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def _entropy_sums(
    weights: np.ndarray, lengths: Sequence[int] | None, query_start: int
) -> tuple[np.ndarray, np.ndarray]:
    """Entropy summed over real query rows, (B, h), and the number of those rows, (B,)."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 4:
        raise ValueError(f"weights have shape {w.shape}; expected (batch, heads, rows, keys)")
    batch, _, num_rows, seq_len = w.shape
    lens = np.full(batch, seq_len) if lengths is None else np.asarray(lengths, dtype=np.int64)
    if lens.shape != (batch,):
        raise ValueError(f"got {lens.size} lengths for a batch of {batch} sequences")
    real_keys = np.arange(seq_len) < lens[:, None]  # (B, S)
    real_rows = (query_start + np.arange(num_rows)) < lens[:, None]  # (B, R)
    p = np.where(real_keys[:, None, None, :], w, 0.0)  # (B, h, R, S)
    # 0 * log 0 is 0: keys a row never attends to add no uncertainty.
    log_p = np.log(p, out=np.zeros_like(p), where=p > 0)
    row_entropy = -(p * log_p).sum(-1)  # (B, h, R)
    total = (row_entropy * real_rows[:, None, :]).sum(-1)  # (B, h)
    return total, real_rows.sum(-1)


def attention_entropy(
    weights: np.ndarray, lengths: Sequence[int] | None = None, query_start: int = 0
) -> np.ndarray:
    """Mean entropy in nats of each head's attention rows, per (batch, head).

    weights: (B, h, R, S) as Attend returns them, or (h, R, S) for one sequence (the result
    is then (h,)). Rows hold queries query_start .. query_start + R - 1; only rows and keys
    before a sequence's length count. Uniform attention over n keys gives log(n), one-hot
    gives 0; a sequence with no real rows in range gives NaN.
    """
    w = np.asarray(weights)
    single = w.ndim == 3
    total, num_rows = _entropy_sums(w[None] if single else w, lengths, query_start)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = total / num_rows[:, None]
    return mean[0] if single else mean


def head_entropy(
    weights: np.ndarray, lengths: Sequence[int] | None = None, query_start: int = 0
) -> np.ndarray:
    """Mean entropy in nats per head, (h,), over every real query row of the whole batch.

    Unlike averaging attention_entropy over the batch, a long sequence weighs more than a
    short one, as each real row counts once.
    """
    w = np.asarray(weights)
    total, num_rows = _entropy_sums(w[None] if w.ndim == 3 else w, lengths, query_start)
    with np.errstate(invalid="ignore", divide="ignore"):
        return total.sum(0) / num_rows.sum()


def head_max_weight(weights: np.ndarray) -> np.ndarray:
    """Largest weight per head, (h,), over (B, h, R, S) or (h, R, S) weights (padding is 0)."""
    w = np.asarray(weights, dtype=np.float32)
    if w.ndim == 3:
        w = w[None]
    if w.ndim != 4:
        raise ValueError(f"weights have shape {w.shape}; expected (batch, heads, rows, keys)")
    if w.size == 0:
        return np.full(w.shape[1], np.nan, dtype=np.float32)
    return w.max(axis=(0, 2, 3))
