"""A decode token's attention over its session's keys, the engine's call against the call it
replaced, side by side in one run: SDPA with enable_gqa (KV heads broadcast to the query
heads) against mha_serve.model.cached.attend_token (each KV head's query heads as the rows of
one SDPA call). 8 query heads of 64, 8/2/1 KV heads (MHA/GQA/MQA), 256/1024/4096 keys, each
dtype; keys and values strided views (as the cache hands them); one torch thread (the lone
step's). Alternating rounds, each side's fastest round.

    python bench/decode_attention.py              # ~40 s
    python bench/decode_attention.py --quick      # a few seconds, noisier
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from _timing import alternating_best

from mha_serve.model.cached import attend_token

HEADS, HEAD_DIM, SCALE = 8, 64, 0.125


def sides(kvh: int, keys: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(keys + kvh)
    q = torch.randn(1, HEADS, 1, HEAD_DIM, generator=g).to(dtype)
    k = torch.randn(1, kvh, keys + 16, HEAD_DIM, generator=g).to(dtype)[:, :, :keys]
    v = torch.randn(1, kvh, keys + 16, HEAD_DIM, generator=g).to(dtype)[:, :, :keys]

    def before():
        return F.scaled_dot_product_attention(q, k, v, scale=SCALE, enable_gqa=kvh != HEADS)

    def now():
        return attend_token(q, k, v, SCALE)

    return before, now


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json-out", type=Path)
    args = p.parse_args(argv)
    rounds, budget_s = (2, 0.01) if args.quick else (args.rounds, 0.15)
    torch.set_num_threads(1)
    rows = []
    print(
        f"one decode token, {HEADS} query heads of {HEAD_DIM}, one torch thread, "
        f"{rounds} alternating rounds (fastest), load average "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    print(
        f"{'dtype':9s} {'kv heads':>8s} {'keys':>6s} {'before us':>10s} {'now us':>8s} {'now/before':>10s} {'max diff':>9s}"
    )
    with torch.inference_mode():
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for kvh in (HEADS, 2, 1):
                for keys in (256, 1024, 4096):
                    before, now = sides(kvh, keys, dtype)
                    diff = (before().float() - now().float()).abs().max().item()
                    for fn in (before, now):  # warm, and the calls per round
                        fn()
                    best = alternating_best(
                        {"before": before, "now": now}, rounds, budget_s, probe_calls=5, min_calls=5
                    )
                    row = {
                        "dtype": str(dtype).removeprefix("torch."),
                        "kv_heads": kvh,
                        "keys": keys,
                        "before_us": best["before"] * 1e6,
                        "now_us": best["now"] * 1e6,
                        "ratio": best["now"] / best["before"],
                        "max_diff": diff,
                    }
                    rows.append(row)
                    print(
                        f"{row['dtype']:9s} {kvh:8d} {keys:6d} {row['before_us']:10.1f} "
                        f"{row['now_us']:8.1f} {row['ratio']:10.2f} {diff:9.1e}",
                        flush=True,
                    )
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        meta = {
            "command": " ".join(["python", "bench/decode_attention.py", *(argv or sys.argv[1:])])
        }
        args.json_out.write_text(json.dumps({**meta, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
