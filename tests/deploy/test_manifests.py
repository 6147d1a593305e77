"""deploy/k8s (each overlay as kustomize builds it) and the Dockerfile, checked offline against
the server's own config and defaults."""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from packaging.specifiers import SpecifierSet

from mha_client.api import attention_pb2
from mha_serve.config import (
    DEFAULT_METRICS_PORT,
    DEFAULT_PORT,
    SERVER_KEYS,
    ServerConfig,
    build_config,
    default_models,
)
from mha_serve.transport.main import ENV_PREFIX, parser
from tests.deploy.k8s import K8S, OVERLAYS, ROOT, build, is_custom

DOCKERFILE = ROOT / "Dockerfile"
# The oldest Kubernetes the manifests claim (deploy/README.md): gRPC probes are GA since
# 1.27, the preStop `sleep` action is on by default since 1.30.
MIN_KUBERNETES_VERSION = "1.30"
CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
SERVICE_NAME = attention_pb2.DESCRIPTOR.services_by_name["AttentionService"].full_name
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
# Built-in kinds each overlay holds (custom kinds: tests/deploy/test_kustomize.py); a
# headless Service (the StatefulSet's) is "Service/headless".
KINDS = {
    "cpu": {"ConfigMap", "Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget"},
    "gpu": {"ConfigMap", "Deployment", "Service", "PodDisruptionBudget"},
    "durable": {"ConfigMap", "StatefulSet", "Service", "Service/headless", "PodDisruptionBudget"},
}
WORKLOADS = ("Deployment", "StatefulSet")
# Issue 24's settings, set by overlays/durable, until config.py has them (they come with
# another branch): then this set is empty and every variable must name a setting.
PENDING_KEYS = {"session_spill_dir", "session_spill_bytes"} - set(SERVER_KEYS)
DASHBOARD_LABEL = "grafana_dashboard"


# --- loading ---------------------------------------------------------------------------


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def manifests(overlay) -> dict[str, dict[str, Any]]:
    """The built-in objects of one built overlay, by kind; one of each (the dashboard's
    ConfigMap, for Grafana's sidecar, is checked with the custom kinds, not here)."""
    by_kind: dict[str, dict[str, Any]] = {}
    for doc in build(overlay):
        if is_custom(doc) or DASHBOARD_LABEL in doc["metadata"].get("labels", {}):
            continue
        kind = doc["kind"]
        if kind == "Service" and doc["spec"].get("clusterIP") == "None":
            kind = "Service/headless"
        assert kind not in by_kind, f"{overlay}: a second {kind}"
        by_kind[kind] = doc
    assert set(by_kind) == KINDS[overlay], sorted(by_kind)
    return by_kind


@pytest.fixture(scope="module")
def workload(manifests) -> dict[str, Any]:
    """The Deployment, or durable's StatefulSet: the object whose pods run the server."""
    (kind,) = [k for k in WORKLOADS if k in manifests]
    return manifests[kind]


