"""MHA -> GQA / MQA: mean-pool each group's key and value heads (the GQA paper's starting
point for uptraining, Ainslie et al. 2023, section 2.1), write the result as our
safetensors checkpoint and report what it costs and saves.

    python -m mha_serve.model.convert SRC --num-kv-heads 2 --out gqa.safetensors [--layer N]

SRC is a Hugging Face model directory (with --layer) or one of our safetensors files. The
report (JSON on stdout): output error of the converted layer against the original on
sample inputs, and the KV-cache bytes per token before and after. Serve the result with
`checkpoint = "gqa.safetensors"` (its config, RoPE included, is in the file's metadata).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

from .attention import MultiHeadAttention
from .hf import load_hf_layer
from .hf_config import is_hf_directory
from .weights import load_checkpoint, save_checkpoint

DEFAULT_SAMPLES = 8
DEFAULT_SEQ_LEN = 64


def pool_kv_heads(module: MultiHeadAttention, num_kv_heads: int) -> MultiHeadAttention:
    """A copy of module with num_kv_heads K/V heads, each the mean of a group of
    consecutive K/V heads (query head h keeps reading group h // (H / num_kv_heads)).
    Projections are linear (and RoPE rotates every head alike), so pooling the weights and
    biases pools the keys and values themselves."""
    c = module.config
    KVH, D = c.num_kv_heads, c.head_dim
    if num_kv_heads < 1 or KVH % num_kv_heads:
        raise ValueError(
            f"num_kv_heads {num_kv_heads} must divide the model's {KVH} key/value heads "
            f"(and so its {c.num_heads} query heads)"
        )
    config = dataclasses.replace(c, num_kv_heads=num_kv_heads)
    w = module.wqkv.weight.detach()
    q_rows = c.num_heads * D
    wq, wk, wv = w.split([q_rows, KVH * D, KVH * D])

    def pool(t: torch.Tensor) -> torch.Tensor:  # (KVH * D, ...) -> (num_kv_heads * D, ...)
        tail = t.shape[1:]
        g = t.reshape(num_kv_heads, KVH // num_kv_heads, D, *tail)  # (G, KVH/G, D, ...)
        return g.float().mean(dim=1).to(t.dtype).reshape(num_kv_heads * D, *tail)

    state = {
        "wqkv.weight": torch.cat([wq, pool(wk), pool(wv)]),
        "wo.weight": module.wo.weight.detach(),
    }
    if c.bias:
        bq, bk, bv = module.wqkv.bias.detach().split([q_rows, KVH * D, KVH * D])
        state["wqkv.bias"] = torch.cat([bq, pool(bk), pool(bv)])
        state["wo.bias"] = module.wo.bias.detach()
    w0 = module.wqkv.weight
    out = MultiHeadAttention(config, device=w0.device, dtype=w0.dtype)
    out.load_state_dict(state)
    return out.eval()


def conversion_report(
    original: MultiHeadAttention,
    converted: MultiHeadAttention,
    inputs: torch.Tensor,
) -> dict[str, float | int]:
    """Output error of converted against original over inputs (B, L, E), each model's
    own masking, and the KV-cache bytes per token of each (K and V, model dtype)."""
    with torch.no_grad():
        want = original(inputs).output.double()
        got = converted(inputs).output.double()
    diff = (got - want).abs()
    itemsize = original.wqkv.weight.element_size()

    def per_token(m: MultiHeadAttention) -> int:
        return 2 * m.config.num_kv_heads * m.config.head_dim * itemsize

    before, after = per_token(original), per_token(converted)
    return {
        "num_kv_heads_before": original.config.num_kv_heads,
        "num_kv_heads_after": converted.config.num_kv_heads,
        "max_abs_error": float(diff.max()),
        "mean_abs_error": float(diff.mean()),
        "relative_error": float(diff.norm() / want.norm().clamp_min(1e-30)),
        "output_rms": float(want.pow(2).mean().sqrt()),
        "kv_bytes_per_token_before": before,
        "kv_bytes_per_token_after": after,
        "kv_bytes_saved_fraction": 1.0 - after / before,
    }


def load_source(path: str | Path, layer: int | None) -> MultiHeadAttention:
    """A Hugging Face directory's layer, or one of our checkpoints; float32 on the CPU."""
    if is_hf_directory(path):
        module, _ = load_hf_layer(path, layer, dtype=torch.float32)
        return module
    if layer is not None:
        raise ValueError(f"--layer is for a Hugging Face model directory; {path} is a file")
    return load_checkpoint(path, dtype=torch.float32)


def sample_inputs(
    embed_dim: int, samples: int, seq_len: int, seed: int, inputs: str | None
) -> torch.Tensor:
    """(B, L, E) float32: from a .npy file ((L, E) or (B, L, E)), else standard normal."""
    if inputs:
        import numpy as np

        x = torch.from_numpy(np.load(inputs)).float()
        x = x[None] if x.dim() == 2 else x
        if x.dim() != 3 or x.shape[-1] != embed_dim:
            raise ValueError(f"{inputs} holds shape {tuple(x.shape)}; need (B, L, {embed_dim})")
        return x
    g = torch.Generator().manual_seed(seed)
    return torch.randn(samples, seq_len, embed_dim, generator=g)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m mha_serve.model.convert",
        description="Convert an attention layer to GQA/MQA by mean-pooling K/V heads.",
    )
    p.add_argument("source", help="Hugging Face model directory, or our .safetensors file")
    p.add_argument("--layer", type=int, default=None, help="layer of a Hugging Face directory")
    p.add_argument("--num-kv-heads", type=int, required=True, help="1 = MQA; a divisor = GQA")
    p.add_argument("--out", required=True, help="output .safetensors file (ours)")
    p.add_argument("--samples", type=int, default=DEFAULT_SAMPLES, help="random sample inputs")
    p.add_argument("--seq-len", type=int, default=DEFAULT_SEQ_LEN)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--inputs", default=None, help=".npy of sample inputs (L, E) or (B, L, E)")
    args = p.parse_args(argv)
    try:
        original = load_source(args.source, args.layer)
        converted = pool_kv_heads(original, args.num_kv_heads)
        x = sample_inputs(
            original.config.embed_dim, args.samples, args.seq_len, args.seed, args.inputs
        )
        report = conversion_report(original, converted, x)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    save_checkpoint(converted, args.out)
    report["out"] = str(args.out)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
