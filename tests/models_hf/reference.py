"""Checkpoints written by transformers itself (random init, save_pretrained) and its own
attention modules as the reference: the parity tests' ground truth.

transformers is a test-only dependency (the dev extra); the server never imports it."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    BertModel,
    DynamicCache,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralModel,
    Qwen2Config,
    Qwen2Model,
)

# Small, but every feature on: GQA and MQA, biases, RoPE scaling of each supported kind,
# GPT-2's per-layer scaling. initializer_range well above the default 0.02, so that heads
# attend sharply and a wrong position or head would show far above the tolerances.
INIT = 0.2
COMMON = {"vocab_size": 64, "initializer_range": INIT}
ROTARY = {
    "hidden_size": 64,
    "num_attention_heads": 8,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "max_position_embeddings": 256,
    **COMMON,
}

CHECKPOINTS = {
    # name: (model class, config, layer served)
    "gpt2": (
        GPT2LMHeadModel,
        GPT2Config(
            n_embd=64,
            n_head=4,
            n_layer=2,
            n_positions=256,
            scale_attn_by_inverse_layer_idx=True,
            **COMMON,
        ),
        1,
    ),
    "llama": (
        LlamaForCausalLM,
        LlamaConfig(
            num_key_value_heads=2,
            attention_bias=True,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            **ROTARY,
        ),
        1,
    ),
    "qwen2": (
        Qwen2Model,
        Qwen2Config(
            num_key_value_heads=4,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 1000000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            **ROTARY,
        ),
        0,
    ),
    "mistral": (
        MistralModel,
        MistralConfig(
            num_key_value_heads=1,
            sliding_window=128,
            rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
            **ROTARY,
        ),
        1,
    ),
}


def write_checkpoints(root: Path) -> dict[str, Path]:
    """Each model of CHECKPOINTS, seeded, saved by save_pretrained (safetensors)."""
    dirs = {}
    for i, (name, (cls, config, _)) in enumerate(CHECKPOINTS.items()):
        torch.manual_seed(100 + i)
        model = cls(config)
        dirs[name] = root / name
        model.save_pretrained(dirs[name], safe_serialization=True)
    return dirs


def load_reference(name: str, directory: Path):
    """transformers' model from the directory, eager attention (so weights come back)."""
    cls = BertModel if name == "minilm" else CHECKPOINTS[name][0]
    model = cls.from_pretrained(directory, attn_implementation="eager").eval()
    return getattr(model, "transformer", None) or getattr(model, "model", None) or model


def causal_mask(L: int, dtype=torch.float32) -> torch.Tensor:
    """(1, 1, L, L) additive mask as transformers builds it: 0 or the dtype's minimum."""
    blocked = torch.ones(L, L, dtype=torch.bool).triu(1)
    return torch.zeros(1, 1, L, L, dtype=dtype).masked_fill(blocked, torch.finfo(dtype).min)


@torch.no_grad()
def reference_attention(
    family: str, base, layer: int, x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' own attention of `layer` over hidden states x (B, L, E) at positions
    0..L-1: (output (B, L, E), weights (B, H, L, L)). BERT: BertSelfAttention and
    BertSelfOutput.dense (not its dropout, residual or LayerNorm), bidirectional."""
    L = x.shape[1]
    if family == "bert":
        attention = base.encoder.layer[layer].attention
        context, weights = attention.self(x, attention_mask=None)[:2]
        return attention.output.dense(context), weights
    if family == "gpt2":
        out, weights = base.h[layer].attn(x, attention_mask=causal_mask(L))[:2]
        return out, weights
    positions = torch.arange(L)[None].expand(x.shape[0], L)
    cos_sin = base.rotary_emb(x, positions)
    out, weights = base.layers[layer].self_attn(
        x, position_embeddings=cos_sin, attention_mask=causal_mask(L)
    )[:2]
    return out, weights


@torch.no_grad()
def reference_decode(
    family: str, base, layer: int, x: torch.Tensor, cuts: list[int]
) -> tuple[list[torch.Tensor], DynamicCache]:
    """transformers' own incremental path: x (1, L, E) fed in chunks [cuts[i], cuts[i+1])
    through the attention module with a DynamicCache (rotary models: RoPE at the absolute
    positions cache_position). Returns each chunk's output and the cache (keys rotated)."""
    cache = DynamicCache(config=base.config)
    outs = []
    for a, b in zip(cuts, cuts[1:], strict=False):
        pos = torch.arange(a, b)
        allowed = torch.arange(b)[None, :] <= pos[:, None]  # (b - a, b)
        mask = torch.zeros(1, 1, b - a, b).masked_fill(~allowed, torch.finfo(torch.float32).min)
        chunk = x[:, a:b]
        if family == "gpt2":
            out = base.h[layer].attn(
                chunk, past_key_values=cache, attention_mask=mask, cache_position=pos
            )[0]
        else:
            out = base.layers[layer].self_attn(
                chunk,
                position_embeddings=base.rotary_emb(chunk, pos[None]),
                attention_mask=mask,
                past_key_values=cache,
                cache_position=pos,
            )[0]
        outs.append(out)
    return outs, cache
