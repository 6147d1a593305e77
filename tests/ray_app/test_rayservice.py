"""deploy/ray, checked offline: rayservice.yaml against KubeRay's RayService CRD (strict: an
unknown field is an error, as `kubectl apply --validate=strict` makes it), running the very
serve config `serve run` runs; the serve config against Ray's own schema and the app."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.k8s import strict
from tests.ray_app.cluster import CONFIG

ROOT = Path(__file__).resolve().parents[2]
RAYSERVICE = ROOT / "deploy" / "ray" / "rayservice.yaml"
CRD = ROOT.parent / "shared" / "schemas" / "crds" / "ray.io_rayservices.yaml"
jsonschema = pytest.importorskip("jsonschema", reason="comes with kubernetes-validate (dev)")


@pytest.fixture(scope="module")
def rayservice() -> dict[str, Any]:
    (doc,) = [d for d in yaml.safe_load_all(RAYSERVICE.read_text()) if d]
    return doc


@pytest.fixture(scope="module")
def validator():
    if not CRD.exists():
        pytest.skip(f"{CRD} is absent: the CRD schemas live in ../shared/schemas")
    crd = yaml.load(CRD.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return jsonschema.Draft7Validator(strict(v1["schema"]["openAPIV3Schema"]))


def test_the_rayservice_matches_the_crd(rayservice, validator):
    assert (rayservice["apiVersion"], rayservice["kind"]) == ("ray.io/v1", "RayService")
    errors = [
        f".{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(rayservice)
    ]
    assert not errors, "\n".join(errors)


def test_the_crd_check_refuses_an_unknown_field(rayservice, validator):
    bad = yaml.safe_load(yaml.safe_dump(rayservice))
    bad["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParms"] = {}
    assert list(validator.iter_errors(bad))


def test_the_rayservice_runs_the_serve_config(rayservice):
    embedded = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    assert embedded == yaml.safe_load(CONFIG.read_text())
    cluster = rayservice["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == "2.60.0"
    ports = {p["port"] for p in rayservice["spec"]["serveService"]["spec"]["ports"]}
    assert ports == {embedded["grpc_options"]["port"]}


def test_the_serve_config_matches_rays_schema_and_the_app():
    schema = pytest.importorskip("ray.serve.schema")
    config = schema.ServeDeploySchema.model_validate(yaml.safe_load(CONFIG.read_text()))
    assert config.grpc_options.port == 9000
    (app,) = config.applications
    from mha_serve.ray_app import app as ray_app

    assert app.import_path == "mha_serve.ray_app.build"
    assert set(app.args) <= {"config_file", "overrides", "metrics_port"}
    replicas = {d.name: d for d in app.deployments}["AttentionReplica"]
    assert replicas.num_replicas == 2
    assert replicas.ray_actor_options.num_gpus == 0
    assert ray_app.ROUTER.rsplit(".", 1)[0] == "mha_serve.ray_app.router"


def test_the_commented_autoscaling_settings_are_valid():
    """serve_config.yaml's autoscaling block, uncommented in place of num_replicas, is a
    config Ray accepts, with the documented settings."""
    schema = pytest.importorskip("ray.serve.schema")
    lines = CONFIG.read_text().splitlines()
    start = lines.index("        # autoscaling_config:")
    end = next(i for i in range(start, len(lines)) if "ray_actor_options:" in lines[i])
    lines[start:end] = [line.replace("# ", "", 1) for line in lines[start:end]]
    config = yaml.safe_load("\n".join(lines))
    (app,) = config["applications"]
    replica = next(d for d in app["deployments"] if d["name"] == "AttentionReplica")
    del replica["num_replicas"]
    parsed = schema.ServeDeploySchema.model_validate(config)
    (deployment,) = [d for d in parsed.applications[0].deployments if d.name == "AttentionReplica"]
    scaling = deployment.autoscaling_config
    assert scaling["min_replicas"] == 2 and scaling["max_replicas"] == 8
    assert scaling["target_ongoing_requests"] == 32
