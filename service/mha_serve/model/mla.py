"""Multi-head latent attention (DeepSeek V2/V3, Kimi K2, GLM-4.7-Flash, MiniCPM3) as a
projection and a merge around the MQA kernel: its weights, the absorbed q, k (= v) of one kv
head of R + C dims, and the merge of each head's C output dims back to V, then wo; and, for
prompts, the expanded form (its heads decompressed from the latents) that costs fewer
multiply-adds over many query rows.

Per head h, Hugging Face's DeepseekV3Attention computes q_h = [q_nope_h (N); q_rope_h (R)]
(from q_b(rms(q_a(x))), or q(x)), the latent c and k_rope from kv_a(x) (c normalised), and
[k_nope_h (N); v_h (V)] = kv_b(c) for each head. Since q_nope_h . (W_uk_h c) = (W_uk_h^T
q_nope_h) . c and softmax @ (W_uv_h c) = W_uv_h (softmax @ c), the same attention is MQA over
q_h' = [rope(q_rope_h); W_uk_h^T q_nope_h] and one k' = [rope(k_rope); c], whose values are k'
itself (their R rope dims dropped by the merge): the cache holds R + C values per token
(K alone: AttentionConfig.values_are_keys). Without RoPE (Kimi Linear's NoPE MLA) the R dims
are the same, unrotated.

Absorbed, a decode step reads R + C values per cached token; but a prompt of T tokens then
attends over R + C dims per head (DeepSeek-V3: 576) for its scores and its values, where the
expanded heads attend over N + R (192) and V (128): about 3x the multiply-adds. So a step
with many query rows (expands) runs expanded, as vLLM and SGLang prefill: every key it reads
decompressed through kv_b, HF's attention itself; the cache still holds k'."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .cached import key_mask
from .checks import check_cached, check_head_mask
from .config import AttentionConfig
from .norm import rms_norm
from .rope import rotate, rotate_pairs

# A step runs expanded (expands) from this many query rows (a sequence's new tokens) on, and
# after cached keys only where the attention's multiply-adds it saves are at least
# EXPAND_COST times the ones decompressing those keys adds. Measured on the 2-core AMD EPYC
# (float32, 2 threads, bench/mla_prefill.py; docs/models.md "Multi-head latent attention"):
# a prompt alone pays from 32 to 64 rows with the bench's heads (C 256, R 32, N 64, V 64;
# within 3% below), about 64 with DeepSeek's (C 512, R 64, N 128, V 128; E 1024, 16 heads;
# 10 to 20% slower below, a fixed ~0.5 ms); a chunk after 512 to 2048 cached keys from about
# 100 to 150 rows (bench heads) and 250 after 1024 (DeepSeek's), where the multiply-adds
# alone say 85 and 170 over many cached keys.
EXPAND_MIN_ROWS = 64
EXPAND_COST = 1.5

# The MLA module's linears, in init_weights' draw order (q_a and q_b, or q; then kv_a, kv_b),
# and its RMSNorm gains, drawn after them.
LINEARS = ("q_a", "q_b", "q", "kv_a", "kv_b")
NORMS = ("q_a_norm", "kv_a_norm")


def expected_shapes(config: AttentionConfig) -> dict[str, tuple[int, ...]]:
    """The MLA module's state-dict keys and shapes (Hugging Face's rows: q per head [N nope;
    R rope]; kv_a [C latent; R rope]; kv_b per head [N k_nope; V v]); biases with bias on q_a
    (or q), kv_a and wo, as DeepSeek's attention_bias."""
    m, E, H = config.mla, config.embed_dim, config.num_heads
    assert m is not None
    C, R, N, V, Q = m.kv_lora_rank, m.rope_dim, m.nope_dim, m.v_head_dim, m.q_lora_rank
    shapes: dict[str, tuple[int, ...]] = {}
    if Q is None:
        shapes["q.weight"] = (H * (N + R), E)
    else:
        shapes |= {"q_a.weight": (Q, E), "q_a_norm": (Q,), "q_b.weight": (H * (N + R), Q)}
    shapes |= {
        "kv_a.weight": (C + R, E),
        "kv_a_norm": (C,),
        "kv_b.weight": (H * (N + V), C),
        "wo.weight": (E, H * V),
    }
    if config.bias:
        first = "q" if Q is None else "q_a"
        shapes |= {f"{first}.bias": shapes[f"{first}.weight"][:1], "kv_a.bias": (C + R,)}
        shapes["wo.bias"] = (E,)
    return shapes


