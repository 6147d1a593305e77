"""Starts deploy/ray/serve_config.yaml on a local Ray, as `serve run CONFIG` does (Ray's
serve/scripts.py: serve_start with the file's proxy options, then deploy_apps), with the
ports changed to free ones. Shared by tests/ray_app and bench/ray_app.py."""

from __future__ import annotations

import copy
import socket
import time
from pathlib import Path
from typing import Any

import yaml

CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "ray" / "serve_config.yaml"
APP = "mha"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_config(
    *,
    grpc_port: int,
    num_replicas: int | None = None,
    overrides: dict[str, Any] | None = None,
    metrics_port: int | None = None,
) -> dict[str, Any]:
    """The committed config with the given changes (tests run it as committed otherwise)."""
    config = copy.deepcopy(yaml.safe_load(CONFIG.read_text()))
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
