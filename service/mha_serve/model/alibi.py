"""ALiBi (attention with linear biases, Press et al.; BLOOM, MPT): each query head h adds
slope_h * (key position - query position) to its scores before the softmax, no position in
q or k. The same softmax as slope_h * key position (the form transformers' BLOOM adds: a
row's constant shifts nothing), but small where the weight is (near the query), so float32
keeps it exact however long the session; positions are absolute (a session's, not a
chunk's). Only the explicit float32 kernel adds it (cached.explicit_attention): SDPA takes
no per-head bias without a materialised (B, H, R, S) mask."""

from __future__ import annotations

import math

import torch


def alibi_slopes(num_heads: int, bias_max: float = 8.0) -> torch.Tensor:
    """(H,) float32 slopes, as transformers' build_alibi_tensor (BLOOM, bias_max 8) and
    build_mpt_alibi_tensor (MPT's alibi_bias_max) make them: for n = 2^ceil(log2 H) heads,
    slope h (1..n) is 2^(-bias_max * h / n). H a power of 2 takes them all; otherwise the
    even-numbered ones (the slopes of the power of 2 below H) come first, then the
    odd-numbered ones, the first H of those (BLOOM's extra_base ** odd powers)."""
    n = 2 ** math.ceil(math.log2(num_heads))
    slopes = [2.0 ** (-bias_max * h / n) for h in range(1, n + 1)]
    if n != num_heads:
        slopes = (slopes[1::2] + slopes[0::2])[:num_heads]
    return torch.tensor(slopes, dtype=torch.float32)


def alibi_bias(
    slopes: torch.Tensor, query_pos: torch.Tensor, key_pos: torch.Tensor
) -> torch.Tensor:
    """slopes (n,) float32, query_pos (B|1, R) and key_pos (B|1, S) absolute positions:
    slope_h * (key_pos[j] - query_pos[i]) in float32, (B|1, n, R, S)."""
    rel = (key_pos[:, None, :] - query_pos[:, :, None]).float()  # (B|1, R, S)
    return slopes.view(1, -1, 1, 1) * rel[:, None]  # (B|1, n, R, S)


def positions(start: int, count: int, device: torch.device) -> torch.Tensor:
    """(1, count): positions start..start + count - 1."""
    return torch.arange(start, start + count, device=device)[None]
