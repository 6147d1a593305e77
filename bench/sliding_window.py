"""A sliding-window session against a full-attention one of the same length (issue 26):
KV bytes held and decode step time at 1x, 4x and 16x the window, measured side by side in
one run, in the engine (validation, reserve, project, cache write and read, attention,
commit: what a front door calls).

Two models of one shape and the same seeded weights, a Mistral-like GQA layer with RoPE
(default: embed_dim 1024, 16 heads of 64, 4 KV heads, float32), one with a sliding window
of W tokens and one without. For each length N = m * W, one session of each model is
prefilled to N tokens; then both decode --steps tokens each, in alternating rounds so that
both see the same machine. The window session's KV bytes stay flat as N grows; its step
reads the window (W keys), the full one all N.

    python bench/sliding_window.py [--window 512] [--multiples 1,4,16] [--steps 32]
        [--rounds 5] [--threads N] [--json-out bench/results/sliding_window.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from mha_serve.engine import AttendRequest, Engine, array_of
from mha_serve.engine.types import MiB, ModelSpec
from mha_serve.model import AttentionConfig
from mha_serve.model.config import RopeConfig

PREFILL_CHUNK = 512  # tokens per prefill step


def build(args) -> Engine:
    shape = {
        "embed_dim": args.embed_dim,
        "num_heads": args.heads,
        "num_kv_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "bias": False,
        "causal": True,
        "rope": RopeConfig(theta=10000.0),
    }
    longest = max(args.multiples) * args.window + args.steps * args.rounds + PREFILL_CHUNK
    budget = 2 * longest * 2 * args.kv_heads * args.head_dim * 4  # K, V; float32; twice over
    common = {"seed": 1, "max_seq_len": longest, "kv_cache_bytes": budget}
    specs = [
        ModelSpec("window", AttentionConfig(**shape, sliding_window=args.window), **common),
        ModelSpec("full", AttentionConfig(**shape), **common),
    ]
    return Engine(
        specs, device=torch.device("cpu"), dtype=torch.float32, max_response_bytes=64 * MiB
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--multiples", default="1,4,16", help="session lengths, in windows")
    parser.add_argument("--steps", type=int, default=32, help="decode steps per round and side")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--embed-dim", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    args.multiples = [int(m) for m in args.multiples.split(",")]
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = build(args)
    E = args.embed_dim
    g = torch.Generator().manual_seed(0)
    rows = []
    with torch.inference_mode():
        for m in args.multiples:
            n = m * args.window
            sessions = {}
            for name in ("window", "full"):
                sid = engine.create_session(name).session_id
                for start in range(0, n, PREFILL_CHUNK):
                    chunk = torch.randn(1, min(PREFILL_CHUNK, n - start), E, generator=g)
                    engine.attend(AttendRequest(name, array_of(chunk), session_id=sid))
                sessions[name] = sid
            held = {name: engine.get_session(sid).bytes_held for name, sid in sessions.items()}
            tokens = torch.randn(args.steps, 1, 1, E, generator=g)
            token_arrays = [array_of(t) for t in tokens]  # as the wire gives them
            step_ms: dict[str, list[float]] = {"window": [], "full": []}
            for name, sid in sessions.items():  # warm-up step each
                engine.attend(AttendRequest(name, array_of(tokens[0]), session_id=sid))
            for _ in range(args.rounds):
                for name, sid in sessions.items():
                    start = time.perf_counter()
                    for t in range(args.steps):
                        engine.attend(AttendRequest(name, token_arrays[t], session_id=sid))
                    step_ms[name].append((time.perf_counter() - start) / args.steps * 1e3)
            after = {name: engine.get_session(sid).bytes_held for name, sid in sessions.items()}
            for sid in sessions.values():
                engine.close_session(sid)
            w_ms, f_ms = (statistics.median(step_ms[k]) for k in ("window", "full"))
            rows.append(
                {
                    "multiple": m,
                    "tokens": n,
                    "kv_bytes_window": held["window"],
                    "kv_bytes_full": held["full"],
                    "kv_ratio": held["window"] / held["full"],
                    "kv_bytes_window_after_steps": after["window"],
                    "step_ms_window": w_ms,
                    "step_ms_full": f_ms,
                    "step_ratio": w_ms / f_ms,
                }
            )
    info = engine.cache_info("window")
    print(
        f"GQA {args.heads}:{args.kv_heads} x {args.head_dim}, embed {E}, float32, window "
        f"{args.window}; decode step = median of {args.rounds} rounds x {args.steps} steps, "
        f"{torch.get_num_threads()} torch threads; blocks freed out of the window: "
        f"{info.num_blocks_out_of_window}"
    )
    print("length  tokens  kv_window  kv_full  ratio  step_ms_window  step_ms_full  ratio")
    for r in rows:
        print(
            f"{r['multiple']:5d}W {r['tokens']:7d} {r['kv_bytes_window']:10d} "
            f"{r['kv_bytes_full']:8d} {r['kv_ratio']:6.3f} {r['step_ms_window']:15.3f} "
            f"{r['step_ms_full']:13.3f} {r['step_ratio']:6.3f}"
        )
    if args.json_out:
        out = {"args": vars(args), "rows": rows}
        Path(args.json_out).write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.json_out}")


if __name__ == "__main__":
    main()
