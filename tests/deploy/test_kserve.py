"""deploy/kserve, checked offline: each object against its KServe CRD's schema (strict: an
unknown field is an error, as `kubectl apply --validate=strict` makes it), and against the
server it starts (the port, the health service, the image's user, the protocol)."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

import pytest

from mha_serve.config import DEFAULT_METRICS_PORT, DEFAULT_PORT, SERVER_KEYS, build_config
from mha_serve.transport.main import ENV_PREFIX, parser
from tests.deploy.k8s import strict

yaml = pytest.importorskip("yaml", reason="PyYAML comes with kubernetes-validate (the dev extra)")
jsonschema = pytest.importorskip("jsonschema", reason="comes with kubernetes-validate")

ROOT = Path(__file__).resolve().parents[2]
KSERVE = ROOT / "deploy" / "kserve"
CRDS = ROOT.parent / "shared" / "schemas" / "crds"  # ../shared/schemas/README.md
CRD_FILES = {
    ("serving.kserve.io/v1alpha1", "ServingRuntime"): "serving.kserve.io_servingruntimes.yaml",
    ("serving.kserve.io/v1beta1", "InferenceService"): "serving.kserve.io_inferenceservices.yaml",
}
IMAGE_USER = 10001  # the Dockerfile's USER (tests/deploy/test_manifests.py checks the base)


def load(name: str) -> dict[str, Any]:
    (doc,) = [d for d in yaml.safe_load_all((KSERVE / name).read_text()) if d]
    return doc


@pytest.fixture(scope="module")
def runtime() -> dict[str, Any]:
    return load("servingruntime.yaml")


@pytest.fixture(scope="module")
def container(runtime) -> dict[str, Any]:
    (only,) = runtime["spec"]["containers"]
    return only


@functools.cache
def validator(api_version: str, kind: str):
    path = CRDS / CRD_FILES[(api_version, kind)]
    if not path.exists():
        pytest.skip(f"{path} is absent: the CRD schemas live in ../shared/schemas beside the repo")
    crd = yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    group, version = api_version.split("/")
    assert (crd["spec"]["group"], crd["spec"]["names"]["kind"]) == (group, kind)
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    return jsonschema.Draft7Validator(strict(served["schema"]["openAPIV3Schema"]))


def errors(doc: dict[str, Any]) -> list[str]:
    return [
        f"{doc['kind']} .{'.'.join(str(p) for p in e.path)}: {e.message}"
        for e in validator(doc["apiVersion"], doc["kind"]).iter_errors(doc)
    ]


MANIFESTS = ("servingruntime.yaml", "inferenceservice-cpu.yaml", "inferenceservice-gpu.yaml")


def test_the_folder_holds_these_manifests():
    assert sorted(p.name for p in KSERVE.glob("*.yaml")) == sorted(MANIFESTS)


@pytest.mark.parametrize("name", MANIFESTS)
def test_manifest_matches_its_crd(name):
    doc = load(name)
    assert (doc["apiVersion"], doc["kind"]) in CRD_FILES, name
    assert not errors(doc), "\n".join(errors(doc))


def test_strict_validation_catches_a_misspelt_field(runtime):
    broken = json.loads(json.dumps(runtime))
    broken["spec"]["protocolVersion"] = ["grpc-v2"]  # the InferenceService's spelling
    assert any("protocolVersion" in e for e in errors(broken))
    broken = json.loads(json.dumps(runtime))
    broken["spec"]["containers"][0]["readinessprobe"] = {}
    assert errors(broken)


def test_runtime_speaks_grpc_v2_on_the_servers_port(runtime, container, monkeypatch):
    assert runtime["spec"]["protocolVersions"] == ["grpc-v2"]
    assert not runtime["spec"]["multiModel"]
    assert container["name"] == "kserve-container"  # the container KServe merges into
    assert "command" not in container and "args" not in container, "the image's ENTRYPOINT"
    (port,) = container["ports"]
    assert (port["name"], port["containerPort"]) == ("h2c", DEFAULT_PORT)
    for var in list(os.environ):
        if var.startswith(ENV_PREFIX):
            monkeypatch.delenv(var)
    for var in container["env"]:
        assert var["name"].startswith(ENV_PREFIX), var["name"]
        if "value" in var:
            monkeypatch.setenv(var["name"], var["value"])
        else:
            assert var["valueFrom"]["resourceFieldRef"]["containerName"] == container["name"]
    args = parser().parse_args(["--host", "0.0.0.0"])  # the ENTRYPOINT
    cfg = build_config(args.config, {key: getattr(args, key) for key in SERVER_KEYS})
    assert cfg.port == port["containerPort"] and cfg.host == "0.0.0.0"
    annotations = runtime["spec"]["annotations"]
    assert annotations["prometheus.kserve.io/port"] == str(cfg.metrics_port)
    assert cfg.metrics_port == DEFAULT_METRICS_PORT


def test_probes_ask_grpc_health_of_the_whole_server(container):
    for name in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = container[name]
        assert set(probe) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"grpc"}, name
        assert probe["grpc"]["port"] == DEFAULT_PORT, name
        # "" is set by the server (NOT_SERVING until warm and while draining); a service
        # name it does not report would fail the probe forever.
        assert probe["grpc"].get("service", "") == "", name


def test_runtime_runs_as_the_image_user(container):
    security = container["securityContext"]
    assert security["runAsNonRoot"] is True and security["runAsUser"] == IMAGE_USER
    assert security["allowPrivilegeEscalation"] is False
    dockerfile = (ROOT / "Dockerfile").read_text().splitlines()
    users = [line.split()[1] for line in dockerfile if line.startswith("USER ")]
    assert users and users[-1].split(":")[0] == str(IMAGE_USER)


@pytest.mark.parametrize("name", ["inferenceservice-cpu.yaml", "inferenceservice-gpu.yaml"])
def test_inference_services_use_the_runtime_over_grpc_v2(name, runtime):
    doc = load(name)
    predictor = doc["spec"]["predictor"]
    model = predictor["model"]
    assert model["runtime"] == runtime["metadata"]["name"]
    formats = {f["name"] for f in runtime["spec"]["supportedModelFormats"]}
    assert model["modelFormat"]["name"] in formats
    assert model["protocolVersion"] in runtime["spec"]["protocolVersions"]
    assert "storageUri" not in model, "the models are the server's own: nothing to download"
    # Sequences live in one pod's memory: a plain Deployment, never scaled to zero.
    assert doc["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] == "RawDeployment"
    assert predictor["minReplicas"] >= 1


def test_gpu_service_asks_for_a_gpu_and_runs_cuda():
    model = load("inferenceservice-gpu.yaml")["spec"]["predictor"]["model"]
    assert str(model["resources"]["limits"]["nvidia.com/gpu"]) == "1"
    env = {v["name"]: v["value"] for v in model["env"]}
    assert env["MHA_SERVE_DEVICE"] == "cuda"
    assert model["image"].endswith("-cu128")
    cpu = load("inferenceservice-cpu.yaml")["spec"]["predictor"]["model"]
    assert "nvidia.com/gpu" not in json.dumps(cpu)
