"""A prompt's attention with ALiBi (BLOOM, MPT, Falcon-RW) on the CPU, the explicit float32
kernel against SDPA's fused kernel with the bias as a float32 mask built per chunk of rows
(mha_serve.model.cached.alibi_by_sdpa), side by side in one run, and which one
explicit_attention picks (ALIBI_BY_SDPA_MIN_ROWS). 12 heads of 64 (MHA, as BLOOM's and
MPT's layers); causal prompts of 128 to 2048 tokens, a 32-token step over 2048 cached keys
and a decode token over 2048; float32 and bfloat16; the machine's torch threads. Each side's
time includes building its bias (and the fused side's mask). Alternating rounds, each side's
fastest round.

    python bench/alibi_prompt.py --json-out bench/results/alibi_prompt.json   # ~2 min, 2 cores
    python bench/alibi_prompt.py --quick      # a few seconds, noisier
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
from mha_serve.model.alibi import AlibiSlopes, alibi_slopes, positions

HEADS, HEAD_DIM = 12, 64
SCALE = HEAD_DIM**-0.5
# (query rows, keys): prompts (rows == keys), a multi-token step and a decode token at the end
# of 2048 cached keys
SHAPES = ((128, 128), (512, 512), (1024, 1024), (2048, 2048), (32, 2048), (1, 2048))
QUICK = ((16, 16), (128, 128), (1, 256))


def sides(rows: int, keys: int, dtype: torch.dtype, heads: int):
    g = torch.Generator().manual_seed(rows * 7 + keys)
    q = torch.randn(1, heads, rows, HEAD_DIM, generator=g).to(dtype)
    k = torch.randn(1, heads, keys, HEAD_DIM, generator=g).to(dtype)
    v = torch.randn(1, heads, keys, HEAD_DIM, generator=g).to(dtype)
    past = keys - rows  # the rows' positions: the last ones
    allowed = None
    if rows > 1:  # (a decode token sees every key: no mask, as attend_one passes it)
        allowed = cached.key_mask(past, rows, 0, keys, None, q.device)
    alibi = (
        AlibiSlopes(alibi_slopes(heads)),
        positions(past, rows, q.device),
        positions(0, keys, q.device),
    )

    def explicit():
        least = cached.ALIBI_BY_SDPA_MIN_ROWS
        cached.ALIBI_BY_SDPA_MIN_ROWS = 1 << 62
        try:
            return cached.explicit_attention(q, k, v, allowed, SCALE, None, None, alibi)
        finally:
            cached.ALIBI_BY_SDPA_MIN_ROWS = least

    def fused():
        return cached.alibi_by_sdpa(q, k, v, allowed, SCALE, alibi)

    return explicit, fused


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json-out", type=Path)
    args = p.parse_args(argv)
    rounds, budget_s = (1, 0.01) if args.quick else (args.rounds, 0.5)
    heads = 4 if args.quick else HEADS
    shapes = QUICK if args.quick else SHAPES
    rows_out = []
    print(
        f"a causal prompt's attention with ALiBi, {heads} heads of {HEAD_DIM}, "
        f"{torch.get_num_threads()} torch threads, {rounds} alternating rounds (fastest), "
        f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    print(
        f"{'dtype':9s} {'rows':>5s} {'keys':>5s} {'explicit ms':>11s} {'fused ms':>9s} "
        f"{'fused/explicit':>14s} {'picked':>8s} {'max diff':>9s}"
    )
    with torch.inference_mode():
        for dtype in (torch.float32, torch.bfloat16):
            for rows, keys in shapes:
                explicit, fused = sides(rows, keys, dtype, heads)
                diff = (explicit().float() - fused().float()).abs().max().item()
                best = alternating_best({"explicit": explicit, "fused": fused}, rounds, budget_s)
                row = {
                    "dtype": str(dtype).removeprefix("torch."),
                    "rows": rows,
                    "keys": keys,
                    "explicit_ms": best["explicit"] * 1e3,
                    "fused_ms": best["fused"] * 1e3,
                    "ratio": best["fused"] / best["explicit"],
                    "picked": "fused" if rows >= cached.ALIBI_BY_SDPA_MIN_ROWS else "explicit",
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
        meta = {
            "command": " ".join(["python", "bench/alibi_prompt.py", *(argv or sys.argv[1:])]),
            "threads": torch.get_num_threads(),
            "load_average": os.getloadavg(),
        }
        args.json_out.write_text(json.dumps({**meta, "rows": rows_out}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
