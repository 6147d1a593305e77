"""`mha-serve --frontend-workers N` against N = 1 (issue 16, many cores), side by side in one run.

    python bench/frontend_workers.py                  # N = 1,2 on <= 4 cores, else 1,2,4,8
    python bench/frontend_workers.py --workers 1,2,4,8 --client-processes 4

One real server per N, all started first (`--torch-threads 1`, 127.0.0.1, metrics off), then
measured in alternating rounds (the order reversed every other round; round 0 warms up):
- stateless throughput, 16 and 128 tokens, 32 clients in a closed loop (mha_client.loadgen,
  requests serialized before the clock starts), over `--channels` connections so that the
  kernel's SO_REUSEPORT spreads them over the frontends;
- a streamed decode step at context 256 (overhead.py's bytes stream on one StreamSession,
  the steps of a round ending at the context), p50 over every round's steps;
- `--sessions` gqa sessions decoding together (64; 0 skips it): each client process prefills
  its share to `--context` over its share of the connections, all wait at one barrier, then
  step `--together-steps` tokens on every session at once (a stream each); tokens/s over
  all processes, from the first step sent to the last answer;
- the CPU each side used during the 16-token loads (engine process, frontends, the load
  generator, the hypervisor's steal), in cores, from /proc; the engine process's also split
  by thread: its main thread (the event loop) and its busiest other (the compute thread, or
  on CUDA a host thread spinning in a device sync), so a saturated engine process says which
  of the two is the bound.
Each N's ratio to N = 1 is of medians over the same rounds. Nothing here is a CI gate.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import datetime
import json
import multiprocessing
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from served_bench import OPTIONS, BytesStream, machine, start_served  # noqa: E402

EMBED = 512
MODEL = "mha"
SESSIONS_MODEL = "gqa"  # as bench/not_slower.py's and bench/sessions.py's sessions
START_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 60.0
CLK_TCK = os.sysconf("SC_CLK_TCK")
READY = re.compile(rb"SERVING models")


def default_workers() -> list[int]:
    return [1, 2] if (os.cpu_count() or 1) <= 4 else [1, 2, 4, 8]


# ----- servers -----------------------------------------------------------------------------


class Served:
    """One mha-serve with --frontend-workers N on a free port, SERVING (every frontend
    listening: the engine logs SERVING only then)."""

    def __init__(self, tmp: Path, workers: int, extra: list[str]) -> None:
        self.workers = workers
        self.name = f"n{workers}"
        self.log = tmp / f"{self.name}.log"
        flags = ["--torch-threads", "1", *extra, "--log-level", "INFO"]
        flags += ["--frontend-workers", str(workers)]
        self.proc, self.target = start_served(tmp, self.name, extra=flags)

    def wait_serving(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not READY.search(self.log.read_bytes()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"N={self.workers} did not start:\n{self.log.read_text()}")
            time.sleep(0.1)

    def pids(self) -> tuple[int, list[int]]:
        """(engine pid, its descendants' pids: the frontends)."""
        return self.proc.pid, descendants(self.proc.pid)

    def stop(self) -> int:
        """SIGTERM, as an orchestrator stops it: its exit code."""
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return self.proc.wait(STOP_TIMEOUT_S)
        except Exception:
            self.proc.kill()
            self.proc.wait()
            raise


def descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                children = Path(f"/proc/{parent}/task/{tid}/children").read_text().split()
            except OSError:
                continue
            for child in map(int, children):
                found.append(child)
                todo.append(child)
    return found


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads); 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime


