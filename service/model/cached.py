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


def attend_cached(
    module: MultiHeadAttention,
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    *,
    past_lengths: torch.Tensor,
    new_lengths: torch.Tensor,
    need_weights: bool = False,
    weight_heads: Sequence[int] | None = None,
    head_mask: torch.Tensor | None = None,
) -> AttentionOutput:
    """q (B, H, T, D): the new tokens' queries (module.project); keys, values (B, KVH, S, D):
    each sequence's positions 0..past+new-1 in order (new tokens included), padding after.

    New token t of sequence b (absolute position past_lengths[b] + t) attends causally to
    positions 0..past_lengths[b] + t. past_lengths, new_lengths: (B,) int64 on q's device.
    Returns outputs (B, T, E) (rows of padded tokens 0) and, when asked, weights
    (B, len(heads), T, S) float32 over absolute positions (columns past the end 0).
    """
    B, H, T, _ = q.shape
    S = keys.shape[2]
    KVH = module.config.num_kv_heads
    heads = module._check_heads(weight_heads)
    gate = module._check_head_mask(head_mask, q)
    total = past_lengths + new_lengths  # (B,)
    padded_new = bool((new_lengths < T).any())
    new_valid = None
    if padded_new:
        new_valid = torch.arange(T, device=q.device)[None, :] < new_lengths[:, None]  # (B, T)
    # One decode token seeing every key needs no mask at all (the common case).
    allowed = None
    if T > 1 or bool((total < S).any()):
        t = torch.arange(T, device=q.device)[None, :, None]  # (1, T, 1)
        j = torch.arange(S, device=q.device)[None, None, :]  # (1, 1, S)
        # Padded rows keep their causal keys (never an all-masked row); they are zeroed below.
        allowed = ((j <= past_lengths[:, None, None] + t) & (j < total[:, None, None]))[:, None]
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
