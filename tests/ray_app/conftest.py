"""One local Ray per test module, running deploy/ray/serve_config.yaml on free ports."""

from __future__ import annotations

import socket
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from mha_serve.config import default_models
from mha_serve.model import MultiHeadAttention, init_weights
from tests.ray_app.cluster import APP, deploy, free_port, load_config, start_ray

ATOL = 1e-4  # float32: one full forward against the replica's cached path


@dataclass
class Cluster:
    target: str  # the gRPC proxy, 127.0.0.1:PORT
    metrics_ports: tuple[int, ...]  # the replicas' /metrics on this node
    config: dict  # what was deployed (deploy/ray/serve_config.yaml on these ports)


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for port 0 (Linux's file; its default elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_ports(n: int) -> int:
    """A port p with p + 1 ... p + n - 1 free too (the replicas' metrics ports: base +
    local rank), below the kernel's ephemeral range: a replica binds them only once it is
    up, after its own servers took ports by port 0, and a port that had been handed out
    by port 0 here could have been handed out again to one of those (seen once in CI: a
    replica's gRPC server on the port meant for another's /metrics)."""
    low, _ = ephemeral_ports()
    first = max(1024, low - 12000)
    rng = np.random.default_rng()
    for _ in range(200):
        port = int(rng.integers(first, low - n))
        try:
            for k in range(n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port + k))
        except OSError:
            continue
        return port
    raise RuntimeError(f"no {n} consecutive free ports in {first}..{low - 1}")


@pytest.fixture(scope="module")
def cluster(request):
    """Ray with RAY_NUM_CPUS logical CPUs (a module may set more: one per replica), and
    METRICS_PORTS metrics ports for the replicas (ranks go on from replicas replaced)."""
    ray = pytest.importorskip("ray")

    num_cpus = getattr(request.module, "RAY_NUM_CPUS", 2)
    start_ray(ray, num_cpus)
    try:
        num_ports = getattr(request.module, "METRICS_PORTS", 2)
        port, metrics_port = free_port(), free_ports(num_ports)
        config = load_config(grpc_port=port, metrics_port=metrics_port)
        deploy(config)
        ports = tuple(range(metrics_port, metrics_port + num_ports))
        yield Cluster(f"127.0.0.1:{port}", ports, config)
    finally:
        # ray.shutdown() alone: it ends this Ray's processes, Serve's with them, in ~1 s.
        # serve.shutdown() first would stop each replica gracefully (2-4 s), and a session
        # a test left open would hold its replica's stop, trying to move it to a replica
        # that stays while none does, until it gives up (moves.NOWHERE_GRACE_S, 15 s).
        ray.shutdown()


def replica_handle(method: str, replica_id: str):
    """A handle call that SessionRouter sends to that replica: a session id naming it."""
    from ray import serve

    handle = serve.get_deployment_handle("AttentionReplica", APP)
    return handle.options(method_name=method, session_id=f"{replica_id}-{'0' * 32}")


def replica_ids() -> set[str]:
    """The unique ids of the live AttentionReplica actors."""
    import ray

    prefix = f"SERVE_REPLICA::{APP}#AttentionReplica#"
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    return {n.removeprefix(prefix) for n in names if n.startswith(prefix)}


class Models:
    """The built-in models as the replicas build them (seeded), for full recomputes."""

    def __init__(self) -> None:
        self.modules = {}
        for spec in default_models():
            module = MultiHeadAttention(spec.attention)
            init_weights(module, spec.seed)
            self.modules[spec.name] = module.eval()

    def forward(self, model: str, x: np.ndarray, *, causal=False, weights=False):
        """(output, weights) of x (B, L, E)."""
        with torch.inference_mode():
            out = self.modules[model](torch.from_numpy(x), causal=causal, need_weights=weights)
        return out.output.numpy(), None if out.weights is None else out.weights.numpy()

    def step(self, model: str, history: np.ndarray, new: int) -> np.ndarray:
        """The last `new` rows of the full causal forward over a session's tokens (S, E)."""
        out, _ = self.forward(model, history[None], causal=True)
        return out[0, -new:]


@pytest.fixture(scope="module")
def models() -> Models:
    return Models()
