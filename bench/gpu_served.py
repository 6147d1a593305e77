"""bench/gpu.py's sections 4-6 and 8, through a real mha-serve on this machine's GPU (its CUDA
defaults, bfloat16) with a gRPC echo beside it: stateless throughput by batch and length
against in-process, 64 sessions decoding together vs one at a time, one session's streamed
step; and the same server with each GPU switch turned (--flash-decode true,
--decode-graphs true) against the default, side by side. A section that fails is recorded under "errors" and the others
still run."""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

MODELS = ("mha", "gqa", "mqa")
EMBED = 512
KV_CONTEXT = 4096  # the decode context of sections 2, 3 and 6


def grid(quick: bool) -> list[tuple[int, int]]:
    """(batch, length) points; a request stays under the server's 64 MiB of float32 input."""
    batches, lengths = ((1, 32), (16, 1024)) if quick else ((1, 8, 32), (16, 128, 1024))
    return [(b, n) for n in lengths for b in batches if b * n * EMBED * 4 < 32 << 20]


def inprocess_seq_per_s(module, device, batch: int, length: int, min_s: float) -> tuple:
    """(seq/s with the input from host memory and the output back, seq/s of the forward
    alone on device-resident input): the module as a server calls it, without the server."""
    import torch
    from gpu_kernels import per_call_s

    host = torch.randn(batch, length, EMBED)  # float32, as the wire delivers it
    on_device = host.to(device, torch.bfloat16)

    def round_trip() -> None:
        module(host.to(device, torch.bfloat16)).output.float().cpu()

    times = []
    start = time.perf_counter()
    for _ in range(3):
        round_trip()
    while time.perf_counter() - start < min_s or len(times) < 5:
        t = time.perf_counter()
        round_trip()
        times.append(time.perf_counter() - t)
    forward = per_call_s(lambda _: module(on_device), device, calls=10, reps=3)
    return batch / statistics.median(times), batch / forward


def stateless(targets, device, quick: bool, rounds: int, duration: float, concurrency: int):
    import torch
    from gpu_kernels import load_module

    from mha_client.loadgen import GrpcTarget, LoadSpec, Workload, parse_seq_lens, run_load_sync

    module = load_module("mha", device, torch.bfloat16)
    rows = []
    with torch.inference_mode():
        for batch, length in grid(quick):
            workload = Workload("mha", parse_seq_lens(str(length)), EMBED, batch=batch)
            spec = LoadSpec(concurrency=concurrency, duration_s=duration, warmup=concurrency)
            samples: dict[str, list[float]] = {"served": [], "echo": [], "inprocess": []}
            forward = []
            for r in range(rounds):
                order = ["served", "echo"] if r % 2 == 0 else ["echo", "served"]
                for name in order:
                    result = run_load_sync(lambda t=targets[name]: GrpcTarget(t), workload, spec)
                    if result.errors:
                        raise RuntimeError(f"{name} B={batch} L={length}: {result.errors}")
                    samples[name].append(result.sequences_per_s)
                inproc, fwd = inprocess_seq_per_s(module, device, batch, length, 0.5)
                samples["inprocess"].append(inproc)
                forward.append(fwd)
            med = {k: statistics.median(v) for k, v in samples.items()}
            row = {
                "batch": batch,
                "length": length,
                "concurrency": concurrency,
                "served_seq_per_s": med["served"],
                "inprocess_seq_per_s": med["inprocess"],
                "forward_seq_per_s": statistics.median(forward),
                "echo_seq_per_s": med["echo"],
                "vs_inprocess": med["served"] / med["inprocess"],
                "vs_echo": med["served"] / med["echo"],
                "samples": samples,
            }
            rows.append(row)
            print(
                f"stateless B={batch:2d} L={length:4d}: served {med['served']:8.0f} seq/s | "
                f"in-process {med['inprocess']:8.0f} (forward alone {row['forward_seq_per_s']:.0f})"
                f" | echo {med['echo']:8.0f} | served / in-process {row['vs_inprocess']:.2f}, "
                f"/ echo {row['vs_echo']:.2f}",
                flush=True,
            )
    return rows


