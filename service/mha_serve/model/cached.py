"""The kernel of one sequence's attention over its cached keys, laid out by absolute
position (a KV cache read); MultiHeadAttention.attend_cached runs it per sequence.

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

import torch
import torch.nn.functional as F

# A lone decode token of GQA/MQA at least this deep attends by two matmuls per KV head
# (its G query heads as the rows of one matrix), reading each KV head once. The CPU SDPA
# kernel walks the keys once per query head instead: at 4096 keys, 8 query heads, it took
# 0.60 ms for MQA and 0.70 ms for GQA (2 KV heads) against 0.33 and 0.54 ms grouped; below
# ~1024 keys SDPA is as fast or faster. (2-core CPU, float32.) Only float32 keys take it:
# its products run in the keys' dtype, where SDPA keeps scores and sums in float32.
GROUPED_MIN_KEYS = 1024


def attend_one(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, past: int, scale: float
) -> torch.Tensor:
    """One sequence: q (1, H, n, D) at positions past..past+n-1 over keys, values
    (1, KVH, past+n, D), causally. Returns (1, H, n, D) in q's dtype."""
    _, H, n, _ = q.shape
    S, KVH = keys.shape[2], keys.shape[1]
    narrow = keys.dtype != q.dtype  # a cache narrower than the model (kv_cache_dtype)
    qk = q.to(keys.dtype) if narrow else q
    if n == 1 and KVH != H and S >= GROUPED_MIN_KEYS and keys.dtype == torch.float32:
        y = _grouped_decode(qk, keys, values, scale)
    else:
        # One token sees every key; n tokens from position 0 are plain (top-left) causal.
        allowed = causal_from(past, n, S, q.device) if n > 1 and past > 0 else None
        y = F.scaled_dot_product_attention(
            qk,
            keys,
            values,
            attn_mask=allowed,
            is_causal=n > 1 and past == 0,
            scale=scale,
            enable_gqa=KVH != H,
        )
    return y.to(q.dtype) if narrow else y


def causal_from(past: int, n: int, S: int, device: torch.device) -> torch.Tensor:
    """(1, 1, n, S) bool: new token t (absolute position past + t) may see key j <= past + t."""
    t = torch.arange(n, device=device)[:, None]  # (n, 1)
    j = torch.arange(S, device=device)[None, :]  # (1, S)
    return (j <= past + t)[None, None]  # (1, 1, n, S)


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
