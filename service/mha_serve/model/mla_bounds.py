"""Multi-head latent attention's overflow bounds (overflow.WeightBounds.latent): each tensor
its absorbed projection, attention and merge (model/mla.py) make, bounded by its weights and
the input's max |x|, with their proof (LatentBounds); engine/bounds.py checks them."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .norm import norm_bound


@dataclass(frozen=True)
class LatentBounds:
    """Multi-head latent attention's bounds (model/mla.py), all in the model's weights
    alone or affine in ||x||_2 <= sqrt(E) max|x| =: X, the input's only trace: a bound on each
    tensor its projection, attention and merge make, which the engine checks against the
    dtypes' limits (engine/bounds.py latent_cleared) before the step runs.

    Proof, per token x (E,) with |x_i| <= a, X = sqrt(E) a, per query head h (rows of a
    weight w_i, biases b_i; |w_i . x + b_i| <= ||w_i||_2 X + |b_i|, which bounds every partial
    sum of the product too, sum_j |w_ij| |x_j| <= ||w_i||_2 ||x||_2):
    - kv_a(x) = [u_c (C); k_rope (R)]: |.|_i <= ||w_i|| X + |b_i| (`hidden_*`, with q_a(x) or
      q(x)); rotated by RoPE, whose cos and sin carry a factor f (|cos|, |sin| <= |f|):
      |a cos - b sin| <= |f| (|a| + |b|), so each rotated element is at most rotation =
      2 max(1, |f|) times the largest one before (`k_rope_*`), and a rotated vector's L1
      norm at most 2 |f| <= rotation times its own (|a c - b s| + |a s + b c|).
    - c = rms(u_c) * g: |u_i| / sqrt(mean(u^2) + eps) <= |u_i| / sqrt(u_i^2 / C) = sqrt(C)
      whatever u (eps > 0: else u = 0 is 0 / 0), so |c_i| <= sqrt(C) max|g| (`latent`;
      rms_norm rescales a huge u first, so its float32 sum of squares never overflows).
      Likewise with q_lora_rank Q, n = rms(q_a(x)) * g_q: ||n||_2 <= sqrt(Q) max|g_q| =: n2,
      and q = q_b(n) (no bias): |q_j| <= ||w_j|| n2, the input gone. Without q_lora_rank,
      q = q(x): |q_j| <= ||w_j|| X + |b_j|. Either way |q_j| <= A_j X + B_j.
    - q's latent part W_uk_h^T q_nope_h: element c is sum_n W_uk[h, n, c] q_nope_h,n, so
      |.| <= X sum_n |W_uk[h, n, c]| A_hn + sum_n |W_uk[h, n, c]| B_hn (every partial sum
      too); its rope part rotated as k_rope. Each element of q' = [rope(q_rope); q_lat]
      is at most `q_*`; its L1 norms over the rope and the latent dims at most `rope_l1_*`
      and `latent_l1_*` (max over heads of each sum).
    - k' = v = [rope(k_rope); c]: |k'_i| <= max(k_rope bound, latent). A score against a
      new key: |q'_h . k'| <= sum_i |q'_i| |k'_i| <= ||rope(q_rope_h)||_1 max|rope(k_rope)|
      + ||q_lat_h||_1 max|c| (every partial sum too); against a cached key, of which only
      max|k'| <= K is known: <= (||.||_1 + ||.||_1) K.
    - Attention weights sum to 1, so each head's output y_h has |y_h,i| <= max|v| over the
      values it sees; the merge is W_uv_h y_lat (V x C): |.| <= max_row ||W_uv_h,v||_1 max|y|
      (`uv_l1`), and wo after it ||wo_i||_1 max|merged| + |b_o| (`o_row_l1`, `o_bias`). An
      output gate (Ling 3.0's) multiplies the merged heads by sigmoid(wgate x) in [0, 1]
      before wo, so max|merged| bounds the gated ones too: its weights are not read.
    - The expanded form (mla.expands: a prompt's heads decompressed) makes k_nope_h = W_uk_h c
      and v_h = W_uv_h c of every key it reads, |.| <= max_row ||W_uk_h,n||_1 max|c|
      (`uk_l1`) and uv_l1 max|c|, then the same scores in another order: q_nope_h . k_nope_h
      = sum_n q_n sum_c W_uk[h, n, c] c_c, every partial sum at most sum_c sum_n |W_uk[h, n,
      c]| |q_n| max|c|, the very sum `latent_l1` bounds; the rope dims' as absorbed. Its
      output, a convex combination of v_h, passes W_uv before attention rather than after:
      the same bound uv_l1 max|v| on each head's output, then wo.
    Every bound is a sum of absolute values of the very products the kernels sum, so it
    bounds them in any order and their partial sums; MARGIN covers their rounding. A weight
    that is not finite makes its bounds inf (never NaN), which nothing clears."""

    hidden_row: float  # q_a(x) (or q(x)) and kv_a(x): max ||w_i||_2 over their rows
    hidden_bias: float  # ... and max |b_i|
    hidden_fixed: float  # rms(q_a(x)) * g_q and q_b(.) with q_lora_rank: the input's not in it
    q_row: float  # max |q'| (rotated rope dims, latent dims) <= q_row X + q_bias
    q_bias: float
    k_rope_row: float  # max |rope(k_rope)| <= k_rope_row X + k_rope_bias
    k_rope_bias: float
    latent: float  # max |c| <= sqrt(C) max |g_kv|
    rope_l1_row: float  # max over heads of ||rope(q_rope_h)||_1 <= rope_l1_row X + rope_l1_bias
    rope_l1_bias: float
    latent_l1_row: float  # max over heads of ||W_uk_h^T q_nope_h||_1, likewise
    latent_l1_bias: float
    uv_l1: float  # max L1 norm of a row of any head's W_uv (V x C)
    o_row_l1: float  # max L1 norm of a row of wo
    o_bias: float
    uk_l1: float  # max L1 norm of a row of any head's W_uk (N x C): the expanded form's k_nope


@dataclass(frozen=True)
class LatentMaxima:
    """LatentBounds at one input's max |x| (latent_maxima): bounds on its tensors."""

    hidden: float  # max |.| of q_a(x) or q(x), kv_a(x), and the input-free ones before q'
    q: float  # max |q'|
    k_rope: float  # max |rope(k_rope)|
    latent: float  # max |c|
    rope_l1: float  # max over heads of ||rope(q_rope_h)||_1
    latent_l1: float  # max over heads of ||W_uk_h^T q_nope_h||_1

    @property
    def k(self) -> float:
        """max |k'| = max |v|."""
        return worst(self.k_rope, self.latent)

    def score(self, cached_absmax: float) -> float:
        """A bound on |q'_h . k'| (and its partial sums) over the new keys and over cached
        keys whose max |k'| is at most cached_absmax (LatentBounds' proof)."""
        new = self.rope_l1 * self.k_rope + self.latent_l1 * self.latent
        return worst(new, (self.rope_l1 + self.latent_l1) * cached_absmax)


def worst(*values: float) -> float:
    """The largest value, NaN where any is NaN (inf * 0 of a bound that bounds nothing;
    Python's max() keeps a NaN only where it comes first)."""
    return max(values) if all(v == v for v in values) else math.nan


def latent_maxima(x_absmax: float, embed_dim: int, lb: LatentBounds) -> LatentMaxima:
    """LatentBounds at the input max |x| = x_absmax (LatentBounds' proof)."""
    x = math.sqrt(embed_dim) * x_absmax
    return LatentMaxima(
        hidden=worst(x * lb.hidden_row + lb.hidden_bias, lb.hidden_fixed),
        q=x * lb.q_row + lb.q_bias,
        k_rope=x * lb.k_rope_row + lb.k_rope_bias,
        latent=lb.latent,
        rope_l1=x * lb.rope_l1_row + lb.rope_l1_bias,
        latent_l1=x * lb.latent_l1_row + lb.latent_l1_bias,
    )


def latent_bounds(module: torch.nn.Module, rotation: float) -> LatentBounds:
    """LatentBounds of an mla module's weights (its proof), in float64. torch's max keeps
    a NaN (a weight that is not finite), which ends as inf: Python's max() can drop one."""
    m, H = module.config.mla, module.config.num_heads
    C, R, N, V = m.kv_lora_rank, m.rope_dim, m.nope_dim, m.v_head_dim
    mods, own = module._modules, module._parameters

    def rows(name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """A linear's row L2 norms and |bias| (zeros without one), float64."""
        w, b = mods[name]._parameters["weight"].double(), mods[name]._parameters.get("bias")
        return w.norm(dim=1), w.new_zeros(w.shape[0]) if b is None else b.double().abs()

    def top(*tensors: torch.Tensor) -> torch.Tensor:
        return torch.stack([t.max() for t in tensors]).max()

    def normed(gain: torch.Tensor) -> torch.Tensor:  # (and ||.||_2 of the normed)
        return norm_bound(gain, gain.numel(), m.eps)

    kv_row, kv_bias = rows("kv_a")  # (C + R,)
    if m.q_lora_rank is None:
        q_slope, q_icept = rows("q")  # |q_j| <= q_slope_j X + q_icept_j: (H (N + R),)
        hidden = (top(kv_row, q_slope), top(kv_bias, q_icept), kv_row.new_zeros(()))
    else:
        a_row, a_bias = rows("q_a")  # (Q,)
        n2 = normed(own["q_a_norm"])  # ||rms(q_a(x)) * g_q||_2
        q_icept = rows("q_b")[0] * n2  # (H (N + R),)
        q_slope = torch.zeros_like(q_icept)
        hidden = (top(kv_row, a_row), top(kv_bias, a_bias), top(n2, q_icept))
    q_slope, q_icept = q_slope.view(H, N + R), q_icept.view(H, N + R)
    w_kv = mods["kv_b"]._parameters["weight"].double().abs().view(H, N + V, C)
    w_uk, w_uv = w_kv[:, :N], w_kv[:, N:]  # (H, N, C), (H, V, C)
    lat_slope = torch.einsum("hn,hnc->hc", q_slope[:, :N], w_uk)  # (H, C)
    lat_icept = torch.einsum("hn,hnc->hc", q_icept[:, :N], w_uk)
    rope_slope, rope_icept = q_slope[:, N:], q_icept[:, N:]  # (H, R)
    wo = mods["wo"]._parameters
    o_bias = kv_row.new_zeros(()) if wo.get("bias") is None else wo["bias"].double().abs().max()
    values = torch.stack(
        [
            *hidden,
            top(rotation * rope_slope, lat_slope),
            top(rotation * rope_icept, lat_icept),
            rotation * kv_row[C:].max(),
            rotation * kv_bias[C:].max(),
            normed(own["kv_a_norm"]),
            rotation * rope_slope.sum(dim=1).max(),
            rotation * rope_icept.sum(dim=1).max(),
            lat_slope.sum(dim=1).max(),
            lat_icept.sum(dim=1).max(),
            w_uv.sum(dim=2).max(),
            wo["weight"].double().abs().sum(dim=1).max(),
            o_bias,
            w_uk.sum(dim=2).max(),
        ]
    )
    values = values.nan_to_num(nan=math.inf, posinf=math.inf).tolist()  # (one device sync)
    return LatentBounds(*values)
