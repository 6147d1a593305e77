"""The RMSNorm of q and k (Qwen3, OLMo-2, Gemma 3), in float32 as transformers computes it."""

from __future__ import annotations

import torch

# Past this max |x| the sum of squares could overflow float32 (x^2 does from |x| ~ 1.8e19, the
# sum over n values sooner), and 1 / sqrt(inf) would make the normed q or k all zeros: finite,
# uniform attention, a wrong answer. Such rows are divided by a power of two first.
_RESCALE_ABOVE = 2.0**32


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dim, in float32 (as transformers'
    Qwen3, OLMo-2 and Gemma 3 norms), back in x's dtype. A row whose max |x| is past 2^32 is
    divided by a power of two near it first (eps by its square): the same value, computed
    without x^2 overflowing; other rows are computed exactly as transformers does."""
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > _RESCALE_ABOVE, torch.exp2(torch.floor(torch.log2(amax))), 1.0)
    xf = xf / scale
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps / scale.square())
    return (normed * weight.float()).to(x.dtype)