def thread_cpu_s(pid: int) -> dict[int, float]:
    """User + system CPU seconds of each thread of a process, by thread id."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / CLK_TCK
    return out


def engine_threads(pid: int, before: dict[int, float], wall: float) -> dict[str, float]:
    """The engine process's cores split by thread since `before` (thread_cpu_s): its main
    thread (the event loop: the link's frames, validation, the batcher) and its busiest other
    thread (the compute thread, or on CUDA whatever waits for the device: a host that spins
    in a device sync burns a core doing nothing)."""
    after = thread_cpu_s(pid)
    delta = {tid: t - before.get(tid, 0.0) for tid, t in after.items()}
    loop = delta.pop(pid, 0.0)
    return {
        "engine_loop": loop / wall,
        "engine_busiest_other": max(delta.values(), default=0.0) / wall,
    }


def steal_s() -> float:
    with open("/proc/stat") as f:
        fields = f.readline().split()  # cpu user nice system idle iowait irq softirq steal
    return int(fields[8]) / CLK_TCK


# ----- throughput ----------------------------------------------------------------------------


def _load(target: str, seq_len: int, concurrency: int, channels: int, duration: float) -> dict:
    """One closed-loop load point (in this process or a client process of the pool)."""
    from mha_client.loadgen import GrpcTarget, LoadSpec, Workload, parse_seq_lens, run_load_sync

    workload = Workload(MODEL, parse_seq_lens(str(seq_len)), EMBED)
    spec = LoadSpec(concurrency=concurrency, duration_s=duration, warmup=2 * concurrency)
    result = run_load_sync(lambda: GrpcTarget(target, channels=channels), workload, spec)
    return {
        "seq_per_s": result.sequences_per_s,
        "errors": result.errors,
        "client_cpu_s": result.client_cpu_s,
        "p50_ms": result.latency.p50_ms,
    }


def throughput(
    served: Served,
    seq_len: int,
    args: argparse.Namespace,
    pool: concurrent.futures.Executor | None,
) -> dict:
    """seq/s of one load point, summed over the client processes, and the CPU each side used."""
    engine, frontends = served.pids()
    threads = thread_cpu_s(engine)
    before = (cpu_s(engine), [cpu_s(p) for p in frontends], steal_s(), time.perf_counter())
    k = args.client_processes
    shares = [args.concurrency // k + (i < args.concurrency % k) for i in range(k)]
    channel_shares = [max(1, args.channels // k) for _ in range(k)]
    point = (served.target, seq_len)
    if pool is None:
        parts = [_load(*point, shares[0], channel_shares[0], args.duration)]
    else:
        futures = [
            pool.submit(_load, *point, c, ch, args.duration)
            for c, ch in zip(shares, channel_shares, strict=True)
        ]
        parts = [f.result() for f in futures]
    wall = time.perf_counter() - before[3]
    errors: dict[str, int] = {}
    for part in parts:
        for code, n in part["errors"].items():
            errors[code] = errors.get(code, 0) + n
    if errors:
        raise RuntimeError(f"N={served.workers}, {seq_len} tokens: errors {errors}")
    seq_per_s = sum(p["seq_per_s"] for p in parts)
    cores = {
        "engine": (cpu_s(engine) - before[0]) / wall,
        "frontends": sum(cpu_s(p) - c for p, c in zip(frontends, before[1], strict=True)) / wall,
        "client": sum(p["client_cpu_s"] for p in parts) / wall,
        "steal": (steal_s() - before[2]) / wall,
        **engine_threads(engine, threads, wall),
    }
    # The server's CPU per sequence, engine and frontends: what the hop costs, whatever
    # share of the cores the machine's other work left the server.
    cores["server_ms_per_seq"] = (cores["engine"] + cores["frontends"]) / seq_per_s * 1e3
    return {"seq_per_s": seq_per_s, "cores": cores}


# ----- sessions decoding together --------------------------------------------------------------


def _together(
    target: str, sessions: int, channels: int, context: int, steps: int, seed: int, barrier: Any
) -> dict:
    """One client process's share of the sessions decoding together (or the whole, in this
    process): its sessions over `channels` connections, prefilled, then, past the barrier
    (None: none), `steps` one-token steps on each at once; its first instant, last and
    tokens."""
    return asyncio.run(_together_async(target, sessions, channels, context, steps, seed, barrier))


async def _together_async(
    target: str, sessions: int, channels: int, context: int, steps: int, seed: int, barrier: Any
) -> dict:
    from mha_client.sdk import AsyncClient

    rng = np.random.default_rng(seed)
    clients = [AsyncClient(target, timeout=600) for _ in range(max(1, min(channels, sessions)))]
    held = []
    try:
        for i in range(sessions):
            s = await clients[i % len(clients)].create_session(SESSIONS_MODEL)
            held.append(s)
            await s.step(rng.standard_normal((context, EMBED), dtype=np.float32))
        tokens = rng.standard_normal((sessions, steps, 1, EMBED), dtype=np.float32)
        if barrier is not None:
            barrier.wait(START_TIMEOUT_S)  # every process prefilled: all start at once

        async def decode(i: int) -> None:
            async with held[i].stream() as stream:
                for t in range(steps):
                    await stream.step(tokens[i, t])

        begin = time.time()
        await asyncio.gather(*(decode(i) for i in range(sessions)))
        end = time.time()
    finally:
        for s in held:
            await s.close()
        for c in clients:
            await c.close()
    return {"begin": begin, "end": end, "tokens": sessions * steps}


def together(
    served: Served,
    args: argparse.Namespace,
    pool: concurrent.futures.Executor | None,
    barrier: Any,
    seed: int,
) -> float:
    """tokens/s of --sessions sessions decoding together, over the client processes."""
    k = args.client_processes
    shares = [args.sessions // k + (i < args.sessions % k) for i in range(k)]
    channels = max(1, args.channels // k)
    steps = (args.context, args.together_steps)
    if pool is None:
        parts = [_together(served.target, shares[0], channels, *steps, seed, None)]
    else:
        futures = [
            pool.submit(_together, served.target, n, channels, *steps, seed + i, barrier)
            for i, n in enumerate(shares)
        ]
        parts = [f.result() for f in futures]
    wall = max(p["end"] for p in parts) - min(p["begin"] for p in parts)
    return sum(p["tokens"] for p in parts) / wall


# ----- decode step ----------------------------------------------------------------------------


class DecodeSide:
    """One server's session for the streamed step: prefilled to context - steps tokens,
    truncated back there before every round."""

    def __init__(self, target: str, context: int, steps: int) -> None:
        self.target, self.context, self.steps = target, context, steps
        self.start_len = context - steps

    async def open(self, prompt: np.ndarray, tokens: np.ndarray) -> None:
        from mha_client.messages import step_request
        from mha_client.sdk import AsyncClient

        self.client = AsyncClient(self.target)
        self.channel = grpc.aio.insecure_channel(self.target, options=OPTIONS)
        self.session = await self.client.create_session(MODEL)
        await self.session.step(prompt)
        self.payloads = [step_request(self.session.id, t, {}).SerializeToString() for t in tokens]

    async def round(self) -> list[float]:
        await self.session.truncate(self.start_len)
        stream = BytesStream(self.channel)
        times = []
        for p in self.payloads:
            t = time.perf_counter()
            await stream.round_trip(p)
            times.append(time.perf_counter() - t)
        await stream.close()
        return times

    async def close(self) -> None:
        await self.session.close()
        await self.client.close()
        await self.channel.close()


# ----- the run ---------------------------------------------------------------------------------


async def _decode_round(sides: dict[int, DecodeSide], order: list[int]) -> dict[int, list]:
    return {n: await sides[n].round() for n in order}


def measure(servers: dict[int, Served], args: argparse.Namespace) -> dict[str, Any]:
    loop = asyncio.new_event_loop()
    rng = np.random.default_rng(0)
    start_len = args.context - args.steps
    prompt = rng.standard_normal((start_len, EMBED), dtype=np.float32)
    tokens = rng.standard_normal((args.steps, 1, EMBED), dtype=np.float32)
    sides = {n: DecodeSide(s.target, args.context, args.steps) for n, s in servers.items()}
    for side in sides.values():
        loop.run_until_complete(side.open(prompt, tokens))
    pool = barrier = manager = None
    if args.client_processes > 1:
        spawn = multiprocessing.get_context("spawn")
        pool = concurrent.futures.ProcessPoolExecutor(args.client_processes, mp_context=spawn)
        if args.sessions:
            manager = spawn.Manager()
            barrier = manager.Barrier(args.client_processes)
    seq: dict[tuple[int, int], list[float]] = {(n, L): [] for n in servers for L in args.seq_lens}
    tok: dict[int, list[float]] = {n: [] for n in servers}
    cores: dict[int, list[dict]] = {n: [] for n in servers}
    steps: dict[int, list[float]] = {n: [] for n in servers}
    try:
        for r in range(args.rounds + 1):  # round 0 warms up and is not counted
            order = list(servers) if r % 2 else list(servers)[::-1]
            for seq_len in args.seq_lens:
                for n in order:
                    point = throughput(servers[n], seq_len, args, pool)
                    label = "warm-up" if r == 0 else f"round {r}"
                    print(
                        f"{label}: N={n} {seq_len} tokens {point['seq_per_s']:.0f} seq/s",
                        flush=True,
                    )
                    if r > 0:
                        seq[(n, seq_len)].append(point["seq_per_s"])
                        if seq_len == args.seq_lens[0]:
                            cores[n].append(point["cores"])
            if args.sessions:
                for n in order:
                    rate = together(servers[n], args, pool, barrier, seed=r)
                    label = "warm-up" if r == 0 else f"round {r}"
                    print(
                        f"{label}: N={n} {args.sessions} sessions together {rate:.0f} tok/s",
                        flush=True,
                    )
                    if r > 0:
                        tok[n].append(rate)
            decoded = loop.run_until_complete(_decode_round(sides, order))
            if r > 0:
                for n, t in decoded.items():
                    steps[n] += t
    finally:
        if pool is not None:
            pool.shutdown()
        if manager is not None:
            manager.shutdown()
        for side in sides.values():
            loop.run_until_complete(side.close())
        loop.close()
    rows = []
    for n in servers:
        row: dict[str, Any] = {"workers": n}
        for seq_len in args.seq_lens:
            row[f"seq_per_s_{seq_len}"] = statistics.median(seq[(n, seq_len)])
            row[f"samples_{seq_len}"] = seq[(n, seq_len)]
        if args.sessions:
            row["together_tok_per_s"] = statistics.median(tok[n])
            row["together_samples"] = tok[n]
        row["decode_p50_ms"] = statistics.median(steps[n]) * 1e3
        row["cores"] = {k: statistics.median(c[k] for c in cores[n]) for k in cores[n][0]}
        rows.append(row)
    base = rows[0]
    for row in rows:
        for seq_len in args.seq_lens:
            key = f"seq_per_s_{seq_len}"
            row[f"ratio_{seq_len}"] = row[key] / base[key]
        row["decode_ratio"] = row["decode_p50_ms"] / base["decode_p50_ms"]
        if args.sessions:
            row["together_ratio"] = row["together_tok_per_s"] / base["together_tok_per_s"]
    return {"rows": rows}


def table(results: dict[str, Any]) -> str:
    m, s = results["machine"], results["settings"]
    lens = s["seq_lens"]
    sessions = s.get("sessions", 0)
    head = ["N"]
    for L in lens:
        head += [f"{L} tok seq/s", "vs N=1"]
    if sessions:
        head += [f"{sessions} sessions together tok/s", "vs N=1"]
    head += [f"step p50 ms (ctx {s['context']})", "vs N=1"]
    head += [f"cores at {lens[0]} tok: engine", "its loop thread", "its busiest other thread"]
    head += ["frontends", "client", "steal"]
    head += ["server CPU ms/seq"]
    lines = [
        f"machine: {m['cpu']}, {m['cores']} cores, Python {m['python']}; load average "
        f"{m['loadavg_at_start'][0]:.1f} at start, {m['loadavg_at_end'][0]:.1f} at end",
        f"{s['rounds']} rounds, {s['duration_s']:g} s per load point, {s['concurrency']} "
        f"clients over {s['channels']} channels in {s['client_processes']} process(es), "
        f"{s['steps']} steps per round"
        + (f"; {sessions} gqa sessions x {s['together_steps']} steps together" if sessions else ""),
        "| " + " | ".join(head) + " |",
        "|" + " ---: |" * len(head),
    ]
    for row in results["rows"]:
        cells = [str(row["workers"])]
        for L in lens:
            cells += [f"{row[f'seq_per_s_{L}']:.0f}", f"{row[f'ratio_{L}']:.2f}"]
        c = row["cores"]
        if sessions:
            cells += [f"{row['together_tok_per_s']:.0f}", f"{row['together_ratio']:.2f}"]
        cells += [f"{row['decode_p50_ms']:.3f}", f"{row['decode_ratio']:.2f}"]
        split = [c.get("engine_loop"), c.get("engine_busiest_other")]  # (older JSON: none)
        cells += [f"{c['engine']:.2f}", *("-" if v is None else f"{v:.2f}" for v in split)]
        cells += [f"{c['frontends']:.2f}", f"{c['client']:.2f}"]
        cells += [f"{c['steal']:.2f}", f"{c['server_ms_per_seq']:.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append(
        "servers' exit codes on SIGTERM: "
        + ", ".join(f"N={n}: {code}" for n, code in results["exit_codes"].items())
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--workers",
        type=lambda s: [int(x) for x in s.split(",")],
        default=default_workers(),
        help="values of --frontend-workers, the first the base of the ratios "
        "(default 1,2 on <= 4 cores, else 1,2,4,8)",
    )
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (+1 warm-up)")
    p.add_argument("--duration", type=float, default=5.0, help="seconds per load point")
    p.add_argument("--concurrency", type=int, default=32, help="closed-loop clients")
    p.add_argument("--channels", type=int, default=32, help="connections the clients share")
    p.add_argument(
        "--client-processes",
        type=int,
        default=1 if (os.cpu_count() or 1) <= 4 else 4,
        help="load generator processes sharing the clients (one event loop caps a generator "
        "too; default 1 on <= 4 cores, else 4)",
    )
    p.add_argument("--seq-lens", type=lambda s: [int(x) for x in s.split(",")], default=[16, 128])
    p.add_argument("--context", type=int, default=256, help="decode step context")
    p.add_argument("--steps", type=int, default=64, help="decode steps per round and server")
    p.add_argument(
        "--sessions",
        type=int,
        default=64,
        help="gqa sessions decoding together, at --context, over the client processes (0 skips)",
    )
    p.add_argument(
        "--together-steps", type=int, default=16, help="steps of each session decoding together"
    )
    p.add_argument(
        "--server-arg", action="append", default=[], metavar="FLAG", help="a flag for every server"
    )
    p.add_argument(
        "--json-out", type=Path, default=ROOT / "bench" / "results" / "frontend_workers.json"
    )
    args = p.parse_args(argv)
    if args.steps >= args.context or args.client_processes < 1 or not args.workers:
        p.error("--steps must be below --context, --client-processes >= 1, --workers non-empty")
    if args.sessions < 0 or args.together_steps < 1:
        p.error("--sessions must be >= 0 and --together-steps >= 1")
    if args.sessions and args.sessions < args.client_processes:
        p.error(f"--sessions {args.sessions}: at least one per client process")
    started = time.perf_counter()
    results: dict[str, Any] = {
        "command": " ".join(["python", "bench/frontend_workers.py", *(argv or sys.argv[1:])]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "settings": {
            k: getattr(args, k)
            for k in ("workers", "rounds", "concurrency", "channels", "client_processes")
            + ("seq_lens", "context", "steps", "sessions", "together_steps", "server_arg")
        }
        | {"duration_s": args.duration},
    }
    with tempfile.TemporaryDirectory(prefix="mha-fwbench-") as d:
        servers = {n: Served(Path(d), n, args.server_arg) for n in args.workers}
        exit_codes: dict[int, int | None] = {}
        try:
            for s in servers.values():
                s.wait_serving()
            results |= measure(servers, args)
        finally:
            for n, s in servers.items():
                exit_codes[n] = s.stop()
        bad = {n: c for n, c in exit_codes.items() if c != 0}
        if bad:
            for n in bad:
                print(servers[n].log.read_text()[-4000:], file=sys.stderr)
            raise RuntimeError(f"servers exited non-zero on SIGTERM: {bad}")
    results["exit_codes"] = exit_codes
    results["machine"]["loadavg_at_end"] = os.getloadavg()
    results["elapsed_s"] = time.perf_counter() - started
    print(table(results))
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    args.json_out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.json_out} ({results['elapsed_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
