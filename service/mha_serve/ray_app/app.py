"""The Ray Serve application: `serve run deploy/ray/serve_config.yaml` imports `build`.

Replica counts, GPUs and autoscaling are deployment settings, set in the config file's
`deployments:` list (docs/ray.md); what is fixed here is what correctness needs: the
session router on AttentionReplica (which Ray's gRPC proxy calls directly, the router
running in the proxy), room for a batch's worth of concurrent calls and for open streams,
and the one SequenceDirectory that says where a Triton sequence lives.
"""

from __future__ import annotations

from typing import Any

# Calls a replica takes at once: a batch needs many in flight (Ray's default of 5 would
# cap batches at 5), and each open StreamSession or ModelStreamInfer holds one for its
# life; the engine's own queue bounds answer RESOURCE_EXHAUSTED beyond what it can take.
REPLICA_MAX_ONGOING_REQUESTS = 1024
DIRECTORY_MAX_ONGOING_REQUESTS = 1024
# How often Ray's controller checks SequenceDirectory (its default is 10 s): a directory
# that died is restarted only once a check fails, and meanwhile moved sessions' and Triton
# sequences' calls wait for it (an outage of 8.5 s measured in tests/ray_app/test_redeploy.py
# with the default).
DIRECTORY_HEALTH_CHECK_S = 2.0
ROUTER = "mha_serve.ray_app.router.SessionRouter"
# Access logs write a line per call; operators turn them on in the config when needed.
LOGGING = {"enable_access_log": False}


def build(args: dict[str, Any] | None = None) -> Any:
    """The application (Ray's application builder). args, all optional:
    config_file: an mha-serve TOML file (models, limits), as `mha-serve --config`;
    overrides: ServerConfig fields over the file (e.g. {"torch_threads": 1});
    metrics_port: first port of the replicas' /metrics (plus each replica's rank on its
    node; 0 turns them off);
    direct_streams: false keeps every stream message on Ray's own road (direct.py)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from mha_serve.ray_app.directory import SequenceDirectory
    from mha_serve.ray_app.replica import AttentionReplica, check_not_on_ray

    args = dict(args or {})
    known = ("config_file", "overrides", "metrics_port", "direct_streams")
    unknown = set(args) - set(known)
    if unknown:
        raise ValueError(f"unknown args {sorted(unknown)}: the app takes {', '.join(known)}")
    check_not_on_ray(args.get("overrides") or {}, "overrides.")
    # One replica, always: it is the one place every proxy and replica finds a Triton
    # sequence's session (directory.py). Not a knob for the config file.
    directory = serve.deployment(
        SequenceDirectory,
        num_replicas=1,
        max_ongoing_requests=DIRECTORY_MAX_ONGOING_REQUESTS,
        ray_actor_options={"num_cpus": 0},
        health_check_period_s=DIRECTORY_HEALTH_CHECK_S,
        logging_config=LOGGING,
    ).bind()
    return serve.deployment(
        AttentionReplica,
        num_replicas=2,
        max_ongoing_requests=REPLICA_MAX_ONGOING_REQUESTS,
        ray_actor_options={"num_cpus": 1},
        request_router_config=RequestRouterConfig(request_router_class=ROUTER),
        logging_config=LOGGING,
    ).bind(
        args.get("config_file"),
        args.get("overrides") or {},
        int(args.get("metrics_port", 0)),
        directory,
        _flag("direct_streams", args.get("direct_streams", True)),
    )


def _flag(key: str, value: Any) -> bool:
    """A true/false app argument: YAML's bool, or the string `serve run IMPORT_PATH key=false`
    passes (bool() of which is True)."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"args.{key} must be true or false, got {value!r}")
