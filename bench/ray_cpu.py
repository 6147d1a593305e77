"""Where a Ray app call's CPU goes: each process's CPU time per call (the gRPC proxy, the
replicas, the Ingress where there is one, Ray's controller, the client) over N sequential
calls, for a 16-token Attend and for a streamed decode step (context 256), in this tree and,
with --previous, in another checkout of the project (the previous design), alternating.

    python bench/ray_cpu.py [--calls 300] [--rounds 3] [--previous DIR]

Each measurement is a process of its own with a Ray of its own (2 CPUs) running that tree's
committed serve config, deployed by this tree's harness (tests/ray_app/cluster.py), with
that tree's mha_serve first on PYTHONPATH, in the environment this command was given
(docs/ray.md, "Ray settings"). `--tree DIR` (internal) measures one tree, prints JSON.
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


def measure(
    pids: dict[int, str], calls: int, call: Callable[[], None], profile: bool = False
) -> dict[str, Any]:
    """ms of CPU per call by role, `all`, and the median latency; with profile, py-spy's
    split of the proxy's and the replicas' CPU (split_cpu)."""
    spies = start_spies(pids) if profile else {}
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
    if spies:
        out["split"] = split_cpu(stop_spies(spies), pids, out)
    return out


# --- what the CPU is spent on: py-spy ------------------------------------------------

WAITS = ("Thread.run", "_run_router_event_loop", "Worker.main_loop", "wait", "select", "_worker")


def start_spies(pids: dict[int, str]) -> dict[int, tuple[Any, Path]]:
    """py-spy on the proxy and the replicas, until stop_spies."""
    import shutil
    import tempfile

    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    out = {}
    for pid, role in pids.items():
        if role in ("proxy", "replicas", "Ingress"):
            raw = Path(tempfile.mkstemp(suffix=".txt")[1])
            cmd = [spy, "record", "-f", "raw", "-r", "50", "-o", str(raw), "--pid", str(pid)]
            out[pid] = (
                subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
                raw,
            )
    time.sleep(1.0)  # attached
    return out


def stop_spies(spies: dict[int, tuple[Any, Path]]) -> dict[int, Path]:
    for proc, _ in spies.values():
        proc.send_signal(2)  # SIGINT: py-spy writes its samples and exits
    for proc, _ in spies.values():
        proc.wait(60)
    return {pid: raw for pid, (_, raw) in spies.items()}


def owner(stack: str) -> str | None:
    """Whose code a busy sample is in, by its innermost frame of a known place: ours
    (mha_serve, and torch, which only our engine calls), Ray Serve's, or the rest (Ray core,
    gRPC, asyncio, protobuf); None for a thread waiting."""
    frames = stack.split(";")[1:]
    if not frames or any(w in frames[-1].split(" (")[0] for w in WAITS):
        return None
    for frame in reversed(frames):
        if "mha_serve/" in frame or "mha_client/" in frame or "/torch/" in frame:
            return "mha_serve"
        if "ray/serve/" in frame:
            return "Ray Serve"
        if any(p in frame for p in ("/ray/", "/grpc/", "asyncio/", "google/protobuf")):
            return "Ray core, gRPC, asyncio"
    return "Ray core, gRPC, asyncio"


def split_cpu(raws: dict[int, Path], roles: dict[int, str], cpu: dict[str, Any]) -> dict:
    """The proxy's and the replicas' CPU per call (ms) split by owner, in proportion to
    py-spy's busy samples of each process."""
    import collections

    shares: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for pid, raw in raws.items():
        role = roles[pid]
        for line in raw.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            who = owner(stack)
            if who is not None:
                shares[role][who] += int(count)
        raw.unlink()
    out: dict[str, float] = {}
    for role, counts in shares.items():
        total = sum(counts.values()) or 1
        for who, n in counts.items():
            out[f"{role}: {who}"] = out.get(f"{role}: {who}", 0.0) + cpu[role] * n / total
    return out


def measure_tree(tree: Path, calls: int, profile: bool = False) -> dict[str, Any]:
    """Both kinds of call on that tree's app (this process imports its mha_serve)."""
    import grpc
    import ray
    from ray import serve

    sys.path.insert(0, str(ROOT))  # this tree's harness (tests/ray_app/cluster.py)
    from mha_client.api import attention_pb2 as pb
    from mha_client.api import attention_pb2_grpc as pb_grpc
    from mha_client.tensors import to_proto
    from tests.ray_app.cluster import deploy, free_port, load_config, start_ray

    start_ray(ray, 2)
    try:
        port = free_port()
        config = tree / "deploy" / "ray" / "serve_config.yaml"
        deploy(load_config(grpc_port=port, metrics_port=0, path=config))
        pids = {**actor_pids(), os.getpid(): "client"}
        stub = pb_grpc.AttentionServiceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        rng = np.random.default_rng(0)
        attend = pb.AttendRequest(
            model="mha", input=to_proto(rng.standard_normal((1, 16, 512), dtype=np.float32))
        )
        for _ in range(WARMUP_CALLS):
            stub.Attend(attend, timeout=60)
        out = {"attend": measure(pids, calls, lambda: stub.Attend(attend, timeout=60), profile)}

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
        out["decode"] = {k: both[k] - alone[k] for k in both if k not in ("median_ms", "split")}
        out["decode"]["median_ms"] = both["median_ms"] - alone["median_ms"]
    finally:
        serve.shutdown()
        ray.shutdown()
    return out


def run_tree(tree: Path, calls: int, profile: bool = False) -> dict[str, Any]:
    """measure_tree in a process of its own, that tree's mha_serve first on its path."""
    env = dict(os.environ)
    paths = [str(tree / "service"), str(tree / "client"), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    cmd = [sys.executable, str(Path(__file__)), "--tree", str(tree), "--calls", str(calls)]
    cmd += ["--profile"] * profile
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


def split_table(runs: dict[str, list[dict[str, Any]]]) -> str:
    """py-spy's split of an Attend's CPU in the proxy and the replicas (ms per call)."""
    lines = [
        "",
        "Attend, 16 tokens: CPU per call by whose code runs (py-spy, min-max of rounds)",
        "",
    ]
    for name, results in runs.items():
        keys = sorted({k for r in results for k in r["attend"].get("split", {})})
        for key in keys:
            values = [r["attend"]["split"].get(key, 0.0) for r in results]
            lines.append(f"  {name:10s} {key:38s} {min(values):5.2f}-{max(values):5.2f} ms")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=300, help="sequential calls per kind")
    p.add_argument("--rounds", type=int, default=3, help="measurements of each tree")
    p.add_argument("--previous", type=Path, help="another checkout to measure alternately")
    p.add_argument(
        "--profile",
        action="store_true",
        help="also split the proxy's and replicas' CPU per Attend by whose code runs (py-spy)",
    )
    p.add_argument("--tree", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.tree:
        print("result " + json.dumps(measure_tree(args.tree, args.calls, args.profile)), flush=True)
        return 0
    trees = {"this tree": ROOT}
    if args.previous:
        trees["previous"] = args.previous.resolve()
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    for round_ in range(args.rounds):
        for name, tree in trees.items():
            runs[name].append(run_tree(tree, args.calls, args.profile))
            print(f"round {round_ + 1} {name}: {json.dumps(runs[name][-1])}", flush=True)
    print(table(runs))
    if args.profile:
        print(split_table(runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
