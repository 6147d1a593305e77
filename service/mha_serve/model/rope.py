"""Rotary position embeddings (RoPE) as Hugging Face's Llama, Mistral and Qwen2 apply them:
frequencies from a RopeConfig, fixed at load time, and the rotation of q and k at absolute
positions. Frequencies follow transformers' modeling_rope_utils (default, linear, llama3,
yarn, proportional) step for step, in float32, so served outputs match transformers to rounding."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .config import QueryScaleConfig, RopeConfig


def inv_freq(rope: RopeConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """(head_dim // 2,) float32 inverse frequencies on the CPU, and the factor on cos/sin."""
    dim = head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim  # (dim/2,)
    base = rope.theta**exponents  # (dim/2,)
    freq = 1.0 / base
    if rope.type == "default":
        return freq, 1.0
    if rope.type == "linear":
        return freq / rope.factor, 1.0
    if rope.type == "llama3":
        return _llama3(freq, rope), 1.0
    if rope.type == "proportional":  # (_compute_proportional_rope_parameters)
        turned = int(rope.partial * dim // 2)  # frequencies that turn; the rest are 0
        freq = torch.cat([freq[:turned], torch.zeros(dim // 2 - turned)])
        return freq / rope.factor, 1.0
    return _yarn(base, rope, dim)


def _llama3(freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    factor, old = rope.factor, rope.original_max_position_embeddings
    low_wavelen = old / rope.low_freq_factor
    high_wavelen = old / rope.high_freq_factor
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > low_wavelen, freq / factor, freq)  # long waves: / factor
    smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(base: torch.Tensor, rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    factor, theta = rope.factor, rope.theta

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rope.attention_factor
    if not attention_factor:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = mscale(factor, rope.mscale) / mscale(factor, rope.mscale_all_dim)
        else:
            attention_factor = mscale(factor)

    def correction_dim(rotations: float) -> float:
        n = rope.original_max_position_embeddings
        return (dim * math.log(n / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # (dim/2,): 1 keeps the original frequency
    freq = (1.0 / (factor * base)) * (1 - extrapolation) + (1.0 / base) * extrapolation
    return freq, float(attention_factor)


def doubled(freq: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """(D,): each of the (D/2,) frequencies twice, [f_0 .. f_{D/2-1}, f_0 .. f_{D/2-1}], the
    layout of transformers' cat((freqs, freqs)) over the angles, made once (cos_sin);
    interleaved: [f_0, f_0, f_1, f_1, ..], the pairs' (rotate_pairs)."""
    return freq.repeat_interleave(2) if interleaved else torch.cat([freq, freq])


def cos_sin(
    freq: torch.Tensor, scaling: float, positions: torch.Tensor | int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (B, 1, L, D) in dtype for positions (B, L), or (D,) for one position
    given as an int (a lone decode step's); freq (D,) doubled(inv_freq): angles in float32,
    as transformers computes them (each position times each frequency, the halves alike),
    then rounded to the activations' dtype. The same values as transformers' in fewer ops:
    a step's rotation is a few small kernels."""
    if isinstance(positions, int):  # (exact in float32 below 2**24, as positions are)
        angles = positions * freq  # (D,)
    else:
        angles = (positions[..., None].float() * freq)[:, None]  # (B, 1, L, D)
    cos, sin = angles.cos(), angles.sin()
    if scaling != 1.0:  # (x * 1.0 is x: skipped)
        cos, sin = cos * scaling, sin * scaling
    if dtype != cos.dtype:  # (float32 angles: a float32 model's are kept as they are)
        cos, sin = cos.to(dtype), sin.to(dtype)
    return cos, sin


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, h, L, D) rotated: x * cos + rotate_half(x) * sin, rotate_half = [-x2, x1]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)  # (B, h, L, D)
    return x * cos + rotated * sin


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, h, L, D) rotated by interleaved pairs: x * cos + rotate_pairs(x) * sin with
    rotate_pairs = [-x_1, x_0, -x_3, x_2, ..] (Cohere's, GLM's, Helium's, ERNIE 4.5's
    rotate_half); cos and sin in doubled(.., interleaved=True)'s layout."""
    pairs = x.unflatten(-1, (-1, 2))  # (B, h, L, D/2, 2)
    rotated = torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(-2)
    return x * cos + rotated * sin


def rotation(rope: RopeConfig, rope_dim: int, head_dim: int) -> Callable[..., torch.Tensor]:
    """The module's rotate(x, cos, sin): the halves or the pairs of each head's first
    rope_dim dims (all of them but for a partial RoPE, whose other dims pass through)."""
    turn = rotate_pairs if rope.interleaved else rotate
    if rope_dim == head_dim:
        return turn

    def rotate_part(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return torch.cat([turn(x[..., :rope_dim], cos, sin), x[..., rope_dim:]], dim=-1)

    return rotate_part


def query_scales(qs: QueryScaleConfig, positions: torch.Tensor) -> torch.Tensor:
    """The query scale (QueryScaleConfig) at each of positions (any shape), float32, computed
    as transformers does: Llama 4's log1p(floor((p + 1.0) / floor_scale)) * attn_scale + 1.0
    (float32 true), Ministral 3's 1 + beta * log(1 + floor(p / original_max)) (otherwise)."""
    p = positions.float()
    if qs.offset:
        p = p + float(qs.offset)
    steps = torch.floor(p / qs.floor_div)
    if qs.float32:
        return torch.log1p(steps) * qs.beta + 1.0
    return 1 + qs.beta * torch.log(1 + steps)


def scale_one(qs: QueryScaleConfig, q: torch.Tensor, position: int) -> torch.Tensor:
    """q times the query scale at one position (a lone decode step's), rounded as the
    module's project rounds it: the float32 scale computed on the host (query_scales), then
    in q's dtype or (float32 true) the product in float32."""
    scale = query_scales(qs, torch.tensor(position)).item()  # (a float32 value, exactly)
    if qs.float32:
        return (q.float() * scale).to(q.dtype)
    return q * torch.tensor(scale, dtype=torch.float32).to(q.dtype).item()
