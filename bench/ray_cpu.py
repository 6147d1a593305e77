"""Where a Ray app call's CPU goes: each process's CPU time per call (the gRPC proxy, the
replicas, the Ingress where there is one, Ray's controller, the client) over N sequential
calls, for a 16-token Attend and for a streamed decode step (context 256), in this tree and,
with --previous, in another checkout of the project (the previous design), alternating.

    python bench/ray_cpu.py [--calls 300] [--rounds 3] [--previous DIR]

Each measurement is a process of its own with a Ray of its own (2 CPUs) running that tree's
committed serve config (its tests/ray_app/cluster.py), with that tree's mha_serve first on
PYTHONPATH, in the environment this command was given (docs/ray.md, Benchmark: the
RAY_SERVE_* settings). `--tree DIR` (internal) measures one tree and prints a JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
WARMUP_CALLS = 30
CONTEXT = 256
ROLES = ("proxy", "Ingress", "replicas", "other Ray", "client")


def cpu_s(pid: int) -> float:
    """utime + stime of a process, in seconds (/proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def role_of(actor_name: str) -> str:
    if "PROXY" in actor_name:
        return "proxy"
    if "#Ingress#" in actor_name:
        return "Ingress"
    if "#AttentionReplica#" in actor_name:
        return "replicas"
    return "other Ray"  # the controller, SequenceDirectory


def actor_pids() -> dict[int, str]:
    """The pid and role of every named Ray actor (the proxy, the controller, the replicas)."""
    import ray

    pids = {}
    for actor in ray.util.list_named_actors(all_namespaces=True):
        handle = ray.get_actor(actor["name"], namespace=actor["namespace"])
        pid = ray.get(handle.__ray_call__.remote(lambda self: os.getpid()), timeout=60)
        pids[pid] = role_of(actor["name"])
    return pids


def measure(pids: dict[int, str], calls: int, call: Callable[[], None]) -> dict[str, float]:
    """ms of CPU per call by role, `all`, and the median latency."""
    before = {pid: cpu_s(pid) for pid in pids}
    latencies = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        latencies.append(time.perf_counter() - start)
    out = dict.fromkeys(ROLES, 0.0)
    for pid, role in pids.items():
        out[role] += (cpu_s(pid) - before[pid]) / calls * 1e3
    out["all"] = sum(out[r] for r in ROLES if r != "client")  # the server side: Ray's
    out["median_ms"] = float(np.median(latencies)) * 1e3
    return out


def measure_tree(tree: Path, calls: int) -> dict[str, dict[str, float]]:
    """Both kinds of call on that tree's app (this process imports its mha_serve)."""
    import grpc
    import ray
    from ray import serve

    sys.path.insert(0, str(tree))  # its tests.ray_app.cluster: its committed config
    from mha_client.api import attention_pb2 as pb
    from mha_client.api import attention_pb2_grpc as pb_grpc
    from mha_client.tensors import to_proto
    from tests.ray_app.cluster import deploy, free_port, load_config

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        port = free_port()
        deploy(load_config(grpc_port=port, metrics_port=0))
        pids = {**actor_pids(), os.getpid(): "client"}
        stub = pb_grpc.AttentionServiceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        rng = np.random.default_rng(0)
        attend = pb.AttendRequest(
            model="mha", input=to_proto(rng.standard_normal((1, 16, 512), dtype=np.float32))
        )
        for _ in range(WARMUP_CALLS):
            stub.Attend(attend, timeout=60)
        out = {"attend": measure(pids, calls, lambda: stub.Attend(attend, timeout=60))}

        sid = stub.CreateSession(pb.CreateSessionRequest(model="mha"), timeout=60).session_id
        prefill = to_proto(rng.standard_normal((CONTEXT - 1, 512), dtype=np.float32))
        stub.Attend(pb.AttendRequest(session_id=sid, input=prefill), timeout=60)
        sent: queue.Queue = queue.Queue()

        def messages():
            while (message := sent.get()) is not None:
                yield message

        replies = stub.StreamSession(messages(), timeout=3600)
        token = to_proto(rng.standard_normal((1, 512), dtype=np.float32))
        truncate = pb.TruncateSessionRequest(session_id=sid, num_tokens=CONTEXT - 1)

        def step() -> None:
            sent.put(pb.AttendRequest(session_id=sid, input=token))
            next(replies)

        for _ in range(WARMUP_CALLS):
            step()
            stub.TruncateSession(truncate, timeout=60)
        # Every step at the same context: the truncate is outside the measured call but its
        # CPU counts; measured alone below and taken off.
        both = measure(pids, calls, lambda: (step(), stub.TruncateSession(truncate, timeout=60)))
        alone = measure(pids, calls, lambda: stub.TruncateSession(truncate, timeout=60))
        sent.put(None)
        out["decode"] = {k: both[k] - alone[k] for k in both if k != "median_ms"}
        out["decode"]["median_ms"] = both["median_ms"] - alone["median_ms"]
    finally:
        serve.shutdown()
        ray.shutdown()
    return out


def run_tree(tree: Path, calls: int) -> dict[str, Any]:
    """measure_tree in a process of its own, that tree's mha_serve first on its path."""
    env = dict(os.environ)
    paths = [str(tree / "service"), str(tree / "client"), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    cmd = [sys.executable, str(Path(__file__)), "--tree", str(tree), "--calls", str(calls)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    for line in done.stdout.splitlines():
        if line.startswith("result "):
            return json.loads(line.removeprefix("result "))
    raise RuntimeError(f"{tree}: no result; exit {done.returncode}\n{done.stderr[-4000:]}")


def table(runs: dict[str, list[dict[str, Any]]]) -> str:
    """min-max over the rounds, per role, for each tree and kind of call."""
    lines = [
        "| per call | " + " | ".join(ROLES) + " | all Ray processes | median latency |",
        "| --- |" + " ---: |" * (len(ROLES) + 2),
    ]
    for kind, label in (("attend", "Attend, 16 tokens"), ("decode", "decode step, context 256")):
        for name, results in runs.items():
            cells = []
            for key in (*ROLES, "all", "median_ms"):
                values = [r[kind][key] for r in results]
                low, high = min(values), max(values)
                cells.append(
                    "-"
                    if high < 0.005
                    else f"{low:.2f}-{high:.2f} ms"
                    if len(values) > 1
                    else f"{low:.2f} ms"
                )
            lines.append(f"| {label}: {name} | " + " | ".join(cells) + " |")
    if len(runs) == 2:
        (a, ra), (b, rb) = runs.items()
        lines.append("")
        for kind in ("attend", "decode"):
            ratios = [x[kind]["all"] / y[kind]["all"] for x, y in zip(ra, rb, strict=True)]
            lines.append(
                f"{kind}: CPU per call, {a} / {b}: "
                + ", ".join(f"{r:.2f}" for r in ratios)
                + f" ({(1 - max(ratios)) * 100:.0f}-{(1 - min(ratios)) * 100:.0f}% lower)"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=300, help="sequential calls per kind")
    p.add_argument("--rounds", type=int, default=3, help="measurements of each tree")
    p.add_argument("--previous", type=Path, help="another checkout to measure alternately")
    p.add_argument("--tree", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.tree:
        print("result " + json.dumps(measure_tree(args.tree, args.calls)), flush=True)
        return 0
    trees = {"this tree": ROOT}
    if args.previous:
        trees["previous"] = args.previous.resolve()
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    for round_ in range(args.rounds):
        for name, tree in trees.items():
            runs[name].append(run_tree(tree, args.calls))
            print(f"round {round_ + 1} {name}: {json.dumps(runs[name][-1])}", flush=True)
    print(table(runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
