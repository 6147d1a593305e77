"""Where a Ray app call's CPU goes: each process's CPU time per call (the gRPC proxy, the
Ingress, the replicas, the controller, this client) over N sequential calls, for a 16-token
Attend and for a streamed decode step (context 256 and up).

    python bench/ray_cpu.py [--calls 300]

Starts a local Ray (2 CPUs) with the committed serve config, as the tests do; run it with
RAY_SERVE_PROXY_USE_GRPC=1 RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH=536870912 in the
environment to measure the proxy calling the Ingress over gRPC (docs/ray.md, Benchmark).
"""

from __future__ import annotations

import argparse
import os
import queue
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.ray_app.cluster: the committed config on free ports

from mha_client.api import attention_pb2 as pb  # noqa: E402
from mha_client.api import attention_pb2_grpc as pb_grpc  # noqa: E402
from mha_client.tensors import to_proto  # noqa: E402

WARMUP_CALLS = 30


def cpu_s(pid: int) -> float:
    """utime + stime of a process, in seconds (/proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def actor_pids() -> dict[str, int]:
    """The pid of every named Ray actor (the proxy, the controller, the replicas)."""
    import ray

    pids = {}
    for actor in ray.util.list_named_actors(all_namespaces=True):
        handle = ray.get_actor(actor["name"], namespace=actor["namespace"])
        pid = ray.get(handle.__ray_call__.remote(lambda self: os.getpid()), timeout=60)
        pids[actor["name"].split("::")[-1].split("-")[0]] = pid
    return pids


def measure(label: str, pids: dict[str, int], calls: int, call: Callable[[], None]) -> None:
    before = {name: cpu_s(pid) for name, pid in pids.items()}
    latencies = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        latencies.append(time.perf_counter() - start)
    print(f"{label}: median {np.median(latencies) * 1e3:.2f} ms per call")
    total = 0.0
    for name, pid in pids.items():
        per_call_ms = (cpu_s(pid) - before[name]) / calls * 1e3
        total += per_call_ms
        print(f"  {name:40s} {per_call_ms:6.2f} ms CPU per call")
    print(f"  {'all':40s} {total:6.2f} ms CPU per call")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=300, help="sequential calls per kind")
    args = p.parse_args(argv)
    import grpc
    import ray
    from ray import serve

    from tests.ray_app.cluster import deploy, free_port, load_config

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        port = free_port()
        deploy(load_config(grpc_port=port, metrics_port=0))
        pids = {**actor_pids(), "client (this process)": os.getpid()}
        stub = pb_grpc.AttentionServiceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        rng = np.random.default_rng(0)
        attend = pb.AttendRequest(
            model="mha", input=to_proto(rng.standard_normal((1, 16, 512), dtype=np.float32))
        )
        for _ in range(WARMUP_CALLS):
            stub.Attend(attend, timeout=60)
        measure("Attend, 16 tokens", pids, args.calls, lambda: stub.Attend(attend, timeout=60))

        sid = stub.CreateSession(pb.CreateSessionRequest(model="mha"), timeout=60).session_id
        prefill = to_proto(rng.standard_normal((256, 512), dtype=np.float32))
        stub.Attend(pb.AttendRequest(session_id=sid, input=prefill), timeout=60)
        sent: queue.Queue = queue.Queue()

        def messages():
            while (message := sent.get()) is not None:
                yield message

        replies = stub.StreamSession(messages(), timeout=3600)
        token = to_proto(rng.standard_normal((1, 512), dtype=np.float32))

        def step() -> None:
            sent.put(pb.AttendRequest(session_id=sid, input=token))
            next(replies)

        for _ in range(WARMUP_CALLS):
            step()
        measure("decode step on a stream", pids, args.calls, step)
        sent.put(None)
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
