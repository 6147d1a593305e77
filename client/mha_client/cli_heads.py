"""`mha-client heads`: which heads of a model matter over an input (AnalyzeHeads)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from mha_client.cli_types import int_list, positive_int, read_input
from mha_client.heads import HeadReport, analyze_heads, save_pruning_curve
from mha_client.heatmap import require_matplotlib, save_heatmap
from mha_client.sdk import Client


def add_heads_command(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    heads = sub.add_parser(
        "heads",
        parents=[common],
        help="per-head entropy, peak weight, importance and a pruning curve",
    )
    heads.add_argument("model", help="model name, as `mha-client models` lists")
    source = heads.add_mutually_exclusive_group(required=True)
    source.add_argument("--input", type=Path, metavar="FILE.npy", help="(L, E) or (B, L, E) floats")
    source.add_argument(
        "--random",
        "--random-shape",  # attend's name for it (there B,L or L: here one sequence, L)
        dest="random",
        type=positive_int,
        metavar="L",
        help="one random normal sequence of L tokens (--random-shape L, as attend says, too)",
    )
    heads.add_argument("--seed", type=int, default=0, help="seed for --random")
    heads.add_argument(
        "--lengths",
        type=int_list,
        metavar="N,N,...",
        help="real length of each sequence; the rest is padding",
    )
    mode = heads.add_mutually_exclusive_group()
    mode.add_argument("--causal", dest="causal", action="store_const", const=True)
    mode.add_argument("--bidirectional", dest="causal", action="store_const", const=False)
    heads.add_argument(
        "--png",
        metavar="PREFIX",
        help="write PREFIX-heatmap.png (sequence 0, one panel per head) and PREFIX-pruning.png",
    )
    heads.add_argument("--json", action="store_true", help="print the report as JSON")
    heads.set_defaults(func=cmd_heads)


def cmd_heads(client: Client, args: argparse.Namespace) -> int:
    if args.png:
        require_matplotlib()  # before the call: fail fast when it is missing
    if args.random is not None:
        embed_dim = client.model_info(args.model).embed_dim
        x = np.random.default_rng(args.seed).standard_normal((args.random, embed_dim), np.float32)
    else:
        x = read_input(args.input)
    lengths = args.lengths or None
    report = analyze_heads(
        client, args.model, x, lengths=lengths, causal=args.causal, include_weights=bool(args.png)
    )
    if args.png:
        heatmap, curve = f"{args.png}-heatmap.png", f"{args.png}-pruning.png"
        assert report.weights is not None
        save_heatmap(
            report.weights,
            list(range(report.weights.shape[0])),
            heatmap,
            title=f"{args.model}: attention of sequence 0",
        )
        save_pruning_curve(report, curve)
        report.extra["png"] = [heatmap, curve]
    print(json.dumps(report.to_dict() | report.extra, indent=2) if args.json else table(report))
    return 0


def table(report: HeadReport) -> str:
    lines = [
        f"model {report.model} ({report.compute_ms:.1f} ms)",
        "head  entropy  max_weight  importance",
    ]
    lines += [
        f"{h.head:4d}  {h.mean_entropy:7.3f}  {h.mean_max_weight:10.3f}  {h.importance:10.4f}"
        for h in report.heads
    ]
    lines.append("pruned  head  output_error")
    lines += [f"{p.num_pruned:6d}  {p.head:4d}  {p.output_error:12.4f}" for p in report.pruning]
    lines += [f"wrote {path}" for path in report.extra.get("png", [])]
    return "\n".join(lines)
