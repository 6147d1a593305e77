"""Serving overhead against the machine's own limits (issue 16), side by side in one run.

    python bench/overhead.py            # ~4 min: docs/benchmarks-overhead.md, bench/results/overhead.json
    python bench/overhead.py --quick    # ~1.5 min smoke run, noisier

1. Decode step, per model (mha, gqa, mqa) and context (256, 1024, 4096): a served streamed
   step (a real server on loopback, StreamSession, request and reply as bytes; the steps of a
   round end at the context, each round truncates back to where they start) against its
   limit, the same step in plain torch in this process (fused qkv, a preallocated contiguous
   K/V, scaled_dot_product_attention with each KV head's query heads as its rows, wo) plus
   one round trip of a bare grpc.aio bidi echo carrying the same request bytes. The three alternate in rounds; medians over all steps.
   The step through the SDK's generated stubs (messages, as a user writes it) is reported too.
   The floor (bench/floor_server.py, in the same rounds): the same bytes through the least a
   one-process Python grpc.aio server does for this step (parse, the bare step, serialize),
   nothing of mha-serve in its path: floor / limit is what the limit's definition (two parts
   each measured warm and alone, added) loses to the machine, served / floor is ours. The
   spin side (the floor's stream busy-waiting as long as the bare step, no step) splits the
   floor's excess into the cost of waiting between the wire's messages and the step's own
   cost inside a server.
2. Small stateless requests, 16 and 128 tokens, 32 clients (mha_client.loadgen, closed loop):
   served seq/s against 1 / (1 / in-process best-batch seq/s + 1 / echo server req/s), the
   three alternating in rounds; the floor server's Attend (inline and batched, the better
   kept) in the same rounds.
3. Wire: payload copies of a 16 MiB tensor in every codec path (bench/copies.py, in a process
   of its own: it changes the allocator's settings).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from overhead_report import render, write_report  # noqa: E402
from served_bench import (  # noqa: E402
    OPTIONS,
    BytesStream,
    free_port,
    machine,
    start,
    start_served,
)

EMBED = 512
MODELS = ("mha", "gqa", "mqa")
CONTEXTS = (256, 1024, 4096)
TARGETS = {"decode_step_ratio_max": 1.3, "small_16_min": 0.85, "small_128_min": 0.95, "copies": 2}
# The floor servers (bench/floor_server.py) by target name: their Attend mode. "floor" also
# answers the decode step.
FLOORS = {"floor": "inline", "floor_batched": "batched"}
# The floor again with its loop busy polling (--floor-busy-poll-us): decode steps only.
FLOOR_BUSY = "floor_busy"


# ----- the echo server: the wire's own cost, nothing else -------------------------------


async def serve_echo(port: int) -> None:
    """A minimal grpc.aio server: Attend answers its request bytes, StreamSession echoes each
    message. No (de)serializers, no work."""

    async def attend(request: bytes, context: Any) -> bytes:
        return request

    async def stream(requests: Any, context: Any) -> Any:
        async for request in requests:
            yield request

    await serve_methods(port, attend, stream, "echo")


PIN_ENV = "MHA_BENCH_EVENT_LOOP_CPU"  # the echo's and the floor's event loop CPU (--pin)


async def serve_methods(port: int, attend: Any, stream: Any, name: str) -> None:
    """A grpc.aio server on 127.0.0.1:port whose Attend and StreamSession are these handlers
    (bytes in and out, no serializers); prints "<name> ready" once it listens. With PIN_ENV
    set, the calling thread (the event loop's) and gRPC's threads, started from it next, run
    on that CPU, as mha-serve's with --event-loop-cpu."""
    if os.environ.get(PIN_ENV):
        os.sched_setaffinity(0, {int(os.environ[PIN_ENV])})
    server = grpc.aio.server(options=OPTIONS)
    handlers = {
        "Attend": grpc.unary_unary_rpc_method_handler(attend),
        "StreamSession": grpc.stream_stream_rpc_method_handler(stream),
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("mha.v1.AttentionService", handlers),)
    )
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print(f"{name} ready", flush=True)
    await server.wait_for_termination()


