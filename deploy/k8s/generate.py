"""Writes the two Kubernetes objects that copy files kept elsewhere in deploy/.

    python deploy/k8s/generate.py            # rewrite monitoring/prometheusrule.yaml, grafana-dashboard.yaml
    python deploy/k8s/generate.py --check    # exit 1 when either is stale

kustomize reads no file outside a kustomization's folder, so the alert rules
(deploy/prometheus/mha-serve.rules.yml) and the dashboard (deploy/grafana/mha-serve.json)
are copied into a PrometheusRule and a ConfigMap for Grafana's dashboard sidecar here, and
tests/deploy check that the copies are current.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

DEPLOY = Path(__file__).resolve().parents[1]
RULES = DEPLOY / "prometheus" / "mha-serve.rules.yml"
DASHBOARD = DEPLOY / "grafana" / "mha-serve.json"
MONITORING = DEPLOY / "k8s" / "monitoring"
LABELS = {"app.kubernetes.io/name": "mha-serve", "app.kubernetes.io/component": "server"}
HEADER = "# Written by deploy/k8s/generate.py from {source}: edit that, then run the script.\n"


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (PromQL, the dashboard JSON) as `|` blocks, readable in a diff."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def dump(obj: dict, source: Path) -> str:
    body = yaml.dump(obj, Dumper=_Dumper, sort_keys=False, width=100, allow_unicode=True)
    return HEADER.format(source=source.relative_to(DEPLOY.parent)) + body


def prometheus_rule() -> str:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return dump(
        {
            "apiVersion": "monitoring.coreos.com/v1",
            "kind": "PrometheusRule",
            "metadata": {"name": "mha-serve", "labels": LABELS},
            "spec": {"groups": groups},
        },
        RULES,
    )


def dashboard_config_map() -> str:
    return dump(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": "mha-serve-dashboard",
                # Grafana's sidecar (kube-prometheus-stack's default label) loads every
                # ConfigMap that carries it; the folder annotation is its folderAnnotation.
                "labels": {**LABELS, "grafana_dashboard": "1"},
                "annotations": {"grafana_folder": "mha-serve"},
            },
            "data": {DASHBOARD.name: DASHBOARD.read_text()},
        },
        DASHBOARD,
    )


OUTPUTS = {
    MONITORING / "prometheusrule.yaml": prometheus_rule,
    MONITORING / "grafana-dashboard.yaml": dashboard_config_map,
}


def main() -> int:
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("--check", action="store_true", help="fail if a written file is stale")
    args = cli.parse_args()
    stale = []
    for path, make in OUTPUTS.items():
        text = make()
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(path)
        else:
            path.write_text(text)
            print(f"wrote {path}")
    if stale:
        print(f"stale: {[str(p) for p in stale]}: run python {__file__}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