async def lone_steps(targets: dict[str, str], context: int, steps: int, rounds: int) -> list:
    """Per model: a streamed step through the server (SDK) and an echo round trip of the same
    request bytes, alternating in rounds; medians over the steps, round 0 not counted."""
    import grpc
    from served_bench import OPTIONS, BytesStream

    from mha_client.messages import step_request_bytes
    from mha_client.sdk import AsyncClient

    rng = np.random.default_rng(0)
    rows = []
    async with AsyncClient(targets["served"], timeout=600) as client:
        channel = grpc.aio.insecure_channel(targets["echo"], options=OPTIONS)
        try:
            for model in MODELS:
                start_len = context - steps
                tokens = rng.standard_normal((steps, 1, EMBED), dtype=np.float32)
                session = await client.create_session(model)
                await session.step(rng.standard_normal((start_len, EMBED), dtype=np.float32))
                payloads = [step_request_bytes(session.id, t, {}) for t in tokens]
                served, echo = [], []
                for r in range(rounds + 1):
                    await session.truncate(start_len)
                    times = []
                    async with session.stream() as stream:
                        for t in tokens:
                            start = time.perf_counter()
                            await stream.step(t)
                            times.append(time.perf_counter() - start)
                    bytes_stream = BytesStream(channel)
                    echoed = []
                    for p in payloads:
                        start = time.perf_counter()
                        await bytes_stream.round_trip(p)
                        echoed.append(time.perf_counter() - start)
                    await bytes_stream.close()
                    if r:
                        served += times
                        echo += echoed
                await session.close()
                rows.append(
                    {
                        "model": model,
                        "context": context,
                        "served_s": statistics.median(served),
                        "echo_s": statistics.median(echo),
                    }
                )
        finally:
            await channel.close()
    return rows


def served(tmp: Path, device, quick: bool, rounds: int) -> dict[str, Any]:
    """Sections 4-6 on one server and the echo beside it."""
    import sessions
    from gpu_kernels import attempt
    from overhead import start_servers

    from mha_client.sdk import Client

    variants = {name: flags for name, flags in SWITCHES.items() if flags}
    procs, targets = start_servers(tmp, None, variants=variants)
    out: dict[str, Any] = {}
    try:
        with Client(targets["served"]) as c:
            info = c.list_models()
        out["served_models"] = [
            {"name": m.name, "device": m.device, "dtype": m.dtype} for m in info
        ]
        print(f"served: {', '.join(f'{m.name} on {m.device} {m.dtype}' for m in info)}", flush=True)
        duration = 1.0 if quick else 2.0
        attempt(out, "stateless", lambda: stateless(targets, device, quick, rounds, duration, 16))
        print("64 sessions decoding together vs one at a time (gqa):", flush=True)
        steps = 8 if quick else 32
        attempt(
            out,
            "sessions",
            lambda: asyncio.run(sessions.batched_decode(targets["served"], 64, 256, steps, rounds)),
        )
        lone = lone_steps(targets, KV_CONTEXT, 16 if quick else 64, rounds)
        attempt(out, "lone", lambda: asyncio.run(lone))
        print("the server's GPU switches against its defaults:", flush=True)
        attempt(out, "switches", lambda: switches(targets, rounds, 8 if quick else 16))
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(30)
        out["exit_codes"] = [proc.returncode for proc in procs]
    for key, error in out.get("errors", {}).items():
        print(f"{key}: FAILED: {error}", flush=True)
    return out


# Section 8's servers: the default and each switch turned the other way, by name.
SWITCHES = {
    "served": [],
    "flash": ["--flash-decode", "true"],  # batched decode steps read K/V in place
    "graphs": ["--decode-graphs", "true"],
}
# Switches `--switches` takes besides, not in `make gpu`'s section 8 (its time is budgeted):
# the event loop pinned (--event-loop-cpu: on 2 CPU cores a lone step 18-22% quicker);
# cuDNN's attention (settled on two leases: 0.04-0.22x, off by default).
MORE_SWITCHES = {"pinned": ["--event-loop-cpu", "auto"], "cudnn": ["--cudnn-attention", "true"]}
ALL_SWITCHES = {**SWITCHES, **MORE_SWITCHES}
# Its stateless point (batch, length), its sessions' first context, its lone step's context.
SWITCH_POINT = (8, 128)
SWITCH_CONTEXT = 256
SWITCH_LONE_CONTEXT = 1024


async def lone_step_s(target: str, context: int, steps: int) -> float:
    """Median seconds of a gqa session's streamed decode steps from context - steps."""
    from mha_client.sdk import AsyncClient

    rng = np.random.default_rng(2)
    async with AsyncClient(target, timeout=600) as client:
        session = await client.create_session("gqa")
        await session.step(rng.standard_normal((context - steps, EMBED), dtype=np.float32))
        times = []
        async with session.stream() as stream:
            for t in rng.standard_normal((steps, 1, EMBED), dtype=np.float32):
                start = time.perf_counter()
                await stream.step(t)
                times.append(time.perf_counter() - start)
        await session.close()
    return statistics.median(times[2:] if len(times) > 4 else times)


