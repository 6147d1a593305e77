"""A prompt's attention with attention sinks (GPT-OSS) on the CPU, the explicit float32
kernel against SDPA's fused kernel with its logsumexp (mha_serve.model.cached.sinks_by_sdpa),
side by side in one run, and which one explicit_attention picks (SINKS_BY_SDPA_MIN_SCORES).
A GPT-OSS-shaped layer: 64 query heads of 64 over 8 KV heads; causal query rows at the end of
their keys (a prompt, or a chunk over a session's cached keys); float32 and bfloat16; the
machine's torch threads. Alternating rounds, each side's fastest round.

    python bench/sinks_prompt.py              # ~1 min on 2 cores
    python bench/sinks_prompt.py --quick      # a few seconds, noisier
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from _timing import alternating_best

from mha_serve.model import cached

HEADS, KV_HEADS, HEAD_DIM, SCALE = 64, 8, 64, 0.125
# (query rows, keys): small prompts, where the explicit kernel stays, to long ones and a chunk
SHAPES = ((16, 16), (64, 64), (128, 128), (256, 256), (1024, 1024), (32, 4096))
QUICK = ((16, 16), (128, 128), (32, 512))


def sides(rows: int, keys: int, dtype: torch.dtype, heads: int, kv_heads: int):
    g = torch.Generator().manual_seed(rows * 7 + keys)
    q = torch.randn(1, heads, rows, HEAD_DIM, generator=g).to(dtype)
    k = torch.randn(1, kv_heads, keys, HEAD_DIM, generator=g).to(dtype)
    v = torch.randn(1, kv_heads, keys, HEAD_DIM, generator=g).to(dtype)
    sinks = torch.randn(heads, generator=g)
    i = torch.arange(keys - rows, keys)[:, None]  # the rows' positions: the last ones
    allowed = (torch.arange(keys)[None] <= i).view(1, 1, rows, keys)

    def explicit():
        limit = cached.SINKS_BY_SDPA_MIN_SCORES
        cached.SINKS_BY_SDPA_MIN_SCORES = 1 << 62  # (and MHA's 2 rows: heads != kv_heads)
        try:
            return cached.explicit_attention(q, k, v, allowed, SCALE, None, sinks)
        finally:
            cached.SINKS_BY_SDPA_MIN_SCORES = limit

    def fused():
        return cached.sinks_by_sdpa(q, k, v, allowed, SCALE, sinks)

    return explicit, fused


def picked(rows: int, keys: int, heads: int, kv_heads: int) -> str:
    fused = rows > 1 and (heads == kv_heads or rows * keys >= cached.SINKS_BY_SDPA_MIN_SCORES)
    return "fused" if fused else "explicit"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json-out", type=Path)
    args = p.parse_args(argv)
    rounds, budget_s = (1, 0.01) if args.quick else (args.rounds, 0.3)
    heads, kv_heads = (8, 2) if args.quick else (HEADS, KV_HEADS)
    shapes = QUICK if args.quick else SHAPES
    rows_out = []
    print(
        f"a causal prompt's attention with sinks, {heads} query heads of {HEAD_DIM} over "
        f"{kv_heads} KV heads, {torch.get_num_threads()} torch threads, {rounds} alternating "
        f"rounds (fastest), load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    print(
        f"{'dtype':9s} {'rows':>5s} {'keys':>5s} {'explicit ms':>11s} {'fused ms':>9s} "
        f"{'fused/explicit':>14s} {'picked':>8s} {'max diff':>9s}"
    )
    with torch.inference_mode():
        for dtype in (torch.float32, torch.bfloat16):
            for rows, keys in shapes:
                explicit, fused = sides(rows, keys, dtype, heads, kv_heads)
                diff = (explicit().float() - fused().float()).abs().max().item()
                best = alternating_best({"explicit": explicit, "fused": fused}, rounds, budget_s)
                row = {
                    "dtype": str(dtype).removeprefix("torch."),
                    "rows": rows,
                    "keys": keys,
                    "explicit_ms": best["explicit"] * 1e3,
                    "fused_ms": best["fused"] * 1e3,
                    "ratio": best["fused"] / best["explicit"],
                    "picked": picked(rows, keys, heads, kv_heads),
                    "max_diff": diff,
                }
                rows_out.append(row)
                print(
                    f"{row['dtype']:9s} {rows:5d} {keys:5d} {row['explicit_ms']:11.2f} "
                    f"{row['fused_ms']:9.2f} {row['ratio']:14.2f} {row['picked']:>8s} "
                    f"{diff:9.1e}",
                    flush=True,
                )
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        meta = {"command": " ".join(["python", "bench/sinks_prompt.py", *(argv or sys.argv[1:])])}
        args.json_out.write_text(json.dumps({**meta, "rows": rows_out}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
