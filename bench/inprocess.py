"""The limit: the attention module called directly on batched tensors, no serving at all.

Sweeps batch sizes per sequence length and reports the best throughput (median call time at
the best batch size), the ceiling any server of this module can reach on this machine.

    python bench/inprocess.py --seq-len 16 128 [--json-out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch

from mha_serve.config import default_models
from mha_serve.model import MultiHeadAttention, init_weights

BATCH_SIZES = (1, 4, 16, 32, 64, 128, 256)
MIN_TIME_S = 1.0  # per batch size, after warm-up
WARMUP_CALLS = 3


def load(model: str) -> MultiHeadAttention:
    spec = {s.name: s for s in default_models()}[model]
    module = MultiHeadAttention(spec.attention)
    init_weights(module, spec.seed)
    return module.eval()


def time_forward(
    module: MultiHeadAttention, x: torch.Tensor, min_time_s: float
) -> tuple[float, float]:
    """(median, fastest) seconds per forward of x (B, L, E) over at least min_time_s and 3
    calls. The median is the sustained rate (robust to a moment of another process on the
    cores); the fastest call is what the cores do undisturbed."""
    times = []
    with torch.inference_mode():
        for _ in range(WARMUP_CALLS):
            module(x)
        start = time.perf_counter()
        while time.perf_counter() - start < min_time_s or len(times) < 3:
            t = time.perf_counter()
            module(x)
            times.append(time.perf_counter() - t)
    return statistics.median(times), min(times)


def sweep(
    model: str = "mha",
    seq_lens: tuple[int, ...] = (16, 128),
    batch_sizes: tuple[int, ...] = BATCH_SIZES,
    min_time_s: float = MIN_TIME_S,
) -> dict[str, Any]:
    """{"threads", "seq_lens": {L: {"points": [...], "best": {...}}}}; seq/s per batch size."""
    module = load(model)
    embed_dim = module.config.embed_dim
    out: dict[str, Any] = {"model": model, "threads": torch.get_num_threads(), "seq_lens": {}}
    for seq_len in seq_lens:
        points = []
        for batch in batch_sizes:
            x = torch.randn(batch, seq_len, embed_dim)  # (B, L, E)
            s, fastest = time_forward(module, x, min_time_s)
            points.append(
                {
                    "batch": batch,
                    "ms_per_forward": s * 1e3,
                    "sequences_per_s": batch / s,
                    "tokens_per_s": batch * seq_len / s,
                    "fastest_ms_per_forward": fastest * 1e3,
                }
            )
            print(
                f"in-process L={seq_len:4d} B={batch:4d}: {s * 1e3:8.2f} ms/forward "
                f"{batch / s:9.1f} seq/s",
                file=sys.stderr,
                flush=True,
            )
        best = max(points, key=lambda p: p["sequences_per_s"])
        out["seq_lens"][str(seq_len)] = {"points": points, "best": best}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="mha")
    p.add_argument("--seq-len", type=int, nargs="+", default=[16, 128])
    p.add_argument("--batch-sizes", default=",".join(map(str, BATCH_SIZES)))
    p.add_argument("--min-time", type=float, default=MIN_TIME_S, help="seconds per batch size")
    p.add_argument("--json-out", help="write the results here")
    args = p.parse_args(argv)
    batch_sizes = tuple(int(b) for b in args.batch_sizes.split(","))
    result = sweep(args.model, tuple(args.seq_len), batch_sizes, args.min_time)
    for seq_len, r in result["seq_lens"].items():
        b = r["best"]
        print(f"L={seq_len}: best {b['sequences_per_s']:.1f} seq/s at batch {b['batch']}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
