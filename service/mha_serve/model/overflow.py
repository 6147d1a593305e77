"""Whether attention scores overflow the compute dtype, decided the same way on every kernel.

Kernels treat an overflowed score differently: one CPU build's fused SDPA turns a row of
inf scores into zero attention and returns a finite, wrong output, another returns NaN.
So overflow is never read off the output. Each batch row gets a cheap bound first:
|q . k| <= sum_i |q_i| |k_i| <= head_dim * max|q| * max|k|, where the middle term also
bounds every partial sum of the dot product in any order. Only a row whose bound reaches
the dtype's largest value gets the exact check, sum_i |q_i| |k_i| in float64 for every
(query, key) pair it may attend to. A row that fails it is refused, never computed.

V needs no bound of its own: attention weights sum to 1 (less with attention sinks, whose
column is dropped), so |p @ v| <= max|v|, which is finite whenever v is; the output
projection after it is a plain GEMM, where an overflow can only end as inf or NaN, so the
caller's finiteness check of the output holds there. A sink is a logit in the softmax too,
but never a product: the explicit float32 kernel subtracts each row's largest logit (the
sink's included) first, so a finite sink keeps every row finite and scores need no bound
for it; a sink that is not finite (refused at load) makes its head's rows NaN whatever the
input, and weight_bounds then bounds no output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .mla_bounds import LatentBounds, latent_bounds
from .norm import norm_bound

# Slack over the bound for the rounding of the products and sums themselves.
MARGIN = 2.0
# Exact checks run over this many float64 scores at a time (32 MiB).
EXACT_CHUNK_ELEMENTS = 1 << 22


def row_absmax_tensor(*tensors: torch.Tensor) -> torch.Tensor:
    """(n, B) float32 on the tensors' device: max |x| over each batch row (dim 0) of each of
    the n tensors, without a device sync. NaN anywhere in a row gives NaN (amax propagates it)."""
    return torch.stack([t.abs().amax(dim=tuple(range(1, t.dim()))).float() for t in tensors])


def row_absmax(*tensors: torch.Tensor) -> list[list[float]]:
    """row_absmax_tensor as Python floats: one device sync for all of them."""
    return row_absmax_tensor(*tensors).tolist()


def score_limit(*dtypes: torch.dtype) -> float:
    """The largest score every one of these dtypes holds (the narrowest one's max)."""
    return min(torch.finfo(d).max for d in dtypes)


def bound_crossed(q_absmax: float, k_absmax: float, head_dim: int, limit: float) -> bool:
    """Whether the cheap bound cannot rule out an overflow (also for NaN/inf maxima)."""
    return not head_dim * q_absmax * k_absmax * MARGIN < limit


def scores_overflow(
    q: torch.Tensor,
    k: torch.Tensor,
    limit: float,
    *,
    first_pos: int | None,
    window: int | None = None,
    first_key: int = 0,
) -> bool:
    """The exact check for one sequence: q (H, R, D), k (KVH, S, D), H a multiple of KVH
    (query head h reads kv head h // (H / KVH)); k's keys at positions first_key.. .
    first_pos: absolute position of query row 0 for causal attention (row i sees keys up to
    first_pos + i), None for bidirectional (row i at position i, as the stateless forward
    lays it out). window: a sliding window; keys it hides from a row are not checked
    against it. True when sum_i |q_i| |k_i| reaches limit / MARGIN for a pair it may attend
    to, or any value is not finite. limit: the dtype's max over the config's score_factor
    (its scale above 1, its 1 / softcap), so that scaled and capped scores stay finite."""
    H, R, D = q.shape
    KVH, S, _ = k.shape
    G = H // KVH
    qa = q.abs().double().reshape(KVH, G, R, D)  # (KVH, G, R, D): query head h = kv*G + g
    ka = k.abs().double()  # (KVH, S, D)
    rows_per_chunk = max(1, EXACT_CHUNK_ELEMENTS // max(1, H * S))
    for r0 in range(0, R, rows_per_chunk):
        r1 = min(R, r0 + rows_per_chunk)
        q_chunk = qa[:, :, r0:r1].reshape(KVH, G * (r1 - r0), D)  # row g * n + i
        sums = q_chunk @ ka.transpose(1, 2)  # (KVH, G*n, S)
        if first_pos is not None or window is not None:
            rows = torch.arange(r0, r1, device=q.device).repeat(G)[:, None]  # (G*n, 1)
            rows = rows + (first_pos or 0)  # query positions
            cols = torch.arange(S, device=q.device)[None, :] + first_key  # (1, S) key positions
            hidden = torch.zeros_like(sums, dtype=torch.bool)
            if first_pos is not None:
                hidden |= cols > rows
            if window is not None:
                far = (
                    (rows - cols >= window)
                    if first_pos is not None
                    else ((rows - cols).abs() >= window)
                )
                hidden |= far
            sums = sums.masked_fill(hidden, 0.0)
        if not bool((sums < limit / MARGIN).all()):  # NaN compares False: refused too
            return True
    return False


class OverflowCheck:
    """Which batch rows' scores or values overflow the compute dtype, decided when read.

    The forward only queues each row's max |q|, |k|, |v| on the device and goes on; `rows()`
    waits for them (one device sync, where the caller reads the output anyway) and runs the
    exact check for the rows whose cheap bound is crossed. q (B, H, R, D), k and v
    (B, KVH, S, D); first_pos[b]: absolute position of row b's first query when causal,
    None when not; window: the sliding window (scores_overflow); limit: None, the dtypes'
    own (for a config whose score_factor is 1)."""

    __slots__ = ("_first_pos", "_k", "_limit", "_maxima", "_q", "_rows", "_window")

    def __init__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        first_pos: list[int | None],
        *,
        window: int | None = None,
        limit: float | None = None,
    ) -> None:
        self._q, self._k, self._first_pos = q, k, first_pos
        self._window, self._limit = window, limit
        self._maxima = row_absmax_tensor(q, k, v)  # (3, B), on the device: no sync
        self._rows: list[int] | None = None

    def rows(self) -> list[int]:
        """The overflowing rows (the first call waits for the device; later ones do not)."""
        if self._rows is None:
            q, k = self._q, self._k
            limit = score_limit(q.dtype, k.dtype) if self._limit is None else self._limit
            D = q.shape[-1]
            q_max, k_max, v_max = self._maxima.tolist()
            self._rows = [
                b
                for b in range(q.shape[0])
                if not v_max[b] < math.inf
                or (
                    bound_crossed(q_max[b], k_max[b], D, limit)
                    and scores_overflow(
                        q[b], k[b], limit, first_pos=self._first_pos[b], window=self._window
                    )
                )
            ]
            self._q = self._k = self._maxima = None  # the check is done: free them
        return self._rows


class NoOverflow:
    """The OverflowCheck of a forward with nothing to check (a session step's attention,
    whose engine checks its bounds itself)."""

    __slots__ = ()

    def rows(self) -> list[int]:
        return []


NO_OVERFLOW = NoOverflow()


def overflowing_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    first_pos: list[int | None],
    *,
    window: int | None = None,
    limit: float | None = None,
) -> list[int]:
    """OverflowCheck(...).rows() at once: batch rows whose scores or values overflow."""
    return OverflowCheck(q, k, v, first_pos, window=window, limit=limit).rows()


