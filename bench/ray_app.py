"""The Ray Serve app (deploy/ray/serve_config.yaml) beside the standalone server, the plain
`@serve.batch` baseline and, with --previous, the previous design (another checkout of the
project, e.g. a git worktree of an older main), in one run: stateless throughput at 16 and
128 tokens with 32 clients, and the streamed decode step at contexts 256 and 4096.

    python bench/ray_app.py [--duration 10] [--rounds 3] [--steps 64] [--previous DIR]
    python bench/ray_app.py --replicas 1,2,4,8     # the scaling curve (a machine with cores)

Prints the tables docs/ray.md shows and writes bench/results/ray_app.json (the curve:
bench/results/ray_app_replicas.json).

Every system runs at once, each in its own process tree, on 127.0.0.1, the load generator
(mha_client.loadgen) in this process. Throughput: in each of --rounds rounds every system is
measured in turn; decode steps: the standalone server's and the Ray apps' alternating. So
whatever else runs on the machine meanwhile falls on each alike, and a round's ratios
compare neighbours in time. `--serve PORT` is the Ray app's own process: a local Ray with
the committed serve config, its gRPC proxy on PORT.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(ROOT))  # tests.ray_app.cluster: the committed config on free ports
import report  # noqa: E402
import run_all  # noqa: E402
from run_all import HEADLINE_CONCURRENCY, SEQ_LENS, Server, measure_point, start_system  # noqa: E402

from mha_client.api import attention_pb2 as pb  # noqa: E402
from mha_client.api import attention_pb2_grpc as pb_grpc  # noqa: E402
from mha_client.loadgen import GrpcTarget  # noqa: E402
from mha_client.sdk import Client  # noqa: E402
from mha_client.tensors import to_proto  # noqa: E402

MODEL, EMBED = "mha", 512
CONTEXTS = (256, 4096)
WARMUP_STEPS = 4
DECODE_ROUNDS = 4  # the two systems' decode steps alternate in this many rounds
RAY_NUM_CPUS = 2  # as the tests and a 2-core machine
OUT = BENCH / "results" / "ray_app.json"
CURVE_OUT = BENCH / "results" / "ray_app_replicas.json"
# Ray Serve settings of the Ray app's process (docs/ray.md, "Ray settings"), for the cluster
# it starts, as `make serve-ray` and deploy/ray/Dockerfile set them.
RAY_ENV = {
    "RAY_SERVE_PROXY_USE_GRPC": "1",
    "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str(512 * 2**20),
}


# --- the Ray app's own process ------------------------------------------------------


def ray_env() -> dict[str, str]:
    """RAY_ENV, and any RAY_SERVE_* setting this command was given (an experiment)."""
    given = {k: v for k, v in os.environ.items() if k.startswith("RAY_SERVE_")}
    return {**RAY_ENV, **given}


def serve_forever(port: int, steps: int, replicas: int, tree: Path) -> int:
    """A Ray app on PORT until SIGTERM: that tree's config (and, through PYTHONPATH, its
    mha_serve), deployed by this tree's harness (tests/ray_app/cluster.py)."""
    import ray

    from tests.ray_app.cluster import deploy, load_config, start_ray

    for key, value in RAY_ENV.items():
        os.environ.setdefault(key, value)
    start_ray(ray, max(RAY_NUM_CPUS, replicas))
    try:
        config_path = tree / "deploy" / "ray" / "serve_config.yaml"
        deploy(load_config(grpc_port=port, metrics_port=0, num_replicas=replicas, path=config_path))
        print("handle-probe " + json.dumps(handle_probe(steps)), flush=True)
        print(f"listening on 127.0.0.1:{port}", flush=True)
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()
    finally:
        ray.shutdown()
    return 0


def handle_probe(steps: int) -> dict[str, Any]:
    """Decode steps sent straight to AttentionReplica through a DeploymentHandle from this
    driver (one Ray hop, no proxy): what Ray's handle path costs by itself."""
    return asyncio.run(_handle_probe(steps))


