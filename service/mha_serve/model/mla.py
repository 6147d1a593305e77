"""Multi-head latent attention (DeepSeek V2/V3, Kimi K2, GLM-4.7-Flash, MiniCPM3) as a
projection and a merge around the MQA kernel: its weights, the absorbed q, k (= v) of one kv
head of R + C dims, and the merge of each head's C output dims back to V, then wo.

Per head h, Hugging Face's DeepseekV3Attention computes q_h = [q_nope_h (N); q_rope_h (R)]
(from q_b(rms(q_a(x))), or q(x)), the latent c and k_rope from kv_a(x) (c normalised), and
[k_nope_h (N); v_h (V)] = kv_b(c) for each head. Since q_nope_h . (W_uk_h c) = (W_uk_h^T
q_nope_h) . c and softmax @ (W_uv_h c) = W_uv_h (softmax @ c), the same attention is MQA over
q_h' = [rope(q_rope_h); W_uk_h^T q_nope_h] and one k' = [rope(k_rope); c], whose values are k'
itself (their R rope dims dropped by the merge): the cache holds R + C values per token
(K alone: AttentionConfig.values_are_keys). Without RoPE (Kimi Linear's NoPE MLA) the R dims
are the same, unrotated."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import AttentionConfig
from .norm import rms_norm
from .rope import rotate, rotate_pairs

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


def project(
    module: nn.Module, x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The absorbed q (B, H, L, R + C) and k = v (B, 1, L, R + C) of x (B, L, E), their
    first R dims rotated by cos, sin (B|1, 1, L, R); None without RoPE (NoPE: not rotated)."""
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
    w_uk = mods["kv_b"]._parameters["weight"].view(H, -1, C)[:, :N]  # (H, N, C)
    q_latent = torch.einsum("blhn,hnc->bhlc", q_nope, w_uk)  # (B, H, L, C): W_uk_h^T q_nope
    q_rope, k_rope = q_rope.transpose(1, 2), k_rope[:, None]  # (B, H, L, R), (B, 1, L, R)
    if c.rope is not None:
        turn = rotate_pairs if c.rope.interleaved else rotate
        q_rope, k_rope = turn(q_rope, cos, sin), turn(k_rope, cos, sin)
    q = torch.cat([q_rope, q_latent], dim=-1)  # (B, H, L, R + C)
    k = torch.cat([k_rope, latent[:, None]], dim=-1)  # (B, 1, L, R + C)
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