@dataclass(frozen=True)
class WeightBounds:
    """Per-model constants that bound a projection's output by its input: |w_i . x + b_i|
    <= ||w_i||_2 ||x||_2 + |b_i| for each output element i (row w_i of the weight)."""

    q_row: float  # max L2 norm of a row of Wq
    k_row: float
    v_row: float
    q_bias: float  # max |b| of the q bias (0 without bias)
    k_bias: float
    v_bias: float
    o_row_l1: float  # max L1 norm of a row of Wo: |Wo_i . y| <= ||Wo_i||_1 max|y|
    o_bias: float
    # max |rotated q or k| over max |unrotated|: RoPE's cos and sin carry its attention
    # factor (yarn's can be any number), |a f cos - b f sin| <= f (|a| + |b|) <= 2 f max.
    rotation: float = 2.0
    # With q/k RMSNorm, a bound on max |q| and |k| whatever the input (0: no norm): over n
    # values, |x_i| / sqrt(mean(x^2) + eps) <= sqrt(n), times max |weight|.
    q_norm: float = 0.0
    k_norm: float = 0.0
    # With v_norm, the bound on max |v| whatever the input: each value head's RMSNorm without a
    # gain, |v_i| <= sqrt(head_dim) (0: no value norm). Only for a v that the projection
    # leaves finite: an inf or NaN before the norm is NaN after it (engine/bounds.py checks).
    v_norm: float = 0.0
    # Multi-head latent attention's own (its other fields are then inf: bounds that bound
    # nothing, for any reader that does not know it); None without mla.
    latent: LatentBounds | None = None


# Bounds that bound nothing: nothing clears them, so every step is measured (OverflowCheck).
NO_BOUNDS = WeightBounds(*[math.inf] * 8, q_norm=math.inf, k_norm=math.inf, v_norm=math.inf)


