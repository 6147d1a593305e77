"""Attention of new tokens over keys already laid out by absolute position (a KV cache read).

The engine writes the new tokens' K/V into the cache first and then reads each session's
positions 0..past+new-1 in order, so keys need one copy (or none, for a session whose
blocks are contiguous) instead of a gather plus a [past | new] concatenation.

A batch attends one sequence at a time, each over its own keys: views into the cache when
its blocks are consecutive (the block pool keeps them so where it can), never padded to
the longest sequence. The projections around attention, where the weights are read, stay
batched. Gathering the batch into one padded tensor instead copied every session's K/V on
every step: 64 MHA sessions of 256 tokens took 73 ms a step that way and 16 ms this way;
one session of 4000 tokens among 15 of 64, 217 ms against 5 ms (2-core CPU).
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
# ~1024 keys SDPA is as fast or faster. (2-core CPU, float32.) Only float32 keys take it:
# its products run in the keys' dtype, where SDPA keeps scores and sums in float32.
GROUPED_MIN_KEYS = 1024


def attend_cached(
    module: MultiHeadAttention,
    q: torch.Tensor,
    kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
    *,
    past_lengths: Sequence[int],
    new_lengths: Sequence[int],
    need_weights: bool = False,
    weight_heads: Sequence[int] | None = None,
    head_mask: torch.Tensor | None = None,
) -> AttentionOutput:
    """Attention of a batch of sequences, one sequence at a time over its own keys.

    q (B, H, T, D): the new tokens' queries (module.project). kv[b] = (keys, values),
    each (1, KVH, S_b, D): sequence b's positions 0..S_b-1 in order, its new tokens last,
    S_b = past_lengths[b] + new_lengths[b] (KVCache.read). Keys and values may be narrower
    than q (a bfloat16 cache for a float32 model): the queries are then rounded to their
    dtype for the fused kernels, whose softmax and sums stay float32, and the outputs come
    back in q's dtype; weights are computed in float32 from the unrounded queries.

    New token t of sequence b (absolute position past_lengths[b] + t) attends causally to
    positions 0..past_lengths[b] + t. Returns outputs (B, T, E) (rows of padded tokens 0)
    and, when asked, weights (B, len(heads), T, max S_b) float32 over absolute positions
    (columns past a sequence's end 0).
    """
    B, H, T, D = q.shape
    heads = module._check_heads(weight_heads)
    gate = module._check_head_mask(head_mask, q)
    ys, weights = [], []
    for b, ((keys, values), past, new) in enumerate(
        zip(kv, past_lengths, new_lengths, strict=True)
    ):
        if keys.shape[2] != past + new:
            raise ValueError(f"sequence {b}: {keys.shape[2]} keys for {past} + {new} positions")
        y, w = _attend_one(module, q[b : b + 1, :, :new], keys, values, past, need_weights, heads)
        ys.append(y)
        weights.append(w)
    new_valid = None
    if B == 1 and new_lengths[0] == T:
        y = ys[0]
    elif all(n == T for n in new_lengths):
        y = torch.cat(ys)  # (B, H, T, D)
    else:  # ragged: padded rows are zero here and in the output
        y = q.new_zeros(B, H, T, D)
        for b, (y_b, n) in enumerate(zip(ys, new_lengths, strict=True)):
            y[b, :, :n] = y_b[0]
        new_len = torch.tensor(list(new_lengths), device=q.device)
        new_valid = torch.arange(T, device=q.device)[None, :] < new_len[:, None]  # (B, T)
    out = module._merge_heads(y, gate, new_valid)  # (B, T, E)
    if not need_weights:
        return AttentionOutput(output=out, weights=None)
    S = max(w.shape[-1] for w in weights)
    all_w = torch.zeros(B, len(heads), T, S, dtype=torch.float32, device=q.device)
    for b, w in enumerate(weights):
        all_w[b, :, : w.shape[2], : w.shape[3]] = w[0]
    return AttentionOutput(output=out, weights=all_w)


def _attend_one(
    module: MultiHeadAttention,
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    past: int,
    need_weights: bool,
    heads: list[int],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One sequence: q (1, H, n, D) at positions past..past+n-1 over keys, values
    (1, KVH, past+n, D). Returns (1, H, n, D) and, when asked, (1, len(heads), n, past+n)."""
    _, H, n, _ = q.shape
    S, KVH = keys.shape[2], keys.shape[1]
    allowed = None  # one token sees every key; n tokens from position 0 are plain causal
    if n > 1 and past > 0:
        t = torch.arange(n, device=q.device)[:, None]  # (n, 1)
        j = torch.arange(S, device=q.device)[None, :]  # (1, S)
        allowed = (j <= past + t)[None, None]  # (1, 1, n, S)
    narrow = keys.dtype != q.dtype  # a cache narrower than the model (kv_cache_dtype)
    qk = q.to(keys.dtype) if narrow else q
    if n == 1 and KVH != H and S >= GROUPED_MIN_KEYS and keys.dtype == torch.float32:
        y = _grouped_decode(qk, keys, values, module.scale)
    else:
        y = F.scaled_dot_product_attention(
            qk,
            keys,
            values,
            attn_mask=allowed,
            is_causal=n > 1 and past == 0,  # top-left aligned: exactly ours when past == 0
            scale=module.scale,
            enable_gqa=KVH != H,
        )
    if narrow:
        y = y.to(q.dtype)
    w = None
    if need_weights:
        if n > 1 and allowed is None:
            allowed = torch.ones(n, S, dtype=torch.bool, device=q.device).tril()[None, None]
        w = module._softmax(q, keys, heads, allowed)  # (1, len(heads), n, S)
    return y, w


def _grouped_decode(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention of one token, q (1, H, 1, D), over keys, values (1, KVH, S, D) with
    H = KVH * G (query head h reads KV head h // G): each KV head's G query heads are the
    rows of one (G, D) matrix. Softmax in float32. Returns (1, H, 1, D)."""
    _, H, _, D = q.shape
    KVH = keys.shape[1]
    qg = (q * scale).reshape(1, KVH, H // KVH, D)  # (1, KVH, G, D)
    scores = torch.matmul(qg, keys.transpose(-1, -2))  # (1, KVH, G, S)
    p = torch.softmax(scores, dim=-1, dtype=torch.float32).to(values.dtype)
    return torch.matmul(p, values).reshape(1, H, 1, D)
