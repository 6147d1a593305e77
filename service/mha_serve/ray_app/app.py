"""The Ray Serve application: `serve run deploy/ray/serve_config.yaml` imports `build`.

Replica counts, GPUs and autoscaling are deployment settings, set in the config file's
`deployments:` list (docs/ray.md); what is fixed here is what correctness needs: the
session router on AttentionReplica, room for a batch's worth of concurrent calls, and the
one SequenceDirectory that every Ingress replica asks where a Triton sequence lives.
"""

from __future__ import annotations

from typing import Any

# Calls a replica takes at once: a batch needs many in flight (Ray's default of 5 would
# cap batches at 5); the engine's own queue bounds answer RESOURCE_EXHAUSTED beyond them.
REPLICA_MAX_ONGOING_REQUESTS = 256
INGRESS_MAX_ONGOING_REQUESTS = 1024
ROUTER = "mha_serve.ray_app.router.SessionRouter"
# Access logs write a line per call; operators turn them on in the config when needed.
LOGGING = {"enable_access_log": False}


def build(args: dict[str, Any] | None = None) -> Any:
    """The application (Ray's application builder). args, all optional:
    config_file: an mha-serve TOML file (models, limits), as `mha-serve --config`;
    overrides: ServerConfig fields over the file (e.g. {"torch_threads": 1});
    metrics_port: first port of the replicas' /metrics (plus each replica's rank on its
    node; 0 turns them off)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from mha_serve.ray_app.directory import SequenceDirectory
    from mha_serve.ray_app.ingress import Ingress
    from mha_serve.ray_app.replica import AttentionReplica

    args = dict(args or {})
    unknown = set(args) - {"config_file", "overrides", "metrics_port"}
    if unknown:
        raise ValueError(
            f"unknown args {sorted(unknown)}: the app takes config_file, overrides, metrics_port"
        )
    replicas = serve.deployment(
        AttentionReplica,
        num_replicas=2,
        max_ongoing_requests=REPLICA_MAX_ONGOING_REQUESTS,
        ray_actor_options={"num_cpus": 1},
        request_router_config=RequestRouterConfig(request_router_class=ROUTER),
        logging_config=LOGGING,
    ).bind(args.get("config_file"), args.get("overrides") or {}, int(args.get("metrics_port", 0)))
    # One replica, always: it is the one place every Ingress replica finds a Triton
    # sequence's session (directory.py). Not a knob for the config file.
    directory = _light(serve, SequenceDirectory).bind(replicas)
    return _light(serve, Ingress).bind(replicas, directory)


def _light(serve: Any, cls: type) -> Any:
    """A deployment of one replica that computes nothing (no CPU reserved) and takes many
    calls at once (the Ingress: more replicas through the config file)."""
    return serve.deployment(
        cls,
        num_replicas=1,
        max_ongoing_requests=INGRESS_MAX_ONGOING_REQUESTS,
        ray_actor_options={"num_cpus": 0},
        logging_config=LOGGING,
    )
