"""Where a served decode step's server time goes, before and after the hot-path work (issue
25): the same streamed steps against each server, its process sampled by py-spy (every
thread, the GIL holder's stack), each sample counted in one part of the step by the frame
that holds it. Servers alternate in rounds, one run.

    python bench/step_profile.py --baseline-tree /path/to/old/checkout   # ~2 min
    python bench/step_profile.py --variant noinline=--inline-lone-requests=false

Parts: the forward (the module's code and torch's ops under it), validation, engine
bookkeeping (the engine and the cache around the forward), serving (lanes, batcher,
tickets), metrics, transport (servicer, codec), gRPC and asyncio; a --busy-poll-us server's
polling is counted apart, as waiting. Only samples of threads on
a CPU count (py-spy without --idle): per step, samples x interval / steps, microseconds of
one core. Wall time per step is measured by the client beside it; its excess over the
server's busy time is what the step waits: the thread crossings (to the compute thread and
back, each a wake-up) and the wire. Frames are Python's: a torch op counts in the part
whose code called it.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from served_bench import OPTIONS, start_served, timed_stream  # noqa: E402

RATE_HZ = 1000
STEPS = 64  # streamed steps per round trip loop; then the session is truncated back
# First match wins, innermost frame first: (part, substrings of a frame "function (file:line)").
PARTS = [
    (
        "forward (torch ops)",
        (
            "torch/",
            "built-in method torch",
            "cached.py",
            "attention.py",
            "mha_serve/model/steps.py",
            "mha_serve/model/norm.py",
            "mha_serve/model/checks.py",
        ),
    ),
    (
        "validation",
        (
            "mha_serve/engine/prepare.py",
            "Engine.validate",
            "Engine.prepare",
            "absmax",
            "validate_step",
            "tensor_of",
        ),
    ),
    ("metrics", ("prometheus_client", "mha_serve/metrics")),
    ("engine bookkeeping", ("mha_serve/engine", "mha_serve/cache")),
    ("serving (lanes, batcher)", ("mha_serve/serving", "mha_serve/batching")),
    ("transport (servicer, codec)", ("mha_serve/transport", "mha_client")),
    ("gRPC and asyncio", ("grpc", "asyncio", "selectors", "threading", "concurrent")),
]
IDLE = ("EpollSelector.select", "select (selectors", "_worker (concurrent", "wait (threading")


POLLING = "mha_serve/transport/busy_poll.py"  # --busy-poll-us: the loop's poll for its next event


def classify(stack: list[str]) -> str:
    # (before IDLE: the selector polls through selectors' own select, the innermost frame)
    if any(POLLING in frame for frame in stack[-2:]):
        return "polling (waiting)"
    if any(key in stack[-1] for key in IDLE):
        return "idle (waiting)"
    for frame in reversed(stack):  # the innermost frame that names a part
        for part, keys in PARTS:
            if any(k in frame for k in keys):
                return part
    return "other"


async def steps(
    target: str, context: int, seconds: float, model: str = "mha"
) -> tuple[int, list[float]]:
    import grpc

    from mha_client.messages import step_request
    from mha_client.sdk import AsyncClient

    rng = np.random.default_rng(0)
    async with AsyncClient(target) as client:
        session = await client.create_session(model)
        await session.step(rng.standard_normal((context, 512), dtype=np.float32))
        tokens = [
            step_request(
                session.id, rng.standard_normal((1, 512), dtype=np.float32), {}
            ).SerializeToString()
            for _ in range(STEPS)
        ]
        async with grpc.aio.insecure_channel(target, options=OPTIONS) as channel:
            n, times, end = 0, [], time.monotonic() + seconds
            while time.monotonic() < end:
                await session.truncate(context)
                times += await timed_stream(channel, tokens)
                n += len(tokens)
        await session.close()
    return n, times


async def sessions_together(target: str, seconds: float, n: int = 64) -> tuple[int, list[float]]:
    """`n` gqa sessions at context 256 streaming one-token steps at once (per token; wall:
    1/rate), each session truncated back between its bursts of STEPS steps."""
    from mha_client.sdk import AsyncClient

    rng = np.random.default_rng(0)
    tokens = rng.standard_normal((n, STEPS, 512), dtype=np.float32)
    async with AsyncClient(target, timeout=600) as client:
        sessions = []
        for _ in range(n):
            s = await client.create_session("gqa")
            await s.step(rng.standard_normal((256, 512), dtype=np.float32))
            sessions.append(s)

        async def burst(i: int) -> None:
            async with sessions[i].stream() as stream:
                for t in range(STEPS):
                    await stream.step(tokens[i, t : t + 1])
            await sessions[i].truncate(256)

        total, end, start = 0, time.monotonic() + seconds, time.perf_counter()
        while time.monotonic() < end:
            await asyncio.gather(*(burst(i) for i in range(n)))
            total += n * STEPS
        rate = total / (time.perf_counter() - start)
        for s in sessions:
            await s.close()
    return total, [1.0 / rate]


def small_requests(target: str, seconds: float, concurrency: int = 32) -> tuple[int, list[float]]:
    """Closed-loop 16-token Attends from `concurrency` clients (mha_client.loadgen)."""
    from mha_client.loadgen import GrpcTarget, LoadSpec, Workload, parse_seq_lens, run_load_sync

    workload = Workload("mha", parse_seq_lens("16"), 512)
    spec = LoadSpec(concurrency=concurrency, duration_s=seconds, warmup=2 * concurrency)
    result = run_load_sync(lambda: GrpcTarget(target), workload, spec)
    n = int(result.sequences_per_s * seconds)
    return n, [1.0 / max(result.sequences_per_s, 1e-9)]


def profile(
    pid: int,
    target: str,
    context: int,
    seconds: float,
    out: Path,
    load: str = "decode",
    model: str = "mha",
) -> dict:
    spy = subprocess.Popen(
        [str(Path(sys.executable).parent / "py-spy"), "record", "-r", str(RATE_HZ), "-f", "raw", "-o", str(out), "--pid", str(pid),
         "-d", str(int(seconds) + 1), "--threads", "--nonblocking"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    time.sleep(0.5)
    if load == "decode":
        n, times = asyncio.run(steps(target, context, seconds, model))
    elif load == "sessions64":
        n, times = asyncio.run(sessions_together(target, seconds))
    else:
        n, times = small_requests(target, seconds)
    spy.wait(60)
    parts: collections.Counter = collections.Counter()
    for line in out.read_text().splitlines():
        stack, count = line.rsplit(" ", 1)
        frames = stack.split(";")
        parts[classify(frames)] += int(count)
    us = {part: count / RATE_HZ / n * 1e6 for part, count in parts.items()}
    return {"steps": n, "wall_us_p50": statistics.median(times) * 1e6, "us_per_step": us}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--baseline-tree",
        type=Path,
        help="a checkout of the code before (its service/ and client/)",
    )
    p.add_argument("--variant", action="append", default=[], metavar="NAME=FLAG[,FLAG]")
    p.add_argument("--context", type=int, default=256)
    p.add_argument(
        "--model",
        choices=("mha", "gqa", "mqa"),
        default="mha",
        help="the built-in model the decode load steps",
    )
    p.add_argument(
        "--load",
        choices=("decode", "small16", "sessions64"),
        default="decode",
        help="a decode stream, 16-token Attends from 32 clients, or 64 gqa sessions at context "
        "256 decoding together (per request or token; wall: 1/rate)",
    )
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument(
        "--json-out", type=Path, default=ROOT / "bench" / "results" / "step_profile.json"
    )
    args = p.parse_args(argv)
    if args.load == "decode":  # the steps append STEPS tokens to a session of --context
        from mha_serve.config import default_models

        max_len = next(m.max_seq_len for m in default_models() if m.name == args.model)
        if args.context + STEPS > max_len:
            p.error(
                f"--context {args.context}: the steps append {STEPS} tokens, past the built-in "
                f"{args.model}'s max_seq_len {max_len}; use at most {max_len - STEPS}"
            )
    servers = [("now", None, [])]
    if args.baseline_tree:
        servers.insert(0, ("before", args.baseline_tree, []))
    for v in args.variant:
        name, _, flags = v.partition("=")
        servers.append((name, None, [f for f in flags.split(",") if f]))
    results: dict = {name: [] for name, _, _ in servers}
    with tempfile.TemporaryDirectory(prefix="mha-profile-") as d:
        tmp = Path(d)
        procs = {}
        from mha_client.sdk import Client

        for name, tree, flags in servers:
            procs[name] = start_served(tmp, name, tree, flags)
        try:
            for _, target in procs.values():
                with Client(target) as c:
                    c.wait_ready(180)
            for r in range(args.rounds):
                order = list(procs) if r % 2 == 0 else list(procs)[::-1]
                for name in order:
                    proc, target = procs[name]
                    out = tmp / f"{name}-{r}.txt"
                    results[name].append(
                        profile(
                            proc.pid,
                            target,
                            args.context,
                            args.seconds,
                            out,
                            args.load,
                            args.model,
                        )
                    )
        finally:
            for proc, _ in procs.values():
                proc.terminate()
            for proc, _ in procs.values():
                proc.wait(30)
    parts = [p for p, _ in PARTS] + ["polling (waiting)", "idle (waiting)", "other"]
    summary = {}
    for name, runs in results.items():
        summary[name] = {
            "wall_us_p50": statistics.median(r["wall_us_p50"] for r in runs),
            **{
                part: statistics.median(r["us_per_step"].get(part, 0.0) for r in runs)
                for part in parts
            },
        }
        busy = sum(
            v
            for k, v in summary[name].items()
            if k not in ("wall_us_p50", "idle (waiting)", "polling (waiting)")
        )
        summary[name]["busy_us"] = busy
    header = "part".ljust(30) + "".join(n.rjust(12) for n in summary)
    what = {
        "decode": f"{args.model} decode step at context {args.context}",
        "small16": "16-token Attend from 32 clients",
        "sessions64": "64 gqa sessions at context 256 decoding together, per token",
    }[args.load]
    print(f"{what}, us of one core per request (median of {args.rounds} rounds):")
    print(header)
    for part in [*parts, "busy_us", "wall_us_p50"]:
        print(part.ljust(30) + "".join(f"{summary[n][part]:12.0f}" for n in summary))
    out = {
        "command": " ".join(["python", "bench/step_profile.py", *(argv or sys.argv[1:])]),
        "loadavg": os.getloadavg(),
        "context": args.context,
        "model": args.model if args.load == "decode" else None,
        "load": args.load,
        "rate_hz": RATE_HZ,
        "summary": summary,
        "runs": results,
    }
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    args.json_out.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