@pytest.fixture(scope="module")
def container(workload) -> dict[str, Any]:
    containers = workload["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1, "one mha-serve container per pod"
    return containers[0]


@pytest.fixture(scope="module")
def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for line in DOCKERFILE.read_text().splitlines():
        if line.strip().startswith("#"):
            continue  # Docker drops comment lines, even inside a continuation
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        if full:
            word, _, rest = full.partition(" ")
            instructions.append((word.upper(), rest.strip()))
    return instructions


def final_stage(dockerfile: list[tuple[str, str]]) -> list[tuple[str, str]]:
    last_from = max(i for i, (word, _) in enumerate(dockerfile) if word == "FROM")
    return dockerfile[last_from:]


def arg_defaults(dockerfile: list[tuple[str, str]]) -> dict[str, str]:
    return dict(rest.split("=", 1) for word, rest in dockerfile if word == "ARG" and "=" in rest)


def ports_by_name(container: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container["ports"]}


def cpu_cores(quantity: str) -> float:
    return int(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


def env_value(var: dict[str, Any], container: dict[str, Any]) -> str:
    """What the kubelet would put in the variable (the subset of valueFrom used here)."""
    if "value" in var:
        return str(var["value"])
    ref = var["valueFrom"].get("resourceFieldRef")
    assert ref and ref["resource"] == "limits.cpu", f"{var['name']}: unsupported valueFrom"
    limit = cpu_cores(str(container["resources"]["limits"]["cpu"]))
    return str(math.ceil(limit / cpu_cores(str(ref.get("divisor", "1")))))


@pytest.fixture
def pod_config(manifests, container, dockerfile, tmp_path, monkeypatch) -> ServerConfig:
    """The ServerConfig the pod starts with: ENTRYPOINT + args, container env, ConfigMap file."""
    entrypoint = json.loads(dict(final_stage(dockerfile))["ENTRYPOINT"])
    argv = entrypoint[1:] + list(container.get("args", []))
    config_file = tmp_path / "config.toml"
    config_file.write_text(manifests["ConfigMap"]["data"]["config.toml"])
    argv[argv.index("--config") + 1] = str(config_file)
    for name in list(os.environ):
        if name.startswith(ENV_PREFIX):
            monkeypatch.delenv(name)
    for var in container.get("env", []):
        assert var["name"].startswith(ENV_PREFIX), f"{var['name']} is not an mha-serve variable"
        key = var["name"].removeprefix(ENV_PREFIX).lower()
        assert key in SERVER_KEYS or key in PENDING_KEYS, f"{var['name']}: no such setting"
        monkeypatch.setenv(var["name"], env_value(var, container))
    args = parser().parse_args(argv)  # the parser reads MHA_SERVE_* as it is built
    return build_config(args.config, {key: getattr(args, key) for key in SERVER_KEYS})


# --- Kubernetes objects ------------------------------------------------------------------


@pytest.mark.parametrize("version", [MIN_KUBERNETES_VERSION, "newest"])
def test_manifests_match_the_kubernetes_schema(manifests, version):
    kv = pytest.importorskip(
        "kubernetes_validate", reason="pip install kubernetes-validate (in the dev extra)"
    )
    if version == "newest":
        version = kv.latest_version()  # the newest schemas the installed package ships
    errors = []
    for kind, doc in manifests.items():
        try:
            kv.validate(doc, version, strict=True)
        except kv.ValidationError as e:  # collected: the exception's repr holds whole schemas
            errors.append(f"{kind} .{'.'.join(str(p) for p in e.path)}: {e.message}")
    assert not errors, f"not valid Kubernetes {version}:\n" + "\n".join(errors)


def test_schema_validation_rejects_unknown_fields(workload):
    """Strict mode is what catches a misspelt key, which Kubernetes would silently drop."""
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    broken = json.loads(json.dumps(workload))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessprobe"] = {}
    with pytest.raises(kv.ValidationError):
        kv.validate(broken, MIN_KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize(
    ("folder", "folders"),
    [
        ("base", ["../monitoring"]),
        ("monitoring", []),
        ("overlays/ray", ["../../monitoring"]),
        ("overlays/durable", ["../cpu"]),
        ("components/durable-sessions", []),
    ],
)
def test_kustomization_lists_every_manifest(folder, folders):
    """Every file in the folder is used, as a resource or a patch: none is left behind."""
    kustomization = yaml.safe_load((K8S / folder / "kustomization.yaml").read_text())
    component = folder.startswith("components/")
    assert kustomization["kind"] == ("Component" if component else "Kustomization")
    assert kustomization["apiVersion"] == (
        "kustomize.config.k8s.io/v1alpha1" if component else "kustomize.config.k8s.io/v1beta1"
    )
    files = {p.name for p in (K8S / folder).glob("*.yaml")} - {"kustomization.yaml"}
    patches = [p["path"] for p in kustomization.get("patches", []) if "path" in p]
    assert sorted(kustomization["resources"] + patches) == sorted([*files, *folders])


def test_config_map_is_the_built_in_models(manifests, tmp_path):
    text = manifests["ConfigMap"]["data"]["config.toml"]
    tomllib.loads(text)  # a TOML error here names the line
    path = tmp_path / "config.toml"
    path.write_text(text)
    cfg = build_config(str(path), {})
    assert [m.name for m in cfg.models] == ["mha", "gqa", "mqa"]
    assert cfg.models == default_models(), "the ConfigMap's models drifted from default_models()"


def test_config_map_leaves_busy_polling_off_and_its_commented_line_loads(manifests, tmp_path):
    """A Burstable pod spends its CPU quota polling: off, with the line to turn it on for a
    pod of its own; that line, uncommented, is a valid setting."""
    text = manifests["ConfigMap"]["data"]["config.toml"]
    path = tmp_path / "config.toml"
    path.write_text(text)
    assert build_config(str(path), {}).busy_poll_us == 0
    assert text.count("# busy_poll_us = 300\n") == 1
    path.write_text(text.replace("# busy_poll_us = 300\n", "busy_poll_us = 300\n"))
    assert build_config(str(path), {}).busy_poll_us == 300


def test_config_map_leaves_tracing_off_and_its_commented_lines_load(manifests, tmp_path):
    """Tracing is off until an operator names a collector; the lines that turn it on,
    uncommented, are valid settings."""
    text = manifests["ConfigMap"]["data"]["config.toml"]
    path = tmp_path / "config.toml"
    path.write_text(text)
    assert build_config(str(path), {}).tracing_endpoint == ""
    lines = [line for line in text.splitlines() if line.lstrip().startswith("# tracing_")]
    assert len(lines) == 2
    for line in lines:
        text = text.replace(line, line.replace("# ", "", 1))
    path.write_text(text)
    cfg = build_config(str(path), {})
    assert cfg.tracing_endpoint.startswith("http://") and cfg.tracing_endpoint.endswith(
        "/v1/traces"
    )
    assert cfg.tracing_sample_ratio == 0.1


def test_config_file_is_mounted_where_the_args_point(manifests, workload, container):
    pod = workload["spec"]["template"]["spec"]
    args = container["args"]
    config_path = Path(args[args.index("--config") + 1])
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == str(config_path.parent)]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["configMap"]["name"] == manifests["ConfigMap"]["metadata"]["name"]
    assert config_path.name in manifests["ConfigMap"]["data"]


def test_probes_ask_grpc_health_on_the_port_the_server_listens_on(container, pod_config):
    assert pod_config.host in ("0.0.0.0", "::"), "the kubelet probes the pod IP, not loopback"
    assert ports_by_name(container)["grpc"] == pod_config.port
    for name in PROBES:
        probe = container[name]
        handlers = {"grpc", "httpGet", "tcpSocket", "exec"} & set(probe)
        assert handlers == {"grpc"}, f"{name} must use the native grpc probe, not {handlers}"
        assert probe["grpc"]["port"] == pod_config.port, name
        # The server sets exactly these two names (NOT_SERVING until warm and while draining).
        assert probe["grpc"].get("service", "") in ("", SERVICE_NAME), name


def test_termination_grace_outlasts_the_drain(workload, container, pod_config):
    pod = workload["spec"]["template"]["spec"]
    pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("sleep", {})
    drain_s = pre_stop.get("seconds", 0) + pod_config.grace_period_s
    assert pod["terminationGracePeriodSeconds"] > drain_s, (
        f"SIGKILL would cut the drain short: {pod['terminationGracePeriodSeconds']} s "
        f"<= preStop {pre_stop.get('seconds', 0)} s + grace_period_s {pod_config.grace_period_s}"
    )


def test_service_targets_the_container_ports(manifests, workload, container, pod_config):
    ports = ports_by_name(container)
    assert ports == {"grpc": pod_config.port, "metrics": pod_config.metrics_port}
    service = manifests["Service"]["spec"]
    for port in service["ports"]:
        target = port["targetPort"]
        number = ports[target] if isinstance(target, str) else target
        assert number in ports.values(), f"Service port {port['name']} targets {target}"
        assert port["port"] == number == ports[port["name"]], port["name"]
    (grpc_port,) = [p for p in service["ports"] if p["name"] == "grpc"]
    assert grpc_port.get("appProtocol") == "grpc"
    labels = workload["spec"]["template"]["metadata"]["labels"]
    assert service["selector"].items() <= labels.items(), "the Service selects no pod"
    assert workload["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_prometheus_annotations_point_at_metrics(workload, pod_config):
    annotations = workload["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(pod_config.metrics_port)
    assert annotations["prometheus.io/path"] == "/metrics"


def test_resources_and_torch_threads(container, pod_config):
    resources = container["resources"]
    for key in ("cpu", "memory"):
        assert key in resources["requests"] and key in resources["limits"], key
    limit = cpu_cores(str(resources["limits"]["cpu"]))
    assert 0 < pod_config.torch_threads == math.ceil(limit), "one torch thread per CPU of limit"


def test_pod_runs_as_the_image_user(workload, container, dockerfile):
    (user,) = [rest for word, rest in final_stage(dockerfile) if word == "USER"]
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "a numeric non-root USER lets runAsNonRoot verify it"
    pod_security = workload["spec"]["template"]["spec"]["securityContext"]
    assert pod_security["runAsNonRoot"] is True
    assert pod_security["runAsUser"] == int(uid)
    assert container["securityContext"]["allowPrivilegeEscalation"] is False


# --- Dockerfile ---------------------------------------------------------------------------


def test_dockerfile_exposes_the_default_ports(container, dockerfile):
    exposed = {
        int(p.split("/")[0]) for w, rest in dockerfile if w == "EXPOSE" for p in rest.split()
    }
    assert exposed == {DEFAULT_PORT, DEFAULT_METRICS_PORT}
    assert exposed == set(ports_by_name(container).values())


def test_dockerfile_entrypoint_is_mha_serve_on_all_interfaces(container, dockerfile):
    entrypoints = [
        json.loads(rest) for word, rest in final_stage(dockerfile) if word == "ENTRYPOINT"
    ]
    assert entrypoints == [["mha-serve", "--host", "0.0.0.0"]]
    assert "command" not in container, "a command would replace the image's ENTRYPOINT"


def pip_installs(dockerfile: list[tuple[str, str]]) -> list[list[str]]:
    """The arguments of every `pip install` in a RUN, as the shell would split them."""
    installs = []
    for word, rest in dockerfile:
        if word != "RUN":
            continue
        lexer = shlex.shlex(rest, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True  # split on blanks and on && ; | only, quotes respected
        command: list[str] = []
        for token in [*lexer, "&&"]:
            if token not in ("&&", "||", ";", "|"):
                command.append(token)
                continue
            at = command.index("install") if "install" in command else 0
            if at and command[at - 1].endswith(("pip", "pip3")):  # pip, python3 -m pip, ...
                installs.append(command[at + 1 :])
            command = []
    return installs


def test_dockerfile_pins_torch_from_its_index(dockerfile):
    args = arg_defaults(dockerfile)
    version = args["TORCH_VERSION"]
    assert re.fullmatch(r"\d+\.\d+\.\d+", version), f"TORCH_VERSION={version} is not a pin"
    assert args["TORCH_INDEX_URL"] == CPU_TORCH_INDEX, "plain `docker build .` must stay CPU"
    installs = pip_installs(dockerfile)
    torch_installs = [i for i, tokens in enumerate(installs) if "torch==${TORCH_VERSION}" in tokens]
    assert torch_installs, "torch is never installed with torch==${TORCH_VERSION}"
    for tokens in installs:
        bare = [t for t in tokens if re.fullmatch(r"torch([<>=!~]=?.*)?", t)]
        assert bare in ([], ["torch==${TORCH_VERSION}"]), f"unpinned torch in pip install {tokens}"
    first = installs[torch_installs[0]]
    assert first[first.index("--index-url") + 1] == "${TORCH_INDEX_URL}"
    (server,) = [
        i for i, tokens in enumerate(installs) if any(t.startswith(".[server") for t in tokens)
    ]
    assert torch_installs[0] < server, "torch must come from its index before .[server]"


def test_dockerfile_torch_agrees_with_pyproject_and_makefile(dockerfile):
    version = arg_defaults(dockerfile)["TORCH_VERSION"]
    server_extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]["server"]
    (torch_req,) = [r for r in server_extra if re.match(r"torch\b", r)]
    allowed = SpecifierSet(torch_req.removeprefix("torch"))
    assert version in allowed, f"pip install .[server] would replace torch {version} ({torch_req})"
    makefile = (ROOT / "Makefile").read_text()
    spec = re.search(r"^TORCH_SPEC \?= torch==([^+\s]+)", makefile, re.M)  # +cpu: local label
    assert spec, "the Makefile pins torch with TORCH_SPEC ?= torch==X"
    assert spec.group(1) == version, "the Makefile and the image install different torch"


def test_image_install_includes_every_package():
    """The image installs the wheel, not an editable tree: packages.find takes only folders
    with an __init__.py, so a folder of modules without one would be missing there."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "package-dir" not in setuptools, "folders are named as imported: no package-dir"
    roots = setuptools["packages"]["find"]["where"]
    assert sorted(roots) == ["client", "service"]
    missing = sorted(
        str(folder.relative_to(ROOT))
        for root in roots
        for folder in (ROOT / root).rglob("*")
        if folder.is_dir()
        and folder.name != "__pycache__"
        and any(folder.glob("*.py"))
        and not (folder / "__init__.py").exists()
    )
    assert not missing, f"add an __init__.py to {missing}: the wheel would leave them out"
