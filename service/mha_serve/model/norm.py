"""The RMSNorm of q and k (Qwen3, OLMo-2, Gemma 3), in float32 as transformers computes it."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dim, in float32 (as transformers'
    Qwen3, OLMo-2 and Gemma 3 norms), back in x's dtype."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.float()).to(x.dtype)