def start_servers(
    tmp: Path,
    baseline: Path | None,
    extra: list[str] | None = None,
    variants: dict[str, list[str]] | None = None,
    floor: bool = False,
    pin: int | None = None,
    floor_busy_poll_us: int = 0,
) -> tuple[list[subprocess.Popen], dict]:
    """{"served", "echo"[, "baseline"][, each variant][, each of FLOORS]}: address of each,
    all ready. A variant is this checkout's server with more flags (e.g. a feature turned
    off); floor: the floor servers too; pin: every server's event loop on this CPU
    (mha-serve's --event-loop-cpu, PIN_ENV for the echo and the floor); floor_busy_poll_us:
    FLOOR_BUSY too, the floor polling that long (floor_server.py --busy-poll-us)."""
    if pin is not None:
        extra = [*(extra or []), f"--event-loop-cpu={pin}"]
    from mha_client.sdk import Client

    procs, targets = [], {}
    for name, tree in (("served", None), ("baseline", baseline)):
        if name == "served" or tree is not None:
            proc, targets[name] = start_served(tmp, name, tree, extra)
            procs.append(proc)
    for name, flags in (variants or {}).items():
        proc, targets[name] = start_served(tmp, name, None, [*(extra or []), *flags])
        procs.append(proc)
    bare = {"echo": [__file__, "--serve-echo"]}  # each prints "<name's first word> ready"
    for name, mode in FLOORS.items() if floor else ():
        bare[name] = [str(ROOT / "bench" / "floor_server.py"), "--attend", mode, "--port"]
    if floor and floor_busy_poll_us:
        bare[FLOOR_BUSY] = [
            str(ROOT / "bench" / "floor_server.py"),
            f"--busy-poll-us={floor_busy_poll_us}",
            "--port",
        ]
    logs = {}
    for name, cmd in bare.items():
        port = free_port()
        logs[name] = (tmp / f"{name}.log", len(procs))
        env = {} if pin is None else {PIN_ENV: str(pin)}
        procs.append(start([sys.executable, *cmd, str(port)], logs[name][0], env))
        targets[name] = f"127.0.0.1:{port}"
    for name, target in targets.items():
        if name not in bare:
            with Client(target) as c:
                c.wait_ready(180)
    deadline = time.monotonic() + 60
    for name, (log, i) in logs.items():
        while f"{name.split('_')[0]} ready".encode() not in log.read_bytes():
            if time.monotonic() > deadline or procs[i].poll() is not None:
                raise RuntimeError(f"{name} server did not start: {log.read_text()}")
            time.sleep(0.1)
    return procs, targets


# ----- 1. decode step --------------------------------------------------------------------


