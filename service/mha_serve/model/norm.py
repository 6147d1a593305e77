"""The RMSNorm of q and k (Qwen3, OLMo-2, Gemma 3), of v (Gemma 3n, Gemma 4) and of MLA's
latents, in float32 as transformers computes it, and the bound on its output whatever its
input (the overflow bounds')."""

from __future__ import annotations

import math

import torch

# Over the norm's bound sqrt(n) max|w| (norm_bound), for the rounding of the float32 norm.
NORM_SLACK = 1.001
# Past this max |x| the sum of squares could overflow float32 (x^2 does from |x| ~ 1.8e19, the
# sum over n values sooner), and 1 / sqrt(inf) would make the normed q or k all zeros: finite,
# uniform attention, a wrong answer. Such rows are divided by a power of two first.
_RESCALE_ABOVE = 2.0**32


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dim, in float32 (as transformers'
    Qwen3, OLMo-2 and Gemma 3 norms), back in x's dtype; weight None: no gain (Gemma 3n's
    and Gemma 4's v_norm, Llama 4's L2Norm: x * rsqrt(mean(x^2) + eps) in float32, type_as(x)).
    A row whose max |x| is past 2^32 is
    divided by a power of two near it first (eps by its square): the same value, computed
    without x^2 overflowing; other rows are computed exactly as transformers does."""
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > _RESCALE_ABOVE, torch.exp2(torch.floor(torch.log2(amax))), 1.0)
    xf = xf / scale
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps / scale.square())
    if weight is None:
        return normed.to(x.dtype)
    return (normed * weight.float()).to(x.dtype)


def norm_bound(gain: torch.Tensor, n: int, eps: float) -> torch.Tensor:
    """max |rms(z) * gain| over n values whatever z, float64: |z_i| / sqrt(mean(z^2) + eps)
    <= sqrt(n), times max |gain| (NORM_SLACK over it for the float32 norm's rounding); inf
    where eps is 0 in float32: z = 0 (a zero token without bias) is then 0 / 0, NaN whatever
    the gain, which a kernel may turn into zero attention and a finite, wrong answer."""
    if not torch.tensor(eps, dtype=torch.float32) > 0:
        return gain.new_tensor(math.inf, dtype=torch.float64)
    return NORM_SLACK * math.sqrt(n) * gain.double().abs().max()
