"""Starts deploy/ray/serve_config.yaml on a local Ray, as `serve deploy CONFIG` and KubeRay
do (Ray's dashboard, serve_head.py: serve_start with the file's proxy options and its
global logging config, then deploy_apps; `serve run` differs in leaving the proxies'
logging at Ray's defaults: an access log line per call), with the ports changed to free
ones, on a Ray of its own (start_ray). Shared by tests/ray_app and the Ray benchmarks
(bench/ray_app.py, bench/ray_cpu.py), which run another checkout's config through it too."""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import yaml

from tests.helpers import free_port

CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "ray" / "serve_config.yaml"
APP = "mha"
RAY_START_ATTEMPTS = 3
# What ray.init raises when a process it starts misses its startup wait (start_ray).
STARTUP_TIMEOUTS = ("timed out during startup", "Timed out waiting for file")


def start_ray(ray: Any, num_cpus: int, **options: Any) -> None:
    """A Ray of its own for this process (`address="local"`: never the cluster a `ray start`
    left in /tmp/ray/ray_current_cluster, or RAY_ADDRESS names, which ray.init() would join,
    dead or alive), started again when one of its processes misses Ray's fixed 30 s startup
    waits (ray/_private/node.py: the raylet's registration, "timed out during startup"; the
    GCS server writing its port, "Timed out waiting for file .../gcs_server_port_..."), which
    a 2-core machine busy with other work can: the start is retried, nothing the tests check
    is."""
    for attempt in range(1, RAY_START_ATTEMPTS + 1):
        try:
            ray.init(
                address="local",
                num_cpus=num_cpus,
                include_dashboard=False,
                log_to_driver=False,
                **options,
            )
            return
        except Exception as e:
            if not any(m in str(e) for m in STARTUP_TIMEOUTS) or attempt == RAY_START_ATTEMPTS:
                raise
            ray.shutdown()


def load_config(
    *,
    grpc_port: int,
    num_replicas: int | None = None,
    overrides: dict[str, Any] | None = None,
    metrics_port: int | None = None,
    path: Path = CONFIG,
) -> dict[str, Any]:
    """The committed config (or another checkout's, `path`) with the given changes (tests
    run it as committed otherwise)."""
    config = copy.deepcopy(yaml.safe_load(path.read_text()))
    config["grpc_options"]["port"] = grpc_port
    config["http_options"]["port"] = free_port()
    app = next(a for a in config["applications"] if a["name"] == APP)
    if overrides:
        app["args"]["overrides"].update(overrides)
    if metrics_port is not None:
        app["args"]["metrics_port"] = metrics_port
    if num_replicas is not None:
        replica = next(d for d in app["deployments"] if d["name"] == "AttentionReplica")
        replica["num_replicas"] = num_replicas
    return config


def deploy(config: dict[str, Any], timeout_s: float = 180.0) -> None:
    """Deploys the config on the Ray this process is connected to; waits until RUNNING."""
    from ray import serve
    from ray.serve._private import api as private_api
    from ray.serve.config import gRPCOptions
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(config)
    client = private_api.serve_start(
        http_options=schema.http_options.model_dump(),
        proxy_location=schema.proxy_location,
        grpc_options=gRPCOptions(**schema.grpc_options.model_dump()),
        global_logging_config=schema.logging_config,
    )
    client.deploy_apps(schema, _blocking=False)
    deadline = time.monotonic() + timeout_s
    while True:
        status = serve.status().applications.get(APP)
        if status is not None and status.status == "RUNNING":
            return
        if status is not None and status.status in ("DEPLOY_FAILED", "UNHEALTHY"):
            raise RuntimeError(f"application {APP} {status.status}: {status.message}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"application {APP} not RUNNING after {timeout_s} s: {status}")
        time.sleep(0.5)
