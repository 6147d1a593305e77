"""The kernel of a batch of sequences attending over their cached keys in one launch: the
keys padded to one width (KVCache.gather), a boolean mask for each row's real keys,
causality within its new tokens and the sliding window. MultiHeadAttention.attend_padded
runs it; attend_cached's loop (cached.py) runs one kernel per sequence instead.

GQA and MQA fold each KV head's G query heads into the query rows, (B, KVH, G*T, D), so
the kernel is plain multi-head attention over the KVH heads that reads each KV head once,
with no copy of K/V per query head and no reliance on a backend's enable_gqa support
(on CUDA a masked SDPA runs the memory-efficient kernel; flash takes no mask).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from mha_serve.transfer import list_tensor

from .cached import Alibi, explicit_attention


def padded_mask(
    past: Sequence[int],
    new: Sequence[int],
    first: Sequence[int],
    T: int,
    S: int,
    window: int | None,
    device: torch.device,
) -> torch.Tensor | None:
    """(B, 1, T, S) bool: row b's new token t (absolute position past[b] + t) may see column
    j (absolute position first[b] + j) when j is one of its past[b] + new[b] - first[b]
    keys, at or before the token and, with a window, within it. A padded token (t >=
    new[b]) sees every key of its row (its output is dropped; a row that sees nothing
    would be NaN). None when every row's one token sees all S columns: no mask, so the
    fastest kernel runs."""
    key_lengths = [p + n - f for p, n, f in zip(past, new, first, strict=True)]
    whole = window is None or all(p - f < window for p, f in zip(past, first, strict=True))
    if T == 1 and whole and all(n == S for n in key_lengths):
        return None
    rows = list_tensor([list(past), list(new), list(first), key_lengths], device)  # (4, B)
    p, n, f, k = (r[:, None] for r in rows)  # (B, 1) each
    j = torch.arange(S, device=device)[None]  # (1, S)
    t = torch.arange(T, device=device)[None]  # (1, T)
    real = (j < k)[:, None, :]  # (B, 1, S): the row's keys, not its padding
    if T == 1 and window is None:  # a decode step sees every key it has
        return real[:, None]  # (B, 1, 1, S)
    key_pos = (f + j)[:, None, :]  # (B, 1, S)
    query_pos = (p + t)[:, :, None]  # (B, T, 1)
    allowed = real & (key_pos <= query_pos)  # (B, T, S)
    if window is not None:
        allowed &= key_pos > query_pos - window
    padded = (t >= n)[:, :, None]  # (B, T, 1)
    return (allowed | (padded & real))[:, None]  # (B, 1, T, S)


def attend_padded(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    allowed: torch.Tensor | None,
    scale: float,
    *,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    alibi: Alibi | None = None,
) -> torch.Tensor:
    """q (B, H, T, D) over keys, values (B, KVH, S, D) where allowed (B, 1, T, S) (None:
    every key, padded_mask's); sinks (H,): each head's sink logit (None: none); alibi: its
    slopes and each row's query and key positions (None: none). Returns (B, H, T, D) in
    q's dtype."""
    B, H, T, D = q.shape
    KVH = keys.shape[1]
    if softcap is not None or sinks is not None or alibi is not None:  # float32 scores from
        # the unrounded queries
        return explicit_attention(q, keys, values, allowed, scale, softcap, sinks, alibi)
    narrow = keys.dtype != q.dtype  # a cache narrower than the model (kv_cache_dtype)
    qk = q.to(keys.dtype) if narrow else q
    G = H // KVH
    qg = qk.reshape(B, KVH, G * T, D)  # query head h = kv * G + g, row g * T + t
    mask = allowed
    if mask is not None and G > 1 and T > 1:
        mask = mask.repeat(1, 1, G, 1)  # (B, 1, G*T, S): row g * T + t is token t's
    y = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask, scale=scale)
    y = y.reshape(B, H, T, D)  # (B, KVH, G*T, D) -> (B, H, T, D)
    return y.to(q.dtype) if narrow else y