class BareStep:
    """One model's decode step in plain torch: fused qkv, K/V written into a preallocated
    contiguous (1, KVH, S, D) buffer, scaled_dot_product_attention (each KV head's query
    heads as its rows), wo."""

    def __init__(self, model: str, capacity: int) -> None:
        import torch
        from inprocess import load

        self.module = load(model)
        c = self.module.config
        self.k = torch.zeros(1, c.num_kv_heads, capacity, c.head_dim)  # (1, KVH, S, D)
        self.v = torch.zeros_like(self.k)

    def __call__(self, x: Any, pos: int) -> Any:
        import torch
        import torch.nn.functional as F

        m, c = self.module, self.module.config
        H, KVH, D = c.num_heads, c.num_kv_heads, c.head_dim
        with torch.inference_mode():
            qkv = F.linear(x, m.wqkv.weight, m.wqkv.bias)  # (1, 1, (H + 2 KVH) D)
            q, k, v = qkv.split([H * D, KVH * D, KVH * D], dim=-1)
            self.k[:, :, pos].copy_(k.view(1, KVH, D))
            self.v[:, :, pos].copy_(v.view(1, KVH, D))
            # Each KV head's query heads as the rows of one call (the fastest form on the
            # CPU: bench/decode_attention.py): (1, KVH, G, D), query head h = kv * G + g
            y = F.scaled_dot_product_attention(
                q.view(1, KVH, H // KVH, D), self.k[:, :, : pos + 1], self.v[:, :, : pos + 1]
            )
            return F.linear(y.reshape(1, 1, H * D), m.wo.weight, m.wo.bias)


async def decode_steps(
    targets: dict[str, str], rounds: int, steps: int, client_cpus: set[int] | None = None
) -> list[dict]:
    """Per model and context: served (and baseline) steps, SDK steps, echo, bare torch, and
    the floor server's steps when it runs (targets["floor"]). client_cpus: this thread (the
    clients and the in-process step) runs on these meanwhile (--pin: not the servers')."""
    before = os.sched_getaffinity(0) if client_cpus else None
    if client_cpus:
        os.sched_setaffinity(0, client_cpus)
    try:
        return await _decode_steps(targets, rounds, steps)
    finally:
        if before is not None:
            os.sched_setaffinity(0, before)


async def _decode_steps(targets: dict[str, str], rounds: int, steps: int) -> list[dict]:
    import torch

    from mha_client.api import attention_pb2 as pb
    from mha_client.messages import step_request
    from mha_client.sdk import AsyncClient

    torch.set_num_threads(1)  # a 1-token step is fastest on one thread here (engine does too)
    servers = [n for n in targets if n not in ("echo", FLOOR_BUSY) and n not in FLOORS]
    floors = [n for n in ("floor", FLOOR_BUSY) if n in targets]  # (servers: "served" first)
    rows = []
    rng = np.random.default_rng(0)
    clients = {n: AsyncClient(targets[n]) for n in servers}
    channels = {n: grpc.aio.insecure_channel(a, options=OPTIONS) for n, a in targets.items()}
    try:
        for model in MODELS:
            for ctx in CONTEXTS:
                # Steps that end at the context (the models' max_seq_len is 4096).
                start_len = ctx - steps
                bare = BareStep(model, ctx)
                prompt = rng.standard_normal((start_len, EMBED), dtype=np.float32)
                tokens = rng.standard_normal((steps, 1, EMBED), dtype=np.float32)
                xs = [torch.from_numpy(tokens[t]).view(1, 1, EMBED) for t in range(steps)]
                sessions, payloads = {}, {}
                for n in servers:
                    sessions[n] = await clients[n].create_session(model)
                    await sessions[n].step(prompt)
                    payloads[n] = [
                        step_request(sessions[n].id, tokens[t], {}).SerializeToString()
                        for t in range(steps)
                    ]
                for n in ("echo", *floors):
                    payloads[n] = payloads["served"]
                # The floor's stream: the model, its K/V's length and the first position.
                floor_meta = (
                    ("floor-model", model),
                    ("floor-start", str(start_len)),
                    ("floor-context", str(ctx)),
                )
                # The spin side (the floor's stream waiting as long as the bare step takes
                # in a tight loop, without its memory traffic): that length, measured now.
                spin_meta = ()
                if floors:
                    warm = []
                    for i, x in enumerate(xs):
                        t = time.perf_counter()
                        bare(x, start_len + i)
                        warm.append(time.perf_counter() - t)
                    spin_us = statistics.median(warm) * 1e6
                    spin_meta = (*floor_meta, ("floor-spin-us", f"{spin_us:.1f}"))
                    payloads["spin"] = payloads["served"]
                spins = ["spin"] if floors else []
                sides = [*servers, *floors, *spins, "sdk", "echo", "bare"]
                times: dict[str, list[float]] = {k: [] for k in sides}
                server_total: list[float] = []  # receipt to reply, as the server timed it
                for r in range(rounds + 1):  # round 0 warms up and is not counted
                    sample: dict[str, list[float]] = {k: [] for k in sides}
                    totals = []
                    order = [*servers, *floors, *spins, "echo"]  # reversed every other
                    for n in order if r % 2 else order[::-1]:  # round: no side always
                        if n in sessions:  # follows the same one
                            await sessions[n].truncate(start_len)
                        meta = {"floor": floor_meta, FLOOR_BUSY: floor_meta, "spin": spin_meta}.get(
                            n
                        )
                        stream = BytesStream(channels["floor" if n == "spin" else n], meta)
                        for p in payloads[n]:
                            t = time.perf_counter()
                            reply = await stream.round_trip(p)
                            sample[n].append(time.perf_counter() - t)
                            if n == "served":
                                totals.append(pb.AttendResponse.FromString(reply).timing.total_ms)
                        await stream.close()
                    await sessions["served"].truncate(start_len)
                    async with sessions["served"].stream() as sdk_stream:
                        for t in range(steps):
                            start = time.perf_counter()
                            await sdk_stream.step(tokens[t])
                            sample["sdk"].append(time.perf_counter() - start)
                    for i, x in enumerate(xs):
                        t = time.perf_counter()
                        bare(x, start_len + i)
                        sample["bare"].append(time.perf_counter() - t)
                    if r > 0:
                        for k in times:
                            times[k] += sample[k]
                        server_total += totals
                for session in sessions.values():
                    await session.close()
                ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
                limit = ms["bare"] + ms["echo"]
                row = {
                    "model": model,
                    "context": ctx,
                    "served_ms": ms["served"],
                    "sdk_ms": ms["sdk"],
                    "inprocess_ms": ms["bare"],
                    "echo_ms": ms["echo"],
                    "limit_ms": limit,
                    "ratio": ms["served"] / limit,
                    "sdk_ratio": ms["sdk"] / limit,
                    "server_total_ms": statistics.median(server_total),
                    "steps": len(times["served"]),
                }
                line = (
                    f"decode {model} ctx {ctx:5d}: served {row['served_ms']:.3f} ms "
                    f"(sdk {row['sdk_ms']:.3f}) | in-process {row['inprocess_ms']:.3f} + echo "
                    f"{row['echo_ms']:.3f} = {limit:.3f} ms | ratio {row['ratio']:.2f} "
                    f"(sdk {row['sdk_ratio']:.2f})"
                )
                if floors:
                    row["floor_ms"] = ms["floor"]
                    row["floor_ratio"] = ms["floor"] / limit
                    row["served_over_floor"] = ms["served"] / ms["floor"]
                    row["spin_us"] = spin_us
                    row["spin_ms"] = ms["spin"]
                    line += (
                        f" | spin {ms['spin']:.3f} ms ({spin_us:.0f} us) | floor "
                        f"{ms['floor']:.3f} ms: floor/limit {row['floor_ratio']:.2f}, "
                        f"served/floor {row['served_over_floor']:.2f}"
                    )
                if FLOOR_BUSY in ms:  # the floor polling: what a polling variant is over
                    row["floor_busy_ms"] = ms[FLOOR_BUSY]
                    row["floor_busy_ratio"] = ms[FLOOR_BUSY] / limit
                    line += f" | floor busy {ms[FLOOR_BUSY]:.3f} ms ({row['floor_busy_ratio']:.2f})"
                for other in servers[1:]:  # the baseline, the variants
                    row[f"{other}_ms"] = ms[other]
                    row[f"{other}_ratio"] = ms[other] / limit
                    line += f" | {other} {ms[other]:.3f} ms ({row[f'{other}_ratio']:.2f})"
                rows.append(row)
                print(line, flush=True)
    finally:
        for c in clients.values():
            await c.close()
        for ch in channels.values():
            await ch.close()
    return rows


# ----- 2. small stateless requests -------------------------------------------------------


def small_requests(
    targets: dict[str, str],
    rounds: int,
    duration_s: float,
    concurrency: int,
    sweep_s: float,
    seq_lens: tuple[int, ...] = (16, 128),
) -> list[dict]:
    import torch
    from inprocess import BATCH_SIZES, load, time_forward

    from mha_client.loadgen import GrpcTarget, LoadSpec, Workload, parse_seq_lens, run_load_sync

    module = load("mha")
    rows = []
    thread_counts = sorted({1, os.cpu_count() or 1})
    for seq_len in seq_lens:
        # The best batch size per torch thread count, found once; then every round times
        # each and keeps the faster (the limit is the best the machine does at that moment:
        # one thread can beat all cores when others hold them, and the other way round).
        best_batch: dict[int, int] = {}
        for threads in thread_counts:
            torch.set_num_threads(threads)
            rates = {}
            for batch in BATCH_SIZES:
                s, _ = time_forward(module, torch.randn(batch, seq_len, EMBED), sweep_s)
                rates[batch] = batch / s
            best_batch[threads] = max(rates, key=rates.__getitem__)
        picked: list[tuple[int, int]] = []  # (threads, batch) of each round's best
        workload = Workload("mha", parse_seq_lens(str(seq_len)), EMBED)
        spec = LoadSpec(concurrency=concurrency, duration_s=duration_s, warmup=2 * concurrency)
        loaded = {n: t for n, t in targets.items() if n != FLOOR_BUSY}  # (decode steps only)
        samples: dict[str, list[float]] = {n: [] for n in (*loaded, "inprocess")}
        for r in range(rounds + 1):  # round 0 warms up (a server's first seconds are slow)
            order = list(loaded.items())  # reversed every other round, as for steps
            for name, target in order if r % 2 else order[::-1]:
                result = run_load_sync(lambda t=target: GrpcTarget(t), workload, spec)
                if result.errors:
                    raise RuntimeError(f"{name}, {seq_len} tokens: errors {result.errors}")
                if r > 0:
                    samples[name].append(result.sequences_per_s)
            if r == 0:
                continue
            rates = {}
            for threads, batch in best_batch.items():
                torch.set_num_threads(threads)
                s, _ = time_forward(module, torch.randn(batch, seq_len, EMBED), 0.5)
                rates[(threads, batch)] = batch / s
            best = max(rates, key=rates.__getitem__)
            picked.append(best)
            samples["inprocess"].append(rates[best])
        med = {k: statistics.median(v) for k, v in samples.items()}
        ceiling = 1 / (1 / med["inprocess"] + 1 / med["echo"])
        row = {
            "seq_len": seq_len,
            "concurrency": concurrency,
            "served_seq_per_s": med["served"],
            "inprocess_seq_per_s": med["inprocess"],
            "inprocess_best_batch": statistics.mode(b for _, b in picked),
            "inprocess_torch_threads": statistics.mode(t for t, _ in picked),
            "inprocess_picked": picked,
            "echo_req_per_s": med["echo"],
            "ceiling_seq_per_s": ceiling,
            "ratio": med["served"] / ceiling,
            "samples": samples,
        }
        line = ""
        if all(n in med for n in FLOORS):  # the better of the floor's two Attend modes
            for name, mode in FLOORS.items():
                row[f"floor_{mode}_seq_per_s"] = med[name]
            best = max(FLOORS, key=med.__getitem__)
            row["floor_best"] = FLOORS[best]
            row["floor_seq_per_s"] = med[best]
            row["floor_ratio"] = med[best] / ceiling
            row["served_over_floor"] = med["served"] / med[best]
            line += (
                f" | floor {med[best]:.0f} seq/s ({FLOORS[best]}; inline {med['floor']:.0f}, "
                f"batched {med['floor_batched']:.0f}): floor/ceiling {row['floor_ratio']:.2f}, "
                f"served/floor {row['served_over_floor']:.2f}"
            )
        for other in targets:
            if other in ("served", "echo", FLOOR_BUSY) or other in FLOORS:
                continue
            row[f"{other}_seq_per_s"] = med[other]
            row[f"{other}_ratio"] = med[other] / ceiling
            line += f" | {other} {med[other]:.0f} seq/s ({row[f'{other}_ratio']:.2f})"
        rows.append(row)
        print(
            f"small L={seq_len}: served {med['served']:.0f} seq/s | in-process "
            f"{med['inprocess']:.0f} (threads, batch per round {picked}), echo {med['echo']:.0f} req/s -> "
            f"ceiling {ceiling:.0f} | ratio {row['ratio']:.2f}{line}",
            flush=True,
        )
    return rows


# ----- 3. wire copies, and the run ---------------------------------------------------------


def wire_copies(tmp: Path) -> dict[str, Any]:
    out = tmp / "copies.json"
    subprocess.run(
        [sys.executable, str(ROOT / "bench" / "copies.py"), "--json-out", str(out)],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer rounds and shorter loads")
    p.add_argument("--rounds", type=int, help="alternating rounds (default 3, quick 2)")
    p.add_argument("--steps", type=int, default=64, help="decode steps per round and side")
    p.add_argument("--duration", type=float, help="seconds per load point (default 5, quick 2)")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--docs", type=Path, default=ROOT / "docs")
    p.add_argument("--json-out", type=Path, default=ROOT / "bench" / "results" / "overhead.json")
    p.add_argument("--from-json", type=Path, help="redraw the docs from a run, no measuring")
    p.add_argument(
        "--baseline-tree",
        type=Path,
        help="also measure mha-serve as this checkout's code runs it (before/after in one run)",
    )
    p.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="a flag for the served servers, e.g. --server-arg=--torch-threads=1 (repeatable)",
    )
    p.add_argument(
        "--frontend-workers",
        default=None,
        metavar="N,N,...",
        help="then bench/frontend_workers.py's curve for these --frontend-workers values "
        "(default 1,2 on <= 4 cores, else 1,2,4,8; 'none' skips it)",
    )
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=FLAG[,FLAG]",
        help="also this checkout's server with these flags, e.g. "
        "noinline=--inline-lone-requests=false (repeatable)",
    )
    p.add_argument(
        "--pin",
        type=int,
        metavar="CPU",
        help="every server's event loop on this CPU (mha-serve's --event-loop-cpu; the echo's "
        "and the floor's alike), the decode steps' client and in-process step on the others; "
        "not with --baseline-tree (a tree before the flag), no frontend-workers curve",
    )
    p.add_argument(
        "--floor-busy-poll-us",
        type=int,
        default=0,
        metavar="US",
        help="the decode steps' floor once more, its event loop busy polling this long (as "
        "a --variant with --busy-poll-us does: what that variant is over)",
    )
    p.add_argument("--serve-echo", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    client_cpus = None
    if args.pin is not None and not args.from_json and not args.serve_echo:
        allowed = os.sched_getaffinity(0)
        if args.baseline_tree is not None:
            p.error("--pin starts servers with --event-loop-cpu: not with --baseline-tree")
        if args.pin not in allowed or len(allowed) < 2:
            p.error(f"--pin {args.pin}: give one of {sorted(allowed)}, with another left over")
        client_cpus = allowed - {args.pin}
        args.frontend_workers = "none"  # (frontend workers take no --event-loop-cpu)
    if args.serve_echo:
        asyncio.run(serve_echo(args.serve_echo))
        return 0
    if args.from_json:
        write_report(json.loads(args.from_json.read_text()), args.docs, TARGETS)
        return 0
    variants = {}
    for v in args.variant:
        name, _, flags = v.partition("=")
        variants[name] = [f for f in flags.split(",") if f]
    rounds = args.rounds or (2 if args.quick else 3)
    duration = args.duration or (2.0 if args.quick else 5.0)
    started = time.perf_counter()
    results: dict[str, Any] = {
        "command": " ".join(["python", "bench/overhead.py", *(argv or sys.argv[1:])]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "settings": {"rounds": rounds, "steps": args.steps, "duration_s": duration},
        "baseline_tree": None if args.baseline_tree is None else str(args.baseline_tree),
        "variants": variants,
        "server_args": args.server_arg,
        "pin": args.pin,
        "floor_busy_poll_us": args.floor_busy_poll_us,
        "targets": TARGETS,
    }
    with tempfile.TemporaryDirectory(prefix="mha-overhead-") as d:
        tmp = Path(d)
        results["wire"] = wire_copies(tmp)
        procs, targets = start_servers(
            tmp,
            args.baseline_tree,
            args.server_arg,
            variants,
            floor=True,
            pin=args.pin,
            floor_busy_poll_us=args.floor_busy_poll_us,
        )
        try:
            results["decode"] = asyncio.run(decode_steps(targets, rounds, args.steps, client_cpus))
            results["small"] = small_requests(
                targets, rounds, duration, args.concurrency, 0.2 if args.quick else 0.4
            )
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait(30)
    results["machine"]["loadavg_at_end"] = os.getloadavg()
    results["elapsed_s"] = time.perf_counter() - started
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    args.json_out.write_text(json.dumps(results, indent=2) + "\n")
    write_report(results, args.docs, TARGETS)
    print(render(results, TARGETS, notes=False))  # every ratio with the limit it measured
    print(f"wrote {args.json_out} and {args.docs / 'benchmarks-overhead.md'}")
    if args.frontend_workers != "none":  # the many-cores part, in the same command
        import frontend_workers  # (the many-cores part: imported only when it runs)

        workers = args.frontend_workers or ",".join(map(str, frontend_workers.default_workers()))
        fw_args = ["--workers", workers, "--rounds", str(rounds), "--duration", str(duration)]
        return frontend_workers.main(fw_args + [f"--server-arg={a}" for a in args.server_arg])
    return 0


if __name__ == "__main__":
    sys.exit(main())
