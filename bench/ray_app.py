"""The Ray Serve app (deploy/ray/serve_config.yaml) beside the standalone server and the plain
`@serve.batch` baseline, in one run: stateless throughput at 16 and 128 tokens with 32
clients, and the streamed decode step at contexts 256 and 4096.

    python bench/ray_app.py [--duration 15] [--steps 64]

Prints the table docs/ray.md shows and writes bench/results/ray_app.json. A fourth system,
an experiment and not the app (`build_direct`), measures what the Ingress hop costs.

Each system runs alone in its own process tree while it is measured, on 127.0.0.1; the load
generator (mha_client.loadgen) runs in this process. `--serve PORT` is the Ray app's own
process: a local Ray with the committed serve config, its gRPC proxy on PORT.
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


# --- the Ray app's own process ------------------------------------------------------


def serve_forever(port: int, steps: int, direct: bool) -> int:
    import ray

    from tests.ray_app.cluster import deploy, load_config

    # The proxy calls the Ingress over gRPC rather than as Ray actor calls, with room for
    # large messages (docs/ray.md, Benchmark; deploy/ray/Dockerfile sets the same): set for
    # the cluster this process starts, as `serve run` would inherit it.
    os.environ.setdefault("RAY_SERVE_PROXY_USE_GRPC", "1")
    os.environ.setdefault("RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH", str(512 * 2**20))
    ray.init(num_cpus=RAY_NUM_CPUS, include_dashboard=False, log_to_driver=False)
    try:
        config = load_config(grpc_port=port, metrics_port=0)
        if direct:  # the experiment below in place of the app's builder
            (app,) = config["applications"]
            app.update(import_path="ray_app:build_direct", args={}, deployments=[])
            app["runtime_env"] = {"env_vars": {"PYTHONPATH": str(BENCH)}}
        deploy(config)
        probe = {} if direct else handle_probe(steps)
        print("handle-probe " + json.dumps(probe), flush=True)
        print(f"listening on 127.0.0.1:{port}", flush=True)
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()
    finally:
        ray.shutdown()
    return 0


def handle_probe(steps: int) -> dict[str, Any]:
    """Decode steps sent straight to AttentionReplica through a DeploymentHandle (one Ray
    hop, no proxy and no Ingress): what the proxy hop and the Ingress add is the rest."""
    from ray import serve

    from mha_serve.ray_app.forward import calls

    handle = serve.get_deployment_handle("AttentionReplica", "mha")
    rng = np.random.default_rng(1)
    out = {}
    for context in CONTEXTS:
        create = calls(handle, "call")  # as the Ingress calls it
        reply = create.remote("CreateSession", pb.CreateSessionRequest(model=MODEL)).result()
        sid = reply.response.session_id
        call = create.options(session_id=sid)
        step = calls(handle, "stream_step").options(session_id=sid)
        prefill = pb.AttendRequest(session_id=sid, input=to_proto(tokens(rng, context - 1)))
        assert call.remote("Attend", prefill).result().code is None
        times = []
        for i in range(WARMUP_STEPS + steps):
            request = pb.AttendRequest(session_id=sid, input=to_proto(tokens(rng, 1)))
            start = time.perf_counter()
            reply = step.remote(request).result()
            if i >= WARMUP_STEPS:
                times.append((time.perf_counter() - start) * 1e3)
            assert reply.code is None, reply.details
            call.remote("TruncateSession", trunc(sid, context - 1)).result()
        call.remote("CloseSession", pb.CloseSessionRequest(session_id=sid)).result()
        out[str(context)] = float(np.median(times))
    return out


def build_direct(args: dict[str, Any] | None = None) -> Any:
    """EXPERIMENT, not the app: AttentionReplica as the proxy's own ingress, answering
    stateless Attend and ListModels itself (no Ingress hop, no session routing): what the
    Ingress hop costs stateless throughput."""
    from ray import serve

    from mha_serve.ray_app.replica import AttentionReplica

    class DirectReplica(AttentionReplica):
        async def Attend(self, request: Any, grpc_context: Any) -> Any:
            reply = await self.call("Attend", request, grpc_context.peer())
            if reply.code is not None:
                grpc_context.set_code(reply.code)
                grpc_context.set_details(reply.details)
            return reply.response

    deployment = serve.deployment(
        DirectReplica,
        name="AttentionReplica",
        num_replicas=2,
        max_ongoing_requests=256,
        ray_actor_options={"num_cpus": 1},
        logging_config={"enable_access_log": False},
    )
    return deployment.bind(None, {"torch_threads": 1}, 0)


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


def start_ray_app(log_dir: Path, steps: int, direct: bool = False) -> tuple[Server, Any, dict]:
    port = run_all.ray_baseline.free_port()
    cmd = [sys.executable, str(Path(__file__)), "--serve", str(port), "--steps", str(steps)]
    server = Server(
        "ray-direct" if direct else "ray-app", [*cmd, *(["--direct"] * direct)], log_dir
    )
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


def run(duration_s: float, steps: int, command: str) -> dict[str, Any]:
    import tempfile

    results: dict[str, Any] = {
        "command": command,
        "machine": report.machine_info(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "load": [],
        "decode": {},
        "handle_probe": {},
    }
    warmup = 2 * HEADLINE_CONCURRENCY + 10
    with tempfile.TemporaryDirectory(prefix="mha-bench-ray-") as tmp:
        # The decode steps of the standalone server and the Ray app alternate, in rounds,
        # with both up: whatever else the machine runs meanwhile falls on both alike.
        decode_targets: dict[str, str] = {}
        servers: list[Server] = []
        try:
            for system in ("ray", "mha-serve", "ray-app", "ray-direct"):
                print(f"{system}: starting", flush=True)
                if system == "ray-app":
                    server, factory, probe = start_ray_app(Path(tmp), steps)
                    decode_targets[system] = probe.pop("target")
                    results["handle_probe"] = probe
                elif system == "ray-direct":
                    server, factory, _ = start_ray_app(Path(tmp), steps, direct=True)
                elif system == "mha-serve":
                    server, factory, decode_targets[system] = start_standalone(Path(tmp))
                else:
                    server, factory = start_system(system, Path(tmp))
                servers.append(server)
                for seq_len in SEQ_LENS:
                    point = measure_point(
                        system, server, factory, seq_len, HEADLINE_CONCURRENCY, duration_s, warmup
                    )
                    results["load"].append(point)
                if system == "ray-app":
                    results["decode"] = alternate_decode(decode_targets, steps)
                if system != "mha-serve":  # the standalone server stays for the decode steps
                    while servers:
                        stopping = servers.pop()
                        print(f"{stopping.name}: stopped in {stopping.stop():.1f} s", flush=True)
        finally:
            for server in servers:
                server.stop()
    return results


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


# --- the report ---------------------------------------------------------------------


def table(results: dict[str, Any]) -> str:
    """The markdown docs/ray.md shows: throughput, decode steps, the ratios the issue sets."""
    names = {"ray": "`@serve.batch` baseline (HTTP)", "mha-serve": "standalone mha-serve"}
    names["ray-app"] = "Ray app (gRPC proxy -> Ingress -> replica)"
    tput = {(p["system"], p["seq_len"]): p for p in results["load"]}
    lines = [
        f"32 clients, closed loop, model {MODEL} (embed 512, 8 heads), float32 on CPU.",
        "",
        "Cores: the system's process tree / other processes on the machine, averaged over",
        "the measurement (from /proc).",
        "",
        "| system | L=16 seq/s | p50 ms | cores | L=128 seq/s | p50 ms | cores |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    names["ray-direct"] = "experiment: replica as ingress, stateless only (no Ingress hop)"
    for system in ("ray", "mha-serve", "ray-app", "ray-direct"):
        cells = []
        for seq_len in SEQ_LENS:
            p = tput[(system, seq_len)]
            cores = f"{p['cpu_cores']['server']:.2f} / {p['cpu_cores']['other']:.2f}"
            cells += [f"{p['sequences_per_s']:.0f}", f"{p['latency']['p50_ms']:.1f}", cores]
        lines.append(f"| {names[system]} | " + " | ".join(cells) + " |")
    lines += ["", "| ratio | L=16 | L=128 |", "| --- | ---: | ---: |"]
    for label, a, b in (
        ("Ray app / `@serve.batch` (target >= 3x)", "ray-app", "ray"),
        ("Ray app / standalone", "ray-app", "mha-serve"),
        ("experiment / Ray app (the Ingress hop)", "ray-direct", "ray-app"),
    ):
        r = [tput[(a, s)]["sequences_per_s"] / tput[(b, s)]["sequences_per_s"] for s in SEQ_LENS]
        lines.append(f"| {label} | {r[0]:.2f}x | {r[1]:.2f}x |")
    lines += [
        "",
        "Streamed decode step (one token, median of the steps; the session is truncated back",
        "after each, so every step sees the same context). Server: the median time inside",
        "the replica or server, receipt to encoded reply. Handle: the same step sent from",
        "a driver straight to the replica through a DeploymentHandle (no proxy, no Ingress).",
        "",
        "| context | standalone ms (server) | Ray app ms (server) | handle -> replica ms "
        "| Ray app / standalone (target <= 2x) |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    for context in CONTEXTS:
        s = results["decode"]["mha-serve"][str(context)]
        r = results["decode"]["ray-app"][str(context)]
        h = results["handle_probe"][str(context)]
        lines.append(
            f"| {context} | {s['median_ms']:.2f} ({s['server_ms']:.2f}) | "
            f"{r['median_ms']:.2f} ({r['server_ms']:.2f}) | {h:.2f} | "
            f"{r['median_ms'] / s['median_ms']:.2f}x |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=15.0, help="measured seconds per point")
    p.add_argument("--steps", type=int, default=64, help="decode steps per context")
    p.add_argument("--serve", type=int, metavar="PORT", help=argparse.SUPPRESS)
    p.add_argument("--direct", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        return serve_forever(args.serve, args.steps, args.direct)
    command = "python bench/ray_app.py " + " ".join(argv if argv is not None else sys.argv[1:])
    results = run(args.duration, args.steps, command.strip())
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps(results, indent=1, default=str))
    print(table(results))
    print(f"\nwrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