def weight_bounds(module: torch.nn.Module) -> WeightBounds:
    """The module's WeightBounds, computed once per version of its weights (kept on the
    module, recomputed after any in-place change, a new parameter, or a new tensor under
    one: `.data = t` and module.to(dtype) keep the parameter's id and version). With mla:
    inf but for its LatentBounds. An output gate (wgate) is not read: it multiplies each head's output by
    sigmoid(wgate x), in [0, 1] (a logit past the dtype's range rounds to +-inf, whose
    sigmoid is 1 or 0: half-precision matmuls accumulate in float32, so no inf - inf NaN),
    so |gated y| <= |y| <= max|v|, the bound output_bound already takes (with mla the gate
    multiplies each head's merged output W_uv_h y_h, whose LatentBounds bound holds as well;
    one value per head or per dim, the same)."""
    # The modules' own dicts, not attribute access: nn.Module's __getattr__ costs a Python
    # call each, and this runs on every step.
    linears, own = module._modules, module._parameters
    scaling = module.__dict__.get("rope_scaling", 1.0)
    key = [scaling]
    if module.config.mla is not None:
        # (q_a and q_b, or q; kv_a, kv_b, wo: their weights and biases; the norms' gains)
        params = [p for m in linears.values() for p in m._parameters.values()]
        params += own.values()
    else:
        qkv, o = linears["wqkv"]._parameters, linears["wo"]._parameters
        # (q_norm and k_norm are registered only with q/k norm, sinks only with sinks)
        params = (
            qkv["weight"],
            qkv["bias"],
            o["weight"],
            o["bias"],
            own.get("q_norm"),
            own.get("k_norm"),
            own.get("sinks"),
        )
    for p in params:
        if p is not None:
            key += (id(p), p.data_ptr(), p.dtype, p._version)
    cached = module.__dict__.get("_overflow_bounds")
    if cached is not None and cached[0] == key:
        return cached[1]
    rotation = 2.0 * max(1.0, abs(float(scaling)))
    with torch.no_grad():
        if module.config.mla is not None:
            bounds = WeightBounds(
                *[math.inf] * 8,
                rotation,
                math.inf,
                math.inf,
                latent=latent_bounds(module, rotation),
            )
        else:
            bounds = _plain_bounds(module, rotation)
    module._overflow_bounds = (key, bounds)
    return bounds


def _plain_bounds(module: torch.nn.Module, rotation: float) -> WeightBounds:
    """weight_bounds of a module without mla (wqkv, wo, q/k norm, sinks)."""
    own = module._parameters
    c = module.config
    sizes = [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim]
    rows = module.wqkv.weight.double().norm(dim=1).split(sizes)  # (qkv_dim,) -> q, k, v
    bias = module.wqkv.bias
    biases = [0.0] * 3 if bias is None else [b.abs().max() for b in bias.double().split(sizes)]
    o_row = module.wo.weight.double().abs().sum(dim=1).max()
    sinks = own.get("sinks")
    if sinks is not None and not bool(sinks.isfinite().all()):
        o_row = math.inf  # NaN softmax rows: no output is bounded, so nothing clears
    o_bias = 0.0 if module.wo.bias is None else module.wo.bias.double().abs().max()
    norms = [0.0, 0.0]
    if c.qk_norm is not None:
        whole = c.qk_norm.scope == "projection"
        for i, (w, heads) in enumerate(
            ((module.q_norm, c.num_heads), (module.k_norm, c.num_kv_heads))
        ):
            if w is None:  # a norm without a gain (Llama 4's, nanochat's): a gain of 1
                w = torch.ones(1, dtype=torch.float64)
            n = (heads if whole else 1) * c.head_dim
            norms[i] = float(norm_bound(w, n, c.qk_norm.eps))
    v_norm = 0.0
    if c.v_norm:  # a gain of 1: sqrt(head_dim) (inf where eps is 0 in float32, as q/k's)
        v_norm = float(norm_bound(torch.ones(1, dtype=torch.float64), c.head_dim, c.qk_norm.eps))
    return WeightBounds(
        *(float(r.max()) for r in rows),
        *(float(b) for b in biases),
        float(o_row),
        float(o_bias),
        rotation,
        *norms,
        v_norm=v_norm,
    )


def projected_bounds(
    x_absmax: float, embed_dim: int, wb: WeightBounds, *, rotary: bool
) -> tuple[float, float, float]:
    """Bounds on max |q|, |k|, |v| from max |x| alone: ||x||_2 <= sqrt(E) max|x|; after a
    q/k RMSNorm (a value norm), the norm's own bound (the input drops out: the projection
    before it must still be finite, which the caller checks, engine/bounds.py). A rotation
    (RoPE) mixes element pairs: |a cos - b sin| <= |a| + |b|, so q and k bounds double,
    times the attention factor its cos and sin carry (wb.rotation)."""
    x_norm = math.sqrt(embed_dim) * x_absmax
    turn = wb.rotation if rotary else 1.0
    q = wb.q_norm or x_norm * wb.q_row + wb.q_bias
    k = wb.k_norm or x_norm * wb.k_row + wb.k_bias
    return turn * q, turn * k, wb.v_norm or x_norm * wb.v_row + wb.v_bias


def output_bound(v_absmax: float, gate_absmax: float, wb: WeightBounds) -> float:
    """max |output| <= ||Wo_i||_1 max|y| + |b_o| with |y| <= max|gate| max|v| (attention
    weights sum to 1, so each head's output is a convex combination of its values)."""
    return wb.o_row_l1 * gate_absmax * v_absmax + wb.o_bias
