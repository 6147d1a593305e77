"""One local Ray per test module, running deploy/ray/serve_config.yaml on free ports."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from mha_serve.config import default_models
from mha_serve.model import MultiHeadAttention, init_weights
from tests.helpers import free_ports
from tests.ray_app.cluster import APP, deploy, load_config, start_ray

ATOL = 1e-4  # float32: one full forward against the replica's cached path


@dataclass
class Cluster:
    target: str  # the gRPC proxy, 127.0.0.1:PORT
    metrics_ports: tuple[int, ...]  # the replicas' /metrics on this node
    config: dict  # what was deployed (deploy/ray/serve_config.yaml on these ports)


@pytest.fixture(scope="module")
def cluster(request):
    """Ray with RAY_NUM_CPUS logical CPUs (a module may set more: one per replica), and
    METRICS_PORTS metrics ports for the replicas (ranks go on from replicas replaced)."""
    ray = pytest.importorskip("ray")

    num_cpus = getattr(request.module, "RAY_NUM_CPUS", 2)
    start_ray(ray, num_cpus)
    try:
        num_ports = getattr(request.module, "METRICS_PORTS", 2)
        port = free_ports(num_ports + 1)  # the proxy's, then the replicas' /metrics
        metrics_port = port + 1
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
