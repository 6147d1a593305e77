"""The generators under deploy/ (scripts, not packages), imported by path for the tests."""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "mha-serve.rules.yml"
RULES_TEST = ROOT / "deploy" / "prometheus" / "mha-serve.rules.test.yml"


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@functools.cache
def dashboard() -> ModuleType:
    """deploy/grafana/dashboard.py (needs grafana-foundation-sdk, in the dev extra)."""
    pytest.importorskip(
        "grafana_foundation_sdk", reason="pip install -e .[dev] (grafana-foundation-sdk)"
    )
    folder = ROOT / "deploy" / "grafana"
    if str(folder) not in sys.path:
        sys.path.append(str(folder))  # dashboard.py imports dashboard_panels.py beside it
    return _load("mha_serve_deploy_dashboard", folder / "dashboard.py")


@functools.cache
def generate() -> ModuleType:
    """deploy/k8s/generate.py."""
    return _load("mha_serve_deploy_generate", ROOT / "deploy" / "k8s" / "generate.py")
