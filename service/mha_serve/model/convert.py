"""A smaller model from one layer: MHA -> GQA / MQA by mean-pooling each group's key and
value heads (the GQA paper's starting point for uptraining, Ainslie et al. 2023, section
2.1), or chosen heads removed (model/prune.py); written as our safetensors checkpoint, with
a report of what it costs and saves.

    python -m mha_serve.model.convert SRC --num-kv-heads 2 --out gqa.safetensors [--layer N]
    python -m mha_serve.model.convert SRC --drop-heads 5,8 --out pruned.safetensors
    python -m mha_serve.model.convert SRC --drop-least-important 3 [--unit head|group]
        [--report heads.json] --out pruned.safetensors

SRC is a Hugging Face model directory (with --layer), one of our safetensors files, or a
torch.nn.MultiheadAttention state_dict saved with safetensors (with --num-heads). The
least important heads come from the head analysis over the sample inputs (the one the
server's AnalyzeHeads runs), or from a saved `mha-client heads --json` report. The report
(JSON on stdout): output error of the new layer against the original on sample inputs
(and, pruned, against the original with those heads masked: rounding only), heads, and
the compute and KV-cache bytes per token before and after. Serve the result with
`checkpoint = "out.safetensors"` (its config, the family's options included, is in the
file's metadata).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from .attention import MultiHeadAttention
from .config import AttentionConfig
from .heads import analyze_heads, group_importance
from .hf import load_hf_layer
from .hf_config import is_hf_directory
from .prune import UNITS, cost_per_token, default_unit, least_important, prune_heads
from .weights import load_checkpoint, save_checkpoint

DEFAULT_SAMPLES = 8
DEFAULT_SEQ_LEN = 64


def pool_kv_heads(module: MultiHeadAttention, num_kv_heads: int) -> MultiHeadAttention:
    """A copy of module with num_kv_heads K/V heads, each the mean of a group of
    consecutive K/V heads (query head h keeps reading group h // (H / num_kv_heads)).
    Projections are linear (and RoPE rotates every head alike), so pooling the weights and
    biases pools the keys and values themselves; with a q/k norm the pooled keys are
    normalised after pooling (exact still where a group's heads agree), and a norm over the
    whole projection (OLMo-2) pools its k gains by group too."""
    c = module.config
    KVH, D = c.num_kv_heads, c.head_dim
    if c.mla is not None:
        raise ValueError(
            "this model is multi-head latent attention (mla): all of its query heads already "
            "share one latent K/V head, so there is nothing to pool"
        )
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
    if c.qk_norm is not None and c.qk_norm.gain:
        k_norm = module.k_norm.detach()
        state["q_norm"] = module.q_norm.detach()
        state["k_norm"] = pool(k_norm) if c.qk_norm.scope == "projection" else k_norm
    if c.sinks:  # one per query head, and the query heads stay
        state["sinks"] = module.sinks.detach()
    if c.output_gate:  # per query head too (it gates each head's output): unchanged
        state["wgate.weight"] = module.wgate.weight.detach()
        if c.bias:
            state["wgate.bias"] = module.wgate.bias.detach()
    w0 = module.wqkv.weight
    out = MultiHeadAttention(config, device=w0.device, dtype=w0.dtype)
    out.load_state_dict(state)
    return out.eval()


def conversion_report(
    original: MultiHeadAttention,
    converted: MultiHeadAttention,
    inputs: torch.Tensor,
    *,
    removed: list[int] | None = None,
) -> dict[str, float | int | list[int]]:
    """Output error of converted against original over inputs (B, L, E), each model's
    own masking; heads, compute and KV-cache bytes per token of each (cost_per_token, model
    dtype). removed: the query heads pruned away; the report then also gives converted's
    difference from original with those heads masked (rounding only, when it is right)."""
    with torch.no_grad():
        want = original(inputs).output.double()
        got = converted(inputs).output.double()
    diff = (got - want).abs()
    itemsize = original.wo.weight.element_size()
    before = cost_per_token(original.config, itemsize)
    after = cost_per_token(converted.config, itemsize)
    report: dict[str, float | int | list[int]] = {
        "num_heads_before": original.config.num_heads,
        "num_heads_after": converted.config.num_heads,
        "num_kv_heads_before": original.config.num_kv_heads,
        "num_kv_heads_after": converted.config.num_kv_heads,
        "max_abs_error": float(diff.max()),
        "mean_abs_error": float(diff.mean()),
        "relative_error": float(diff.norm() / want.norm().clamp_min(1e-30)),
        "output_rms": float(want.pow(2).mean().sqrt()),
        "kv_bytes_per_token_before": before["kv_bytes"],
        "kv_bytes_per_token_after": after["kv_bytes"],
        "kv_bytes_saved_fraction": 1.0 - after["kv_bytes"] / before["kv_bytes"],
        "projection_flops_per_token_before": before["projection_flops"],
        "projection_flops_per_token_after": after["projection_flops"],
        "attention_flops_per_key_before": before["attention_flops_per_key"],
        "attention_flops_per_key_after": after["attention_flops_per_key"],
    }
    if removed is not None:
        gate = torch.ones(original.config.num_heads, dtype=inputs.dtype)
        gate[removed] = 0
        with torch.no_grad():
            masked = original(inputs, head_mask=gate).output.double()
        report["heads_removed"] = sorted(removed)
        report["max_abs_diff_from_masked"] = float((got - masked).abs().max())
    return report


def heads_from_report(path: str | Path) -> list[float]:
    """Each query head's importance from a `mha-client heads --json` report."""
    try:
        data = json.loads(Path(path).read_text())
        heads = sorted(data["heads"], key=lambda h: h["head"])
        return [float(h["importance"]) for h in heads]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(
            f"{path} is not a head report (mha-client heads --json writes one): {e}"
        ) from None


def heads_to_drop(
    module: MultiHeadAttention,
    k: int,
    unit: str | None,
    inputs: torch.Tensor,
    report: str | None = None,
) -> list[int]:
    """The query heads of "drop the k least important" (prune.least_important), ranked by
    the head analysis of module over inputs, or by a saved report's importance."""
    c = module.config
    unit = unit or default_unit(c)
    if report is not None:
        if unit == "group" and c.group_size > 1:
            raise ValueError(
                "a head report ranks query heads, not KV groups: use --unit head, or leave "
                "--report out to rank groups over the sample inputs"
            )
        importance = heads_from_report(report)
        groups = importance if c.group_size == 1 else None
    else:
        importance = analyze_heads(module, inputs).importance
        groups = group_importance(module, inputs) if unit == "group" else None
    return least_important(c, k, unit=unit, importance=importance, group_importance=groups)


def load_source(
    path: str | Path, layer: int | None, num_heads: int | None = None
) -> MultiHeadAttention:
    """A Hugging Face directory's layer, one of our checkpoints, or a torch.nn.MultiheadAttention
    state_dict file (which does not store num_heads: given); float32 on the CPU."""
    if not Path(path).exists():
        raise ValueError(f"source {path} does not exist")
    if is_hf_directory(path):
        if num_heads is not None:
            raise ValueError(
                "--num-heads is for a torch.nn.MultiheadAttention file; the "
                f"directory {path}'s config.json gives its heads"
            )
        module, _ = load_hf_layer(path, layer, dtype=torch.float32)
        return module
    if layer is not None:
        raise ValueError(f"--layer is for a Hugging Face model directory; {path} is a file")
    return load_checkpoint(path, config=torch_mha_config(path, num_heads), dtype=torch.float32)


def torch_mha_config(path: str | Path, num_heads: int | None) -> AttentionConfig | None:
    """The config of a torch.nn.MultiheadAttention state_dict file, which stores every shape
    but num_heads (and so needs it); None for one of our files, which carry their own."""
    try:
        with safe_open(str(path), "pt") as f:
            keys = set(f.keys())
            shape = f.get_slice("in_proj_weight").get_shape() if "in_proj_weight" in keys else None
    except (OSError, SafetensorError):
        return None  # load_checkpoint says what is wrong with the file
    if shape is None:
        if num_heads is not None:
            raise ValueError(
                f"--num-heads is for a torch.nn.MultiheadAttention state_dict file; {path} is "
                "one of ours, whose metadata gives its heads: leave --num-heads out"
            )
        return None
    if num_heads is None:
        raise ValueError(
            f"{path} holds a torch.nn.MultiheadAttention state_dict, which does not store its "
            "number of heads: give it with --num-heads N"
        )
    return AttentionConfig(embed_dim=shape[1], num_heads=num_heads, bias="in_proj_bias" in keys)


def sample_inputs(
    embed_dim: int, samples: int, seq_len: int, seed: int, inputs: str | None
) -> torch.Tensor:
    """(B, L, E) float32: from a .npy file ((L, E) or (B, L, E)), else standard normal."""
    if inputs:
        import numpy as np

        try:
            x = torch.from_numpy(np.load(inputs, allow_pickle=False)).float()
        except (OSError, ValueError, TypeError) as e:
            raise ValueError(
                f"--inputs {inputs} is not a .npy array of (L, {embed_dim}) or "
                f"(B, L, {embed_dim}) floats: {e}"
            ) from None
        x = x[None] if x.dim() == 2 else x
        if x.dim() != 3 or x.shape[-1] != embed_dim:
            raise ValueError(f"{inputs} holds shape {tuple(x.shape)}; need (B, L, {embed_dim})")
        return x
    g = torch.Generator().manual_seed(seed)
    return torch.randn(samples, seq_len, embed_dim, generator=g)


def check_out(out: str | Path, source: str | Path) -> None:
    """Refuses, before any work, an --out that cannot be written or would overwrite what
    the source is read from (the source file, a safetensors file of its directory)."""
    out, source = Path(out), Path(source)
    if out.is_dir():
        raise ValueError(f"--out {out} is a directory; name a .safetensors file")
    if not out.parent.is_dir():
        raise ValueError(f"--out {out}: directory {out.parent} does not exist")
    read = sorted(source.glob("*.safetensors")) if source.is_dir() else [source]
    if out.exists() and any(f.exists() and out.samefile(f) for f in read):
        raise ValueError(
            f"--out {out} is the source's own weights file: writing it would destroy the "
            "model converted from; name another file"
        )


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m mha_serve.model.convert",
        description="Write a smaller attention layer: GQA/MQA by mean-pooling K/V heads, or "
        "heads removed (a list, or the least important ones of the head analysis).",
    )
    p.add_argument("source", help="Hugging Face model directory, or our .safetensors file")
    p.add_argument("--layer", type=int, default=None, help="layer of a Hugging Face directory")
    p.add_argument(
        "--num-heads",
        type=_positive,
        default=None,
        help="heads of a torch.nn.MultiheadAttention state_dict file (it does not store them)",
    )
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--num-kv-heads", type=int, help="1 = MQA; a divisor = GQA")
    what.add_argument("--drop-heads", help="query heads to remove, comma-separated: 5,8")
    what.add_argument(
        "--drop-least-important", type=int, metavar="K", help="remove the K least important"
    )
    p.add_argument(
        "--unit",
        choices=UNITS,
        default=None,
        help="with --drop-least-important: K query heads, or K whole KV groups (default: "
        "groups for GQA, heads otherwise)",
    )
    p.add_argument("--report", default=None, help="a `mha-client heads --json` report to rank by")
    p.add_argument("--out", required=True, help="output .safetensors file (ours)")
    p.add_argument(
        "--samples", type=_positive, default=DEFAULT_SAMPLES, help="random sample inputs"
    )
    p.add_argument("--seq-len", type=_positive, default=DEFAULT_SEQ_LEN)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--inputs", default=None, help=".npy of sample inputs (L, E) or (B, L, E)")
    args = p.parse_args(argv)
    if (args.unit or args.report) and args.drop_least_important is None:
        p.error("--unit and --report go with --drop-least-important")
    try:
        check_out(args.out, args.source)
        original = load_source(args.source, args.layer, args.num_heads)
        x = sample_inputs(
            original.config.embed_dim, args.samples, args.seq_len, args.seed, args.inputs
        )
        removed = None
        if args.num_kv_heads is not None:
            converted = pool_kv_heads(original, args.num_kv_heads)
        else:
            if args.drop_heads is not None:
                removed = _int_list(args.drop_heads)
            else:
                removed = heads_to_drop(
                    original, args.drop_least_important, args.unit, x, args.report
                )
            converted = prune_heads(original, removed)
        report = conversion_report(original, converted, x, removed=removed)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:  # safetensors writes a temporary file and renames it: nothing half-written
        save_checkpoint(converted, args.out)
    except (OSError, SafetensorError) as e:
        print(f"error: cannot write {args.out}: {e}", file=sys.stderr)
        return 1
    report["out"] = str(args.out)
    print(json.dumps(report, indent=2))
    return 0


def _int_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--drop-heads takes comma-separated head numbers, got {text!r}") from None


if __name__ == "__main__":
    sys.exit(main())