def switches(
    targets: dict[str, str],
    rounds: int,
    steps: int,
    num_sessions: int = 64,
    duration: float = 2.0,
    names: tuple[str, ...] = tuple(SWITCHES),
) -> dict[str, Any]:
    """The default server against the same server with one GPU switch turned (SWITCHES:
    cuDNN's attention on; decode steps from CUDA graphs), in alternating rounds: stateless
    requests at SWITCH_POINT from 16 clients (the batcher coalesces them into batches of
    changing size); num_sessions gqa sessions decoding together from a context new every
    round (cuDNN would plan each new length); one session's streamed step alone."""
    import sessions

    from mha_client.loadgen import GrpcTarget, LoadSpec, Workload, parse_seq_lens, run_load_sync

    batch, length = SWITCH_POINT
    workload = Workload("mha", parse_seq_lens(str(length)), EMBED, batch=batch)
    spec = LoadSpec(concurrency=16, duration_s=duration, warmup=16)
    seq: dict[str, list[float]] = {n: [] for n in names}
    tok: dict[str, list[float]] = {n: [] for n in names}
    lone: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            result = run_load_sync(lambda t=targets[name]: GrpcTarget(t), workload, spec)
            if result.errors:
                raise RuntimeError(f"{name} B={batch} L={length}: {result.errors}")
            seq[name].append(result.sequences_per_s)
            context = SWITCH_CONTEXT + r * (steps + 8)  # lengths no earlier round had
            pair = asyncio.run(
                sessions.batched_decode(targets[name], num_sessions, context, steps, 1)
            )
            tok[name].append(pair["concurrent_tokens_per_s"])
            lone_context = SWITCH_LONE_CONTEXT + r * (steps + 8)
            lone[name].append(asyncio.run(lone_step_s(targets[name], lone_context, steps)))
            print(
                f"  round {r + 1}, {name:6s}: stateless B={batch} L={length} "
                f"{seq[name][-1]:.0f} seq/s | {num_sessions} sessions from context {context}: "
                f"{tok[name][-1]:.0f} tok/s together | one step alone at {lone_context}: "
                f"{lone[name][-1] * 1e6:.0f} us",
                flush=True,
            )
    return {
        "batch": batch,
        "length": length,
        "sessions": num_sessions,
        "context": SWITCH_CONTEXT,
        "lone_context": SWITCH_LONE_CONTEXT,
        "steps": steps,
        "rounds": rounds,
        "flags": {n: ALL_SWITCHES[n] for n in names},
        "stateless_seq_per_s": {n: statistics.median(v) for n, v in seq.items()},
        "sessions_tokens_per_s": {n: statistics.median(v) for n, v in tok.items()},
        "lone_step_s": {n: statistics.median(v) for n, v in lone.items()},
        "samples": {"stateless": seq, "sessions": tok, "lone": lone},
    }


def main(argv: list[str] | None = None) -> int:
    """Section 8 alone, with more rounds or fewer switches (`make gpu` runs it with 2 rounds
    inside bench/gpu.py):

        python bench/gpu_served.py --switches served,graphs --rounds 4 --json-out out.json
        python bench/gpu_served.py --switches served,pinned   # --event-loop-cpu auto

    Without a CUDA GPU it says so and exits 0, measuring nothing (on the CPU the switches
    change nothing)."""
    import argparse
    import json
    import tempfile

    import torch
    from overhead import start_servers

    p = argparse.ArgumentParser(description="bench/gpu.py's section 8 alone")
    p.add_argument(
        "--switches",
        default=",".join(SWITCHES),
        help=f"served (the defaults) first, then any of {', '.join(list(ALL_SWITCHES)[1:])}",
    )
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--json-out", type=Path)
    args = p.parse_args(argv)
    names = tuple(args.switches.split(","))
    unknown = [n for n in names if n not in ALL_SWITCHES]
    if unknown or names[0] != "served":
        p.error(f"--switches: 'served' first, then any of {', '.join(ALL_SWITCHES)}; got {names}")
    if not torch.cuda.is_available():
        print(f"bench/gpu_served.py: skipped: torch {torch.__version__} sees no CUDA device")
        return 0
    variants = {n: ALL_SWITCHES[n] for n in names if ALL_SWITCHES[n]}
    with tempfile.TemporaryDirectory() as tmp:
        procs, targets = start_servers(Path(tmp), None, variants=variants)
        try:
            out = switches(targets, args.rounds, args.steps, names=names)
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait(30)
    base = names[0]
    for n in names[1:]:
        print(
            f"{n} / {base}: stateless "
            f"{out['stateless_seq_per_s'][n] / out['stateless_seq_per_s'][base]:.2f}x, "
            f"together {out['sessions_tokens_per_s'][n] / out['sessions_tokens_per_s'][base]:.2f}x, "
            f"alone {out['lone_step_s'][base] / out['lone_step_s'][n]:.2f}x (above 1: better)"
        )
    if args.json_out:
        args.json_out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