async def _handle_probe(steps: int) -> dict[str, Any]:
    from ray import serve

    from mha_serve.ray_app.forward import calls

    call = calls(serve.get_deployment_handle("AttentionReplica", "mha"), "call")
    rng = np.random.default_rng(1)
    out = {}
    for context in CONTEXTS:
        reply = await call.remote("CreateSession", pb.CreateSessionRequest(model=MODEL))
        sid = reply.response.session_id
        pinned = call.options(session_id=sid)
        prefill = pb.AttendRequest(session_id=sid, input=to_proto(tokens(rng, context - 1)))
        assert (await pinned.remote("Attend", prefill)).code is None
        times = []
        for i in range(WARMUP_STEPS + steps):
            request = pb.AttendRequest(session_id=sid, input=to_proto(tokens(rng, 1)))
            start = time.perf_counter()
            reply = await pinned.remote("Attend", request)
            if i >= WARMUP_STEPS:
                times.append((time.perf_counter() - start) * 1e3)
            assert reply.code is None, reply.details
            await pinned.remote("TruncateSession", trunc(sid, context - 1))
        await pinned.remote("CloseSession", pb.CloseSessionRequest(session_id=sid))
        out[str(context)] = float(np.median(times))
    return out


# --- measuring ------------------------------------------------------------------------


def tokens(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.standard_normal((n, EMBED), dtype=np.float32)


def trunc(sid: str, n: int) -> pb.TruncateSessionRequest:
    return pb.TruncateSessionRequest(session_id=sid, num_tokens=n)


async def decode_steps(target: str, context: int, steps: int) -> dict[str, float]:
    """Median of `steps` streamed one-token steps of one session at `context` tokens (the
    session is truncated back after each step, so every step sees the same context)."""
    import grpc

    rng = np.random.default_rng(0)
    async with grpc.aio.insecure_channel(
        target, options=[("grpc.max_receive_message_length", 64 << 20)]
    ) as channel:
        stub = pb_grpc.AttentionServiceStub(channel)
        info = await stub.CreateSession(pb.CreateSessionRequest(model=MODEL), timeout=120)
        sid = info.session_id
        prefill = pb.AttendRequest(session_id=sid, input=to_proto(tokens(rng, context - 1)))
        await stub.Attend(prefill, timeout=120)
        queue: asyncio.Queue = asyncio.Queue()

        async def requests():
            while (item := await queue.get()) is not None:
                yield item

        stream = stub.StreamSession(requests(), timeout=600)
        replies = stream.__aiter__()
        times, server = [], []
        for i in range(WARMUP_STEPS + steps):
            request = pb.AttendRequest(session_id=sid, input=to_proto(tokens(rng, 1)))
            start = time.perf_counter()
            await queue.put(request)
            reply = await replies.__anext__()
            if i >= WARMUP_STEPS:
                times.append((time.perf_counter() - start) * 1e3)
                server.append(reply.timing.total_ms)
            await stub.TruncateSession(trunc(sid, context - 1), timeout=60)
        await queue.put(None)
        async for _ in replies:
            pass
        await stub.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=60)
    return {"times_ms": times, "server_ms": server}


def summary(rounds: list[dict[str, list[float]]]) -> dict[str, float]:
    times = [t for r in rounds for t in r["times_ms"]]
    server = [t for r in rounds for t in r["server_ms"]]
    return {
        "median_ms": float(np.median(times)),
        "mean_ms": float(np.mean(times)),
        "server_ms": float(np.median(server)),
    }


def start_ray_app(
    log_dir: Path, steps: int, previous: Path | None = None, replicas: int = 2
) -> tuple[Server, Any, dict]:
    """This tree's Ray app, or (previous) that checkout's: its config and its mha_serve
    (first on the path), started by this script alike, with the same Ray settings."""
    port = run_all.ray_baseline.free_port()
    tree = previous or ROOT
    env = {**ray_env(), "RAY_ADDRESS": "local"}  # a Ray of its own, whatever ray.init says
    env["PYTHONPATH"] = os.pathsep.join(str(tree / d) for d in ("service", "client"))
    cmd = ["env", *(f"{k}={v}" for k, v in env.items()), sys.executable]
    cmd += [str(Path(__file__)), "--serve", str(port), "--steps", str(steps), "--tree", str(tree)]
    if replicas != 2:
        cmd += ["--replicas", str(replicas)]
    name = "ray-previous" if previous else f"ray-app-{replicas}" if replicas != 2 else "ray-app"
    server = Server(name, cmd, log_dir)
    probe = json.loads(server.wait_line(r"handle-probe (\{.*\})").group(1))
    server.wait_line(r"listening on")
    return server, lambda: GrpcTarget(f"127.0.0.1:{port}"), {"target": f"127.0.0.1:{port}", **probe}


