"""ALiBi (attention with linear biases, Press et al.; BLOOM, MPT, Falcon-RW): each query head
h adds slope_h * (key position - query position) to its scores before the softmax, no
position in q or k. The same softmax as slope_h * key position (the form transformers' BLOOM
adds: a row's constant shifts nothing), but small where the weight is (near the query), so
float32 keeps it exact however long the session; positions are absolute (a session's, not a
chunk's). Falcon-RW's form: slope * position rounded to bfloat16 (its build_alibi_tensor),
and the bias scaled by the scores' factor (added to q . k before both are scaled). The
explicit float32 kernel adds it to its scores (cached.explicit_attention); on the CPU, over
more than one query row, SDPA's fused kernel takes it as a float32 mask built per chunk of
rows (cached.alibi_by_sdpa); weights, decode steps and CUDA stay explicit."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class AlibiSlopes:
    """A model's ALiBi, as its module keeps it (not a buffer: derived from the config, not
    in the state dict): each query head's slope and how its bias is formed."""

    slopes: torch.Tensor  # (H,) float32, alibi_slopes'
    scale: float = 1.0  # the factor on the bias (AttentionConfig.alibi_scale)
    bfloat16: bool = False  # slope * position in bfloat16 (AttentionConfig.alibi_bfloat16)

    def to(self, device: torch.device | str) -> AlibiSlopes:
        return replace(self, slopes=self.slopes.to(device))

    def heads(self, idx: torch.Tensor) -> AlibiSlopes:
        """The query heads idx's."""
        return replace(self, slopes=self.slopes[idx])


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


def alibi_bias(alibi: AlibiSlopes, query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
    """alibi over n heads, query_pos (B|1, R) and key_pos (B|1, S) absolute positions:
    slope_h * (key_pos[j] - query_pos[i]) in float32, (B|1, n, R, S); with bfloat16,
    b(key_pos[j]) - b(query_pos[i]) where b(p) is bfloat16(slope_h) * p in bfloat16, the op
    Falcon's build_alibi_tensor runs (each term a bfloat16 value: their difference is exact
    in float32); times scale."""
    if alibi.bfloat16:
        slopes = alibi.slopes.bfloat16().view(1, -1, 1)  # (1, n, 1)
        at_key = (slopes * key_pos[:, None, :]).float()  # (B|1, n, S): bf16 * int64 -> bf16
        at_query = (slopes * query_pos[:, None, :]).float()  # (B|1, n, R)
        bias = at_key[:, :, None, :] - at_query[:, :, :, None]  # (B|1, n, R, S)
    else:
        rel = (key_pos[:, None, :] - query_pos[:, :, None]).float()  # (B|1, R, S)
        bias = alibi.slopes.view(1, -1, 1, 1) * rel[:, None]  # (B|1, n, R, S)
    return bias if alibi.scale == 1.0 else bias * alibi.scale


def positions(start: int, count: int, device: torch.device) -> torch.Tensor:
    """(1, count): positions start..start + count - 1."""
    return torch.arange(start, start + count, device=device)[None]
