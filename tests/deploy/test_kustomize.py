"""deploy/k8s overlays as kustomize builds them: the custom resources against their CRDs,
the copies of the rules and the dashboard, scaling objects, what the GPU overlay adds, and
the Ray overlay's PodMonitor against the RayService it scrapes."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from tests.deploy.k8s import OVERLAYS, ROOT, build, crd_errors, is_custom
from tests.deploy.sources import RULES, generate

DASHBOARD = "mha-serve-dashboard"
POD_LABELS = {"app.kubernetes.io/name": "mha-serve", "app.kubernetes.io/component": "server"}


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(found) == 1, f"{len(found)} {kind} {name or ''}"
    return found[0]


def container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (c,) = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    return c


CUSTOM = {
    "cpu": ["PrometheusRule", "ServiceMonitor"],
    "gpu": ["PrometheusRule", "ServiceMonitor"],
    "durable": ["PrometheusRule", "ServiceMonitor"],
    "ray": ["PodMonitor", "PrometheusRule"],
}
RAY_SERVICE = ROOT / "deploy" / "ray" / "rayservice.yaml"


@pytest.mark.parametrize("overlay", [*OVERLAYS, "ray"])
def test_custom_resources_match_their_crds(overlay):
    custom = [d for d in build(overlay) if is_custom(d)]
    assert sorted(d["kind"] for d in custom) == CUSTOM[overlay]
    errors = [line for doc in custom for line in crd_errors(doc)]
    assert not errors, "\n".join(errors)


def test_crd_validation_rejects_unknown_and_mistyped_fields():
    monitor = one(build("cpu"), "ServiceMonitor")
    monitor["spec"]["endpoints"][0]["intervall"] = "15s"  # misspelt: pruned in silence
    assert any("intervall" in e for e in crd_errors(monitor)), crd_errors(monitor)
    rule = one(build("cpu"), "PrometheusRule")
    rule["spec"]["groups"][0]["rules"][0]["for"] = 5  # a number, not a duration
    assert crd_errors(rule)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_service_monitor_scrapes_the_metrics_port(overlay):
    docs = build(overlay)
    monitor = one(docs, "ServiceMonitor")["spec"]
    selected = [
        d
        for d in docs
        if d["kind"] == "Service"
        and monitor["selector"]["matchLabels"].items() <= d["metadata"]["labels"].items()
    ]
    # exactly one, so that every pod is scraped once (durable's headless Service over the
    # same pods carries another component label)
    (service,) = selected
    (endpoint,) = monitor["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
    # The alert rules match the job a ServiceMonitor produces: the Service's name.
    assert "mha-serve" in service["metadata"]["name"]


@pytest.mark.parametrize("overlay", [*OVERLAYS, "ray"])
def test_prometheus_rule_carries_the_rule_file(overlay):
    rule = one(build(overlay), "PrometheusRule")
    assert rule["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]


@pytest.mark.parametrize("overlay", [*OVERLAYS, "ray"])
def test_dashboard_config_map_is_for_grafanas_sidecar(overlay):
    config_map = one(build(overlay), "ConfigMap", DASHBOARD)
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    (name,) = config_map["data"]
    committed = generate().DASHBOARD
    assert name == committed.name
    assert json.loads(config_map["data"][name]) == json.loads(committed.read_text())
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    kv.validate(config_map, kv.latest_version(), strict=True)
    # `kubectl apply` (client-side) keeps the whole object in an annotation of at most
    # 256 KiB; past that only --server-side applies it.
    assert len(json.dumps(config_map)) < 256 * 1024


def test_generated_manifests_are_current():
    module = generate()
    for path, make in module.OUTPUTS.items():
        assert path.read_text() == make(), f"{path.name} is stale: python deploy/k8s/generate.py"


def test_hpa_scales_the_deployment_gently_and_pdb_covers_its_pods():
    docs = build("cpu")
    deployment = one(docs, "Deployment")
    assert "replicas" not in deployment["spec"], "the HPA owns the count; apply would reset it"
    hpa = one(docs, "HorizontalPodAutoscaler")["spec"]
    target = hpa["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    assert 1 <= hpa["minReplicas"] < hpa["maxReplicas"]
    (metric,) = hpa["metrics"]
    assert metric["resource"]["name"] == "cpu", "a Utilization target needs a CPU request"
    assert "cpu" in container(docs)["resources"]["requests"]
    # Scaling down drops the sessions of the pod removed: slowly, one pod at a time.
    down = hpa["behavior"]["scaleDown"]
    assert down["stabilizationWindowSeconds"] >= 300
    assert down["policies"] == [{"type": "Pods", "value": 1, "periodSeconds": 300}]
    pdb = one(docs, "PodDisruptionBudget")["spec"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert pdb["selector"]["matchLabels"].items() <= pod_labels.items()
    assert pdb == {**pdb, "maxUnavailable": 1}, "minAvailable with one replica blocks drains"


def test_cpu_overlay_asks_for_no_gpu():
    c = container(build("cpu"))
    assert not any("nvidia.com/gpu" in r for r in c["resources"].values())
    assert not c["image"].endswith("cu128")


def test_gpu_overlay_runs_bfloat16_on_one_gpu():
    docs = build("gpu")
    c = container(docs)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert c["image"].endswith("-cu128"), c["image"]
    env = {v["name"]: v.get("value") for v in c["env"]}
    assert env["MHA_SERVE_DEVICE"] == "cuda" and env["MHA_SERVE_DTYPE"] == "bfloat16"
    assert "MHA_SERVE_TORCH_THREADS" in env, "the base's env survives the patch"
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    assert not [d for d in docs if d["kind"] == "HorizontalPodAutoscaler"]


def test_ray_pod_monitor_scrapes_every_replicas_port():
    """The PodMonitor's port is the one each RayService worker declares, at the port the
    serve config gives the replicas' metrics (one replica per worker: its local rank 0)."""
    if not RAY_SERVICE.exists():
        pytest.skip(f"{RAY_SERVICE} is absent: the Ray app brings it")
    (endpoint,) = one(build("ray"), "PodMonitor")["spec"]["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics"
    service = yaml.safe_load(RAY_SERVICE.read_text())["spec"]
    (app,) = yaml.safe_load(service["serveConfigV2"])["applications"]
    metrics_port = app["args"]["metrics_port"]
    groups = service["rayClusterConfig"]["workerGroupSpecs"]
    assert groups
    for group in groups:
        ports = {
            p["name"]: p["containerPort"]
            for c in group["template"]["spec"]["containers"]
            for p in c.get("ports", [])
        }
        assert ports.get(endpoint["port"]) == metrics_port, (group["groupName"], ports)
        # Ray's own metrics alike on every group (the gpu group had neither the flag nor the
        # port): the head's, and each worker's, on the port its rayStartParams give
        export = group["rayStartParams"].get("metrics-export-port")
        assert export is not None and ports.get("ray-metrics") == int(export), group["groupName"]
    # The job ("<namespace>/<name>") is what the alert rules match.
    assert "mha-serve" in one(build("ray"), "PodMonitor")["metadata"]["name"]