def start_standalone(log_dir: Path) -> tuple[Server, Any, str]:
    """mha-serve on its built-in models, as bench/run_all.py starts it."""
    target = f"127.0.0.1:{run_all.ray_baseline.free_port()}"
    cmd = [sys.executable, "-m", "mha_serve.transport.main", "--host", "127.0.0.1"]
    cmd += ["--port", target.rsplit(":", 1)[1], "--metrics-port", "0"]
    server = Server("mha-serve", cmd, log_dir)
    with Client(target) as client:
        client.wait_ready(run_all.START_TIMEOUT_S)
    return server, lambda: GrpcTarget(target), target


def start(
    system: str, log_dir: Path, steps: int, previous: Path | None
) -> tuple[Server, Any, dict]:
    """(server, target factory, {target, handle probe}) of one system."""
    if system == "ray-app":
        return start_ray_app(log_dir, steps)
    if system == "ray-previous":
        return start_ray_app(log_dir, steps, previous)
    if system == "mha-serve":
        server, factory, target = start_standalone(log_dir)
        return server, factory, {"target": target}
    server, factory = start_system(system, log_dir)
    return server, factory, {}


def run(
    duration_s: float,
    steps: int,
    previous: Path | None,
    command: str,
    rounds: int = 3,
    only: str | None = None,
    systems: list[str] | None = None,
    profile: bool = False,
) -> dict[str, Any]:
    """Every system up at once; throughput in `rounds` rounds, each measuring every system
    in turn, then the decode steps, alternating: whatever else the machine runs meanwhile
    falls on each alike, and each round's ratios compare neighbours in time."""
    import tempfile

    results: dict[str, Any] = {
        "command": command,
        "machine": report.machine_info(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "ray_env": ray_env(),
        "previous": None if previous is None else str(previous),
        "rounds": rounds,
        "load": [],
        "decode": {},
        "handle_probe": {},
    }
    systems = systems or ["ray", "mha-serve", "ray-app", *(["ray-previous"] * bool(previous))]
    if only == "decode":
        systems = [s for s in systems if s != "ray"]
    warmup = 2 * HEADLINE_CONCURRENCY + 10
    with tempfile.TemporaryDirectory(prefix="mha-bench-ray-") as tmp:
        up: dict[str, tuple[Server, Any]] = {}
        targets: dict[str, str] = {}
        try:
            for system in systems:
                print(f"{system}: starting", flush=True)
                server, factory, info = start(system, Path(tmp), steps, previous)
                up[system] = (server, factory)
                if "target" in info:
                    targets[system] = info.pop("target")
                if info:
                    results["handle_probe"][system] = info
            for round_ in range(rounds if only != "decode" else 0):
                for system, (server, factory) in up.items():
                    for seq_len in SEQ_LENS:
                        point = measure_point(
                            system,
                            server,
                            factory,
                            seq_len,
                            HEADLINE_CONCURRENCY,
                            duration_s,
                            warmup,
                        )
                        results["load"].append({**point, "round": round_})
            if profile and "ray-app" in up:
                results["profile"] = profile_point(*up["ray-app"], duration_s, warmup)
            if only != "throughput":
                results["decode"] = alternate_decode(targets, steps)
        finally:
            for server, _ in up.values():
                server.stop()
    return results


def profile_point(server: Server, factory: Any, duration_s: float, warmup: int) -> dict:
    """One more 16-token point of the Ray app, py-spy on its proxy and replicas (50 Hz,
    which slows them: not one of the measured points): their CPU per request, split by
    whose code runs (bench/ray_cpu.py's owner())."""
    import ray_cpu

    roles = {}
    for pid in run_all.process_tree(server.proc.pid):
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if "ProxyActor" in title:
            roles[pid] = "proxy"
        elif "AttentionReplica" in title:
            roles[pid] = "replicas"
    spies = ray_cpu.start_spies(roles)
    before = {pid: ray_cpu.cpu_s(pid) for pid in roles}
    point = measure_point("ray-app", server, factory, 16, HEADLINE_CONCURRENCY, duration_s, warmup)
    cpu = {"proxy": 0.0, "replicas": 0.0}
    for pid, role in roles.items():
        cpu[role] += (ray_cpu.cpu_s(pid) - before[pid]) / point["ok"] * 1e3
    split = ray_cpu.split_cpu(ray_cpu.stop_spies(spies), roles, cpu)
    return {"sequences_per_s": point["sequences_per_s"], "cpu_ms": cpu, "split_ms": split}


def alternate_decode(targets: dict[str, str], steps: int) -> dict[str, dict]:
    """DECODE_ROUNDS rounds per context; in each, steps/DECODE_ROUNDS steps per system."""
    out: dict[str, dict] = {name: {} for name in targets}
    for context in CONTEXTS:
        rounds: dict[str, list] = {name: [] for name in targets}
        for _ in range(DECODE_ROUNDS):
            for name, target in targets.items():
                rounds[name].append(
                    asyncio.run(decode_steps(target, context, max(1, steps // DECODE_ROUNDS)))
                )
        for name in targets:
            out[name][str(context)] = summary(rounds[name])
            print(f"  {name} decode at {context}: {out[name][str(context)]}", flush=True)
    return out


def replica_curve(counts: list[int], duration_s: float, command: str) -> dict[str, Any]:
    """The Ray app's 16-token throughput with each number of replicas (one CPU each)."""
    import tempfile

    results: dict[str, Any] = {
        "command": command,
        "machine": report.machine_info(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "ray_env": ray_env(),
        "load": [],
    }
    warmup = 2 * HEADLINE_CONCURRENCY + 10
    with tempfile.TemporaryDirectory(prefix="mha-bench-ray-") as tmp:
        for count in counts:
            server, factory, _ = start_ray_app(Path(tmp), 4, replicas=count)
            try:
                point = measure_point(
                    f"ray-app-{count}",
                    server,
                    factory,
                    16,
                    HEADLINE_CONCURRENCY,
                    duration_s,
                    warmup,
                )
                results["load"].append({**point, "replicas": count})
            finally:
                server.stop()
    return results


# --- the report ---------------------------------------------------------------------

OWNERS = ("Ray Serve", "Ray core, gRPC, asyncio", "mha_serve")
NAMES = {
    "ray": "`@serve.batch` baseline (HTTP)",
    "mha-serve": "standalone mha-serve",
    "ray-app": "Ray app (gRPC proxy -> replica)",
    "ray-previous": "previous Ray app (gRPC proxy -> Ingress -> replica)",
}


def table(results: dict[str, Any]) -> str:
    """The markdown docs/ray.md shows: throughput (the median of the rounds), decode steps,
    the ratios the issue sets (the median of the rounds' ratios, and their range)."""
    points: dict[tuple[str, int], list[dict]] = {}
    for p in results["load"]:
        points.setdefault((p["system"], p["seq_len"]), []).append(p)
    systems = [s for s in NAMES if (s, SEQ_LENS[0]) in points]
    rounds = max((len(v) for v in points.values()), default=0)
    lines = [
        f"32 clients, closed loop, model {MODEL} (embed 512, 8 heads), float32 on CPU; the "
        f"median of {rounds} rounds, every system up, measured in turn in each round.",
        "",
        "Cores: the system's process tree / other processes on the machine (the other",
        "systems' idle processes included), averaged over the measurement (from /proc).",
        "",
        "| system | L=16 seq/s | p50 ms | cores | L=128 seq/s | p50 ms | cores |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for system in systems:
        cells = []
        for seq_len in SEQ_LENS:
            ps = points[(system, seq_len)]
            p = sorted(ps, key=lambda q: q["sequences_per_s"])[len(ps) // 2]
            cores = f"{p['cpu_cores']['server']:.2f} / {p['cpu_cores']['other']:.2f}"
            cells += [f"{p['sequences_per_s']:.0f}", f"{p['latency']['p50_ms']:.1f}", cores]
        lines.append(f"| {NAMES[system]} | " + " | ".join(cells) + " |")
    lines += ["", "| ratio (median of rounds; range) | L=16 | L=128 |", "| --- | ---: | ---: |"]
    ratios = [
        ("Ray app / `@serve.batch` (targets: >= 2x, >= 1.5x)", "ray-app", "ray"),
        ("Ray app / standalone", "ray-app", "mha-serve"),
        ("Ray app / previous Ray app", "ray-app", "ray-previous"),
        ("previous Ray app / `@serve.batch`", "ray-previous", "ray"),
    ]
    for label, a, b in ratios:
        if (a, SEQ_LENS[0]) not in points or (b, SEQ_LENS[0]) not in points:
            continue
        cells = []
        for seq_len in SEQ_LENS:
            r = sorted(
                x["sequences_per_s"] / y["sequences_per_s"]
                for x, y in zip(points[(a, seq_len)], points[(b, seq_len)], strict=True)
            )
            cells.append(f"{r[len(r) // 2]:.2f}x ({r[0]:.2f}-{r[-1]:.2f})")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    decode = results["decode"]
    if not decode:
        return "\n".join(lines)
    rays = [s for s in ("ray-app", "ray-previous") if s in decode]
    lines += [
        "",
        "Streamed decode step (one token, median of the steps; the session is truncated back",
        "after each, so every step sees the same context). Server: the median time inside",
        "the replica or server, receipt to encoded reply. Handle: the same step sent from",
        "a driver straight to the replica through a DeploymentHandle (no proxy).",
        "",
        "| context | standalone ms (server) | "
        + " | ".join(f"{NAMES[s]} ms (server) | handle ms | / standalone" for s in rays)
        + " |",
        "| ---: | ---: |" + " ---: | ---: | ---: |" * len(rays),
    ]
    for context in CONTEXTS:
        s = decode["mha-serve"][str(context)]
        cells = [f"{s['median_ms']:.2f} ({s['server_ms']:.2f})"]
        for system in rays:
            r = decode[system][str(context)]
            h = results["handle_probe"].get(system, {}).get(str(context))
            cells += [
                f"{r['median_ms']:.2f} ({r['server_ms']:.2f})",
                "-" if h is None else f"{h:.2f}",
                f"{r['median_ms'] / s['median_ms']:.2f}x",
            ]
        lines.append(f"| {context} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("(decode target: Ray app / standalone <= 2x at context 256)")
    prof = results.get("profile")
    if prof:
        lines += [
            "",
            f"Ray app, 16 tokens, under py-spy ({prof['sequences_per_s']:.0f} seq/s): CPU per "
            "request by whose code runs",
            "",
            "| process | " + " | ".join(OWNERS) + " |",
            "| --- |" + " ---: |" * len(OWNERS),
        ]
        for role in ("proxy", "replicas"):
            cells = [f"{prof['split_ms'].get(f'{role}: {o}', 0.0):.2f} ms" for o in OWNERS]
            lines.append(f"| {role} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def curve_table(results: dict[str, Any]) -> str:
    lines = ["| replicas | L=16 seq/s | p50 ms | cores |", "| ---: | ---: | ---: | ---: |"]
    for p in results["load"]:
        lines.append(
            f"| {p['replicas']} | {p['sequences_per_s']:.0f} | {p['latency']['p50_ms']:.1f} | "
            f"{p['cpu_cores']['server']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=10.0, help="measured seconds per point")
    p.add_argument("--steps", type=int, default=64, help="decode steps per context")
    p.add_argument("--previous", type=Path, help="another checkout: its Ray app beside this one")
    p.add_argument(
        "--replicas",
        help="the scaling curve instead: 16-token throughput with these replica counts "
        "(comma-separated; one CPU each), e.g. 1,2,4,8",
    )
    p.add_argument("--rounds", type=int, default=3, help="throughput rounds")
    p.add_argument(
        "--profile",
        action="store_true",
        help="one more 16-token point of the Ray app under py-spy: whose code its CPU runs",
    )
    p.add_argument("--only", choices=("throughput", "decode"), help="one half of the run")
    p.add_argument("--systems", help="some of: " + ", ".join(NAMES) + " (comma-separated)")
    p.add_argument("--serve", type=int, metavar="PORT", help=argparse.SUPPRESS)
    p.add_argument("--tree", type=Path, default=ROOT, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        return serve_forever(args.serve, args.steps, int(args.replicas or 2), args.tree)
    command = "python bench/ray_app.py " + " ".join(argv if argv is not None else sys.argv[1:])
    OUT.parent.mkdir(exist_ok=True)
    if args.replicas:
        counts = [int(n) for n in args.replicas.split(",")]
        results = replica_curve(counts, args.duration, command.strip())
        CURVE_OUT.write_text(json.dumps(results, indent=1, default=str))
        print(curve_table(results))
        print(f"\nwrote {CURVE_OUT.relative_to(ROOT)}")
        return 0
    previous = None if args.previous is None else args.previous.resolve()
    systems = args.systems.split(",") if args.systems else None
    results = run(
        args.duration,
        args.steps,
        previous,
        command.strip(),
        args.rounds,
        args.only,
        systems,
        args.profile,
    )
    OUT.write_text(json.dumps(results, indent=1, default=str))
    print(table(results))
    print(f"\nwrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
