"""Attention of new tokens over keys already laid out by absolute position (a KV cache read).

The engine writes the new tokens' K/V into the cache first and then reads each session's
positions 0..past+new-1 in order, so keys need one copy (or none, for a session whose
blocks are contiguous) instead of a gather plus a [past | new] concatenation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from .attention import AttentionOutput, MultiHeadAttention

# A lone decode token of GQA/MQA at least this deep attends by two matmuls per KV head
# (its G query heads as the rows of one matrix), reading each KV head once. The CPU SDPA
# kernel walks the keys once per query head instead: at 4096 keys, 8 query heads, it took
# 0.60 ms for MQA and 0.70 ms for GQA (2 KV heads) against 0.33 and 0.54 ms grouped; below
# ~1024 keys SDPA is as fast or faster. (2-core CPU, float32.)
GROUPED_MIN_KEYS = 1024


def attend_cached(
    module: MultiHeadAttention,
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    *,
    past_lengths: Sequence[int],
    new_lengths: Sequence[int],
    need_weights: bool = False,
    weight_heads: Sequence[int] | None = None,
    head_mask: torch.Tensor | None = None,
) -> AttentionOutput:
    """q (B, H, T, D): the new tokens' queries (module.project); keys, values (B, KVH, S, D):
    each sequence's positions 0..past+new-1 in order (new tokens included), padding after.

    New token t of sequence b (absolute position past_lengths[b] + t) attends causally to
    positions 0..past_lengths[b] + t. past_lengths, new_lengths: B ints each.
    Returns outputs (B, T, E) (rows of padded tokens 0) and, when asked, weights
    (B, len(heads), T, S) float32 over absolute positions (columns past the end 0).
    """
    B, H, T, _ = q.shape
    S = keys.shape[2]
    KVH = module.config.num_kv_heads
    heads = module._check_heads(weight_heads)
    gate = module._check_head_mask(head_mask, q)
    totals = [p + n for p, n in zip(past_lengths, new_lengths, strict=True)]
    new_valid = None
    if any(n < T for n in new_lengths):
        new_len = torch.tensor(list(new_lengths), device=q.device)
        new_valid = torch.arange(T, device=q.device)[None, :] < new_len[:, None]  # (B, T)
    # One decode token seeing every key needs no mask at all (the common case).
    allowed = None
    if T > 1 or any(total < S for total in totals):
        past = torch.tensor(list(past_lengths), device=q.device)[:, None, None]  # (B, 1, 1)
        total = torch.tensor(totals, device=q.device)[:, None, None]  # (B, 1, 1)
        t = torch.arange(T, device=q.device)[None, :, None]  # (1, T, 1)
        j = torch.arange(S, device=q.device)[None, None, :]  # (1, 1, S)
        # Padded rows keep their causal keys (never an all-masked row); they are zeroed below.
        allowed = ((j <= past + t) & (j < total))[:, None]  # (B, 1, T, S)
    if T == 1 and B == 1 and KVH != H and S >= GROUPED_MIN_KEYS:
        y = _grouped_decode(q, keys, values, allowed, module.scale)
    else:
        y = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=allowed, scale=module.scale, enable_gqa=KVH != H
        )  # (B, H, T, D)
    out = module._merge_heads(y, gate, new_valid)  # (B, T, E)
    weights = None
    if need_weights:
        weights = module._softmax(q, keys, heads, allowed)  # (B, n, T, S)
        if new_valid is not None:
            weights = weights.masked_fill(~new_valid[:, None, :, None], 0.0)
    return AttentionOutput(output=out, weights=weights)


def _grouped_decode(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    allowed: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """Attention of one token per sequence, q (B, H, 1, D), over keys, values (B, KVH, S, D)
    with H = KVH * G (query head h reads KV head h // G): each KV head's G query heads are
    the rows of one (G, D) matrix. Softmax in float32. Returns (B, H, 1, D)."""
    B, H, _, D = q.shape
    KVH = keys.shape[1]
    qg = (q * scale).reshape(B, KVH, H // KVH, D)  # (B, KVH, G, D)
    scores = torch.matmul(qg, keys.transpose(-1, -2))  # (B, KVH, G, S)
    if allowed is not None:  # (B, 1, 1, S)
        scores = scores.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(scores, dim=-1, dtype=torch.float32).to(values.dtype)
    return torch.matmul(p, values).reshape(B, H, 1, D)
