"""Builds deploy/k8s overlays with `kubectl kustomize` and validates custom resources offline."""

from __future__ import annotations

import functools
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml", reason="PyYAML comes with kubernetes-validate (the dev extra)")

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
# The standalone server's (durable: cpu as a StatefulSet with a volume per pod);
# overlays/ray monitors the Ray app.
OVERLAYS = ("cpu", "gpu", "durable")
# The CRDs of the custom kinds, kept beside the project (../shared/schemas/README.md).
CRDS = ROOT.parent / "shared" / "schemas" / "crds"
CRD_FILES = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "monitoring.coreos.com_servicemonitors.yaml",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "monitoring.coreos.com_prometheusrules.yaml",
    ("monitoring.coreos.com/v1", "PodMonitor"): "monitoring.coreos.com_podmonitors.yaml",
}


@functools.cache
def _build_text(path: Path) -> str:
    local = Path(sys.executable).with_name("kubectl")  # .ci/get-promtool's, where needed
    kubectl = str(local) if local.exists() else shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not found (it bundles kustomize): `make test` installs it")
    result = subprocess.run(
        [kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, f"kubectl kustomize {path} failed:\n{result.stderr}"
    return result.stdout


def build(overlay: str) -> list[dict[str, Any]]:
    """The objects `kubectl apply -k deploy/k8s/overlays/<overlay>` would send, fresh copies."""
    return build_folder(K8S / "overlays" / overlay)


def build_folder(path: Path) -> list[dict[str, Any]]:
    """The objects `kubectl kustomize <path>` builds (a kustomization of a user's own)."""
    return [doc for doc in yaml.safe_load_all(_build_text(path)) if doc]


def is_custom(doc: dict[str, Any]) -> bool:
    return (doc["apiVersion"], doc["kind"]) in CRD_FILES


def strict(schema: Any) -> Any:
    """The CRD's schema with unknown fields refused, as `kubectl apply --validate=strict`
    does (the API server would otherwise prune a misspelt key in silence)."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if (
        "properties" in schema
        and "additionalProperties" not in schema
        and not schema.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@functools.cache
def _crd_validator(api_version: str, kind: str):
    jsonschema = pytest.importorskip("jsonschema", reason="comes with kubernetes-validate")
    path = CRDS / CRD_FILES[(api_version, kind)]
    if not path.exists():
        pytest.skip(f"{path} is absent: the CRD schemas live in ../shared/schemas beside the repo")
    crd = yaml.safe_load(path.read_text())
    group, version = api_version.split("/")
    assert crd["spec"]["group"] == group and crd["spec"]["names"]["kind"] == kind
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema = strict(served["schema"]["openAPIV3Schema"])
    return jsonschema.Draft7Validator(schema)


def crd_errors(doc: dict[str, Any]) -> list[str]:
    """Every way `doc` breaks its CRD's schema, as readable lines (empty: valid)."""
    validator = _crd_validator(doc["apiVersion"], doc["kind"])
    return [
        f"{doc['kind']} .{'.'.join(str(p) for p in e.path)}: {e.message}"
        for e in validator.iter_errors(doc)
    ]