def add_parameters(
    module: nn.Module,
    config: AttentionConfig,
    device: torch.device | str | None,
    dtype: torch.dtype | None,
) -> None:
    """Registers the MLA module's linears and norm gains (expected_shapes' keys) on module."""
    shapes = expected_shapes(config)
    for key, shape in shapes.items():
        name, _, kind = key.partition(".")
        if kind == "weight":
            out_features, in_features = shape
            has_bias = f"{name}.bias" in shapes
            linear = nn.Linear(in_features, out_features, bias=has_bias, device=device, dtype=dtype)
            setattr(module, name, linear)
        elif not kind:  # a norm's gains: a plain parameter, as q_norm
            setattr(module, name, nn.Parameter(torch.ones(shape, device=device, dtype=dtype)))


def parts(
    module: nn.Module, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What both forms share: q_nope (B, L, H, N), rope(q_rope) (B, H, L, R) and the key to
    cache k' = [rope(k_rope); c] (B, 1, L, R + C) of x (B, L, E), rotated by cos, sin
    (B|1, 1, L, R); None without RoPE (NoPE: not rotated)."""
    c = module.config
    m, H = c.mla, c.num_heads
    C, R, N = m.kv_lora_rank, m.rope_dim, m.nope_dim
    B, L, _ = x.shape
    mods, params = module._modules, module._parameters  # (as MultiHeadAttention.project)
    if m.q_lora_rank is None:
        w = mods["q"]._parameters
        q = F.linear(x, w["weight"], w["bias"])  # (B, L, H*(N+R))
    else:
        a, b = mods["q_a"]._parameters, mods["q_b"]._parameters
        q = rms_norm(F.linear(x, a["weight"], a["bias"]), params["q_a_norm"], m.eps)  # (B, L, Q)
        q = F.linear(q, b["weight"])  # (B, L, H*(N+R))
    q_nope, q_rope = q.view(B, L, H, N + R).split_with_sizes([N, R], dim=-1)  # (B, L, H, N|R)
    w = mods["kv_a"]._parameters
    latent, k_rope = F.linear(x, w["weight"], w["bias"]).split_with_sizes([C, R], dim=-1)
    latent = rms_norm(latent, params["kv_a_norm"], m.eps)  # (B, L, C)
    q_rope, k_rope = q_rope.transpose(1, 2), k_rope[:, None]  # (B, H, L, R), (B, 1, L, R)
    if c.rope is not None:
        turn = rotate_pairs if c.rope.interleaved else rotate
        q_rope, k_rope = turn(q_rope, cos, sin), turn(k_rope, cos, sin)
    k = torch.cat([k_rope, latent[:, None]], dim=-1)  # (B, 1, L, R + C)
    return q_nope, q_rope, k


def project(
    module: nn.Module, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The absorbed q (B, H, L, R + C) and k = v (B, 1, L, R + C) of x (B, L, E), their
    first R dims rotated by cos, sin (B|1, 1, L, R); None without RoPE (NoPE: not rotated)."""
    m, H = module.config.mla, module.config.num_heads
    q_nope, q_rope, k = parts(module, x, cos, sin)
    C, N = m.kv_lora_rank, m.nope_dim
    w_uk = module._modules["kv_b"]._parameters["weight"].view(H, -1, C)[:, :N]  # (H, N, C)
    q_latent = torch.einsum("blhn,hnc->bhlc", q_nope, w_uk)  # (B, H, L, C): W_uk_h^T q_nope
    q = torch.cat([q_rope, q_latent], dim=-1)  # (B, H, L, R + C)
    return q, k, k


def merge(module: nn.Module, y: torch.Tensor) -> torch.Tensor:
    """Each head's attention output y (B, H, L, R + C) (over the values k' = [rope; c]) as
    HF's concatenated heads (B, L, H * V): its C latent dims through the head's W_uv. An
    output gate multiplies these, each head's V dims (BailingHybridAttention's
    attn_output * sigmoid(g_proj(x)), after its kv_b's values), then wo (the module's
    _merge_heads)."""
    m = module.config.mla
    B, H, L, _ = y.shape
    N, V, C = m.nope_dim, m.v_head_dim, m.kv_lora_rank
    w_uv = module._modules["kv_b"]._parameters["weight"].view(H, N + V, C)[:, N:]  # (H, V, C)
    y = torch.einsum("bhlc,hvc->blhv", y[..., m.rope_dim :], w_uv)  # (B, L, H, V)
    return y.reshape(B, L, H * V)


def expanded_width(config: AttentionConfig) -> int:
    """The head width the expanded form attends over: N + R for the scores, V for the
    values, both padded with zeros to the larger (CPU SDPA's fused kernels take one head
    width for q, k and v; with V apart they fall back to its plain math, 4x slower)."""
    m = config.mla
    return max(m.nope_dim + m.rope_dim, m.v_head_dim)


def expand_queries(module: nn.Module, q_nope: torch.Tensor, q_rope: torch.Tensor) -> torch.Tensor:
    """HF's q_h = [q_nope_h; rope(q_rope_h)] of `parts` (its dims as [rope; nope], the keys'
    order here), zero-padded to expanded_width: (B, H, L, D_x)."""
    B, H, L, R = q_rope.shape
    pieces = [q_rope, q_nope.transpose(1, 2)]  # (B, H, L, R), (B, H, L, N)
    pad = expanded_width(module.config) - R - q_nope.shape[-1]
    if pad:
        pieces.append(q_rope.new_zeros(B, H, L, pad))
    return torch.cat(pieces, dim=-1)  # (B, H, L, D_x)


def expand_keys(module: nn.Module, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every head's decompressed key [rope(k_rope); W_uk_h c] and value W_uv_h c of cached
    keys k' = [rope(k_rope); c] (B, 1, S, R + C) (in their dtype: convert them first),
    each zero-padded to expanded_width: (B, H, S, D_x) and (B, H, S, D_x)."""
    m, H = module.config.mla, module.config.num_heads
    C, R, N, V = m.kv_lora_rank, m.rope_dim, m.nope_dim, m.v_head_dim
    D = expanded_width(module.config)
    B, _, S, _ = k.shape
    k_rope, latent = k.split_with_sizes([R, C], dim=-1)  # (B, 1, S, R), (B, 1, S, C)
    w_kv = module._modules["kv_b"]._parameters["weight"]  # (H*(N+V), C)
    kv = F.linear(latent[:, 0], w_kv).view(B, S, H, N + V).transpose(1, 2)  # (B, H, S, N+V)
    k_nope, v = kv.split_with_sizes([N, V], dim=-1)  # (B, H, S, N), (B, H, S, V)
    pieces = [k_rope.expand(B, H, S, R), k_nope]
    if D > N + R:
        pieces.append(k.new_zeros(B, H, S, D - N - R))
    keys = torch.cat(pieces, dim=-1)  # (B, H, S, D_x)
    values = v if D == V else torch.cat([v, v.new_zeros(B, H, S, D - V)], dim=-1)
    return keys, values


def attend_expanded(
    module: nn.Module,
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
) -> torch.Tensor:
    """SDPA of expanded queries q (B, H, L, D_x) over expanded keys and values (B, H, S,
    D_x) where mask (B|1, 1, L, S) allows (None: all, or top-left causal when causal):
    each head's output (B, H, L, V), for the merge's plain layout (no W_uv)."""
    y = F.scaled_dot_product_attention(
        q, keys, values, attn_mask=mask, is_causal=causal and mask is None, scale=module.scale
    )  # (B, H, L, D_x)
    return y[..., : module.config.mla.v_head_dim]


def expands(config: AttentionConfig, rows: int, cached_keys: int) -> bool:
    """Whether a sequence's step of `rows` new tokens over `cached_keys` keys read before
    them attends faster expanded (EXPAND_MIN_ROWS, EXPAND_COST): per head, the expanded
    form saves rows x (cached_keys + (rows + 1) / 2) x 2 (R + C - D_x) multiply-adds in the
    scores and values (causal: the mean row sees the cached keys and half the new ones) and
    adds cached_keys x C (N + V) to decompress the cached keys (the new ones' decompression
    costs what absorbing their queries and merging their outputs saves)."""
    m = config.mla
    if m is None or rows < EXPAND_MIN_ROWS:
        return False
    narrower = m.rope_dim + m.kv_lora_rank - expanded_width(config)  # (none: never pays)
    saved = rows * (cached_keys + (rows + 1) / 2) * 2 * narrower
    return saved > EXPAND_COST * cached_keys * m.kv_lora_rank * (m.nope_dim + m.v_head_dim)


def attend_cached_expanded(
    module: nn.Module,
    q: torch.Tensor,
    keys: Sequence[torch.Tensor],
    *,
    past_lengths: Sequence[int],
    new_lengths: Sequence[int],
    first_keys: Sequence[int],
    head_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """MultiHeadAttention.attend_cached's output (no weights) in the expanded form: q
    (B, H, T, D_x) the new tokens' expanded queries (project_expanded); keys[b] (1, 1, S_b,
    R + C) sequence b's cached k' at positions first_keys[b]..past_lengths[b] +
    new_lengths[b] - 1 (KVCache.read: its new tokens' written first), each decompressed in
    q's dtype. Causal, within the sliding window; (B, T, E), padded tokens' rows 0."""
    c = module.config
    H, D = c.num_heads, expanded_width(c)
    if q.dim() != 4 or q.shape[1] != H or q.shape[3] != D or not q.shape[0] or not q.shape[2]:
        raise ValueError(
            f"q must be (batch >= 1, num_heads={H}, new_len >= 1, expanded_width={D}), got "
            f"{tuple(q.shape)}"
        )
    B, _, T, _ = q.shape
    if not len(keys) == len(past_lengths) == len(new_lengths) == len(first_keys) == B:
        raise ValueError(
            f"q has batch {B} but keys, past_lengths, new_lengths and first_keys have "
            f"{len(keys)}, {len(past_lengths)}, {len(new_lengths)} and {len(first_keys)} "
            "entries"
        )
    gate = check_head_mask(c, head_mask, q)
    W, V = c.sliding_window, c.mla.v_head_dim
    ys = []
    for b, (k, past, new, first) in enumerate(
        zip(keys, past_lengths, new_lengths, first_keys, strict=True)
    ):
        check_cached(c, b, k, k, past, new, first, T, q)
        k_x, v_x = expand_keys(module, k.to(q.dtype))  # (1, H, S_b, D_x) each
        # New tokens from position 0 are plain (top-left) causal while the window holds them.
        whole = W is None or past + new - 1 - first < W
        plain = whole and past == 0 and first == 0
        mask = None if plain else key_mask(past, new, first, k.shape[2], W, q.device)
        ys.append(attend_expanded(module, q[b : b + 1, :, :new], k_x, v_x, mask, True))
    valid = None
    if all(n == T for n in new_lengths):
        y = ys[0] if B == 1 else torch.cat(ys)  # (B, H, T, V)
    else:  # padded tokens' rows zero, here and in the output
        y = q.new_zeros(B, H, T, V)
        for b, (y_b, n) in enumerate(zip(ys, new_lengths, strict=True)):
            y[b, :, :n] = y_b[0]
        valid = torch.tensor([[t < n for t in range(T)] for n in new_lengths], device=q.device)
    return module._merge_heads(y, gate, valid, None, expanded=True)  # (B, T, E)
