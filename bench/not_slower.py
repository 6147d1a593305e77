"""Nothing slower (issue 25): this checkout's server against another checkout's (the code
before a change: a git worktree), side by side in one run, on the loads the hot-path work
must not slow down.

    git worktree add ../wt-before <commit>
    python bench/not_slower.py --baseline-tree ../wt-before      # ~6 min

Both servers run at once (`--torch-threads 1` each, 127.0.0.1, metrics off) and are measured
in alternating rounds (the order reversed every other round; round 0 warms up), so this
machine's drift over minutes lands on both sides of every ratio:
1. 64 gqa sessions decoding together: each prefilled to 256 tokens, forked every round (a fork
   shares the prefix), then one single-token step per session at a time, all 64 streams at
   once (AsyncClient, one stream per session), for `--steps` steps: tokens/s.
2. Attend at 128 and 1024 tokens from 32 clients (`--clients`) in a closed loop
   (mha_client.loadgen): seq/s.
3. The frontend-workers mode (`--frontend-workers 2`, a second pair of servers, started after
   the first pair stops): Attend at 16 tokens from 32 clients (`--clients`) over 4 channels:
   seq/s.
Each row prints after/before, the median round's. Nothing here is a CI gate.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from served_bench import machine, start_served  # noqa: E402

EMBED = 512
SIDES = ("after", "before")


def start_pair(tmp: Path, baseline: Path, flags: list[str], tag: str) -> tuple[list, dict]:
    from mha_client.sdk import Client

    procs, targets = [], {}
    for side, tree in (("after", None), ("before", baseline)):
        proc, targets[side] = start_served(tmp, f"{side}{tag}", tree, flags)
        procs.append(proc)
    for target in targets.values():
        with Client(target) as c:
            c.wait_ready(240)
    return procs, targets


def stop(procs: list) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(60)
        except Exception:
            p.kill()


async def decode_round(target: str, prompts: np.ndarray, tokens: np.ndarray) -> float:
    """tokens/s of every session stepping at once, one token per step, on fresh forks."""
    from mha_client.sdk import AsyncClient

    n, steps = tokens.shape[0], tokens.shape[1]
    async with AsyncClient(target, timeout=600) as c:
        bases = []
        for p in prompts:
            s = await c.create_session("gqa")
            await s.step(p)
            bases.append(s)
        forks = [await s.fork() for s in bases]

        async def decode(i: int) -> None:
            async with forks[i].stream() as stream:
                for t in range(steps):
                    await stream.step(tokens[i, t : t + 1])

        start = time.perf_counter()
        await asyncio.gather(*(decode(i) for i in range(n)))
        rate = n * steps / (time.perf_counter() - start)
        for s in forks + bases:
            await s.close()
    return rate


def attend_point(target: str, seq_len: int, concurrency: int, duration: float, channels: int = 1):
    from mha_client.loadgen import GrpcTarget, LoadSpec, Workload, parse_seq_lens, run_load_sync

    workload = Workload("mha", parse_seq_lens(str(seq_len)), EMBED)
    spec = LoadSpec(concurrency=concurrency, duration_s=duration, warmup=2 * concurrency)
    result = run_load_sync(lambda: GrpcTarget(target, channels=channels), workload, spec)
    if result.errors:
        raise RuntimeError(f"{target}, {seq_len} tokens: errors {result.errors}")
    return result.sequences_per_s


def alternate(rounds: int, measure) -> dict[str, list[float]]:
    """measure(side) per side per round, the order reversed every other round; round 0 is a
    warm-up, not kept."""
    samples: dict[str, list[float]] = {s: [] for s in SIDES}
    for r in range(rounds + 1):
        for side in SIDES if r % 2 else SIDES[::-1]:
            value = measure(side)
            if r:
                samples[side].append(value)
    return samples


def row(name: str, unit: str, samples: dict[str, list[float]]) -> dict[str, Any]:
    ratios = [a / b for a, b in zip(samples["after"], samples["before"], strict=True)]
    out = {
        "load": name,
        "unit": unit,
        "after": statistics.median(samples["after"]),
        "before": statistics.median(samples["before"]),
        "ratio": statistics.median(ratios),
        "ratios": ratios,
        "samples": samples,
    }
    print(
        f"{name}: after {out['after']:.0f} {unit}, before {out['before']:.0f} {unit}, "
        f"after/before {out['ratio']:.2f} (rounds {', '.join(f'{r:.2f}' for r in ratios)})",
        flush=True,
    )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline-tree", type=Path, required=True, help="the checkout before")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=16, help="decode steps per session per round")
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--duration", type=float, default=4.0, help="seconds per Attend load point")
    ap.add_argument("--clients", type=int, default=32, help="closed-loop clients per Attend point")
    ap.add_argument("--json-out", type=Path, default=ROOT / "bench/results/not_slower.json")
    args = ap.parse_args(argv)
    baseline = args.baseline_tree.resolve()
    rng = np.random.default_rng(1)
    prompts = rng.standard_normal((args.sessions, args.context, EMBED), dtype=np.float32)
    tokens = rng.standard_normal((args.sessions, args.steps, EMBED), dtype=np.float32)
    rows = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        procs, targets = start_pair(tmp, baseline, ["--torch-threads", "1"], "")
        try:
            decode = alternate(
                args.rounds, lambda s: asyncio.run(decode_round(targets[s], prompts, tokens))
            )
            rows.append(row(f"{args.sessions} sessions decoding together", "tok/s", decode))
            for seq_len in (128, 1024):
                samples = alternate(
                    args.rounds,
                    lambda s, n=seq_len: attend_point(targets[s], n, args.clients, args.duration),
                )
                rows.append(
                    row(f"Attend {seq_len} tokens, {args.clients} clients", "seq/s", samples)
                )
        finally:
            stop(procs)
        flags = ["--torch-threads", "1", "--frontend-workers", "2"]
        procs, targets = start_pair(tmp, baseline, flags, "-fw")
        try:
            samples = alternate(
                args.rounds,
                lambda s: attend_point(targets[s], 16, args.clients, args.duration, channels=4),
            )
            rows.append(
                row(
                    f"frontend workers 2, Attend 16 tokens, {args.clients} clients",
                    "seq/s",
                    samples,
                )
            )
        finally:
            stop(procs)
    result = {
        "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "baseline_tree": str(baseline),
        "args": {k: str(v) for k, v in vars(args).items()},
        "rows": rows,
    }
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    args.json_out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
