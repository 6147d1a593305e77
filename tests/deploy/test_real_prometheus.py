"""The dashboard and the alert rules against a real Prometheus scraping a real mha-serve.

Debian's `prometheus` server (fetched beside promtool by .ci/get-promtool) scrapes a real
mha-serve on loopback every second while threads drive real gRPC traffic: stateless Attend,
attention weights, sessions created, stepped and closed, and a few errors of each kind the
alerts watch (NOT_FOUND, INVALID_ARGUMENT, RESOURCE_EXHAUSTED from a KV cache kept full).
Then every dashboard query (template variables filled in) and every alert expression is
evaluated through Prometheus's HTTP API and must return data: a metric or label that does
not exist, or a query that does not parse, fails here and not on an operator's screen.

The same run draws the dashboard's main panels from Prometheus's query_range into a PNG;
UPDATE_DOCS_IMAGES=1 writes it to docs/images/dashboard.png (and runs the traffic for a
minute, so that the picture has some history to show).
"""

from __future__ import annotations

import math
import os
import re
import shutil
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.deploy.live import EMBED, Prometheus, Traffic
from tests.deploy.sources import ROOT, RULES, dashboard
from tests.helpers import ServerProcess

pytestmark = pytest.mark.slow

# What Grafana makes of $__rate_interval at a 1 s scrape: at least four scrapes.
RATE_INTERVAL = "10s"
# Series appear within a few scrapes of the first traffic; rates need two samples.
DATA_TIMEOUT_S = 40.0
TRAFFIC_S = 60.0 if os.environ.get("UPDATE_DOCS_IMAGES") else 12.0
# Labels that a query may name and this run cannot have, and why.
ABSENT_LABELS = {
    "replica": "the Ray app's replica label; a standalone server has none",
    "pod": "Kubernetes' (and dcgm-exporter's) label; none on loopback",
    "gpu": "dcgm-exporter's label; no GPU here",
    "container": "dcgm-exporter's label; no GPU here",
}
NO_SPILL_DIR = "the spill tier's gauges; this server has no spill directory (its gqa cache refuses)"
ABSENT_METRICS = {
    "DCGM_FI_DEV_FB_USED": "NVIDIA dcgm-exporter's GPU memory; no GPU here",
    "DCGM_FI_DEV_FB_FREE": "NVIDIA dcgm-exporter's GPU memory; no GPU here",
    "mha_serve_spill_sessions": NO_SPILL_DIR,
    "mha_serve_spill_bytes_used": NO_SPILL_DIR,
    "mha_serve_spill_budget_bytes": NO_SPILL_DIR,
}
# mha: a cache of 32 blocks (512 B a token), roomy enough for the sessions kept open.
# gqa: a cache of 4 blocks (256 B a token: 2 x 2 KV heads x 16 x 4 B; 16 tokens a block),
# which one session of 64 tokens fills, so that every further step is refused
# RESOURCE_EXHAUSTED, as under real memory pressure.
CONFIG = f"""
[server]
torch_threads = 1
session_ttl_s = 600.0

[[models]]
name = "mha"
embed_dim = {EMBED}
num_heads = 4
num_kv_heads = 4
seed = 1
kv_cache_bytes = 262144

[[models]]
name = "gqa"
embed_dim = {EMBED}
num_heads = 4
num_kv_heads = 2
seed = 2
kv_cache_bytes = 16384
kv_block_size = 16
"""


def binary(name: str) -> str | None:
    local = Path(sys.executable).with_name(name)  # .ci/get-promtool puts them there
    return str(local) if local.exists() else shutil.which(name)


# --- the queries ------------------------------------------------------------------------


def fill(expr: str, instance: str) -> str:
    """A dashboard query with its template variables filled in as Grafana would."""
    values = {
        "$__rate_interval": RATE_INTERVAL,
        # Grafana escapes a value's regex characters, and doubles the backslash in the string
        "$instance": re.escape(instance).replace("\\", "\\\\"),
        "$model": ".*",  # All
        "$replica": ".*",  # All: matches the absent label
    }
    for name, value in values.items():
        expr = expr.replace(name, value)
    assert "$" not in expr, f"a variable left in {expr}"
    return expr


def panel_exprs(instance: str) -> list[tuple[str, str, str]]:
    """(panel, filled-in expr, why it may be empty) for every query of the dashboard."""
    return [
        (f"{row} / {panel.title}", fill(query.expr, instance), panel.may_be_empty)
        for row, panel in dashboard().panels()
        for query in panel.queries
    ]


# A comparison with a number that closes an alert's condition: `> 0.9`, `== 0`, `>= 2`.
THRESHOLD = re.compile(r"\s*(?:==|!=|>=|<=|>|<)\s*-?\d+(?:\.\d+)?(?=\s*(?:\)|\band\b|\bor\b|$))")


def without_threshold(expr: str) -> str:
    """An alert's expression with its threshold comparisons dropped: the quantity it watches.
    A healthy server keeps every alert quiet (its expression returns nothing), so the test
    asks for the watched quantity instead: `up == 0` becomes `up`, and `absent(up == 1)`
    the series whose absence it watches, `up`."""
    expr = THRESHOLD.sub("", expr.strip())
    if expr.startswith("absent(") and expr.endswith(")"):
        expr = expr.removeprefix("absent(").removesuffix(")")
    return expr


def alert_rules() -> list[dict]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def has_data(result: list[dict]) -> bool:
    return any(math.isfinite(float(r["value"][1])) for r in result)


def names_used(expr: str) -> tuple[set[str], set[str]]:
    """(metric names, label names) an expression reads."""
    metrics = set(re.findall(r"\b(mha_serve_\w+|process_\w+|up|DCGM_\w+)\b(?!\s*\()", expr))
    labels = set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)\s*\"", expr))
    for group in re.findall(r"\b(?:by|without|ignoring|on)\s*\(([^)]*)\)", expr):
        labels |= {name.strip() for name in group.split(",") if name.strip()}
    return metrics, labels - {"le"}


def test_the_threshold_is_what_is_dropped():
    assert without_threshold('up{job=~".*mha-serve.*"} == 0') == 'up{job=~".*mha-serve.*"}'
    assert without_threshold(
        "histogram_quantile(0.99, rate(x[5m])) > 1\nand rate(y[5m]) > 0.1"
    ) == ("histogram_quantile(0.99, rate(x[5m]))\nand rate(y[5m])")
    assert without_threshold("(a / b)\n> 0.05") == "(a / b)"
    assert without_threshold('absent(up{job="x"} == 1)') == 'up{job="x"}'


# --- the test ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    exe = binary("prometheus")
    if exe is None:
        pytest.skip("prometheus not found: `make test` fetches it with promtool (.ci/get-promtool)")
    workdir = tmp_path_factory.mktemp("prometheus")
    config = workdir / "mha-serve.toml"
    config.write_text(CONFIG)
    server = ServerProcess("--config", str(config), log_path=workdir / "mha-serve.log")
    prometheus = None
    try:
        server.wait_serving()
        target = f"127.0.0.1:{server.metrics_port}"
        prometheus = Prometheus(exe, target, workdir)
        prometheus.wait_ready()
        yield server, prometheus, target
    finally:
        if prometheus is not None:
            prometheus.stop()
        assert server.stop() == 0, server.log()


def test_every_panel_and_alert_returns_data_from_a_real_prometheus(stack, tmp_path):
    server, prometheus, instance = stack
    panels = panel_exprs(instance)
    alerts = [(rule["alert"], rule["expr"]) for rule in alert_rules()]
    required = [(name, expr) for name, expr, may_be_empty in panels if not may_be_empty]
    required += [(f"alert {name}", without_threshold(expr)) for name, expr in alerts]
    started = time.time()
    # The traffic runs while the queries are asked (a rate over a quiet window is no data),
    # for TRAFFIC_S at least (the picture) and never past the wait's bound.
    with Traffic(server.target, TRAFFIC_S + DATA_TIMEOUT_S) as traffic:
        # Bounded wait until every required query has data (rates need two scrapes).
        deadline = time.monotonic() + DATA_TIMEOUT_S
        while True:
            missing = [(n, e) for n, e in required if not has_data(prometheus.query(e))]
            if not missing or time.monotonic() > deadline:
                break
            time.sleep(1)
        while traffic.running() and time.time() < started + TRAFFIC_S:
            time.sleep(0.5)
    assert not traffic.errors, traffic.errors
    for code in ("OK", "NOT_FOUND", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"):
        assert traffic.codes.get(code), f"the traffic never got {code}: {traffic.codes}"
    assert not missing, "queries with no data from a real Prometheus:\n" + "\n".join(
        f"  {name}: {expr}" for name, expr in missing
    )

    # Every metric and label named anywhere exists in what Prometheus scraped, but for
    # those this run cannot have (stated above): a typo fails even inside an `or`.
    metric_names = set(prometheus.api("label/__name__/values"))
    label_names = set(prometheus.api("labels"))
    for name, expr in [(n, e) for n, e, _ in panels] + alerts:
        metrics, labels = names_used(expr)
        assert metrics, f"{name}: no metric found in {expr}"
        unknown = metrics - metric_names - set(ABSENT_METRICS)
        assert not unknown, f"{name}: no such metric {unknown}"
        unknown = labels - label_names - set(ABSENT_LABELS)
        assert not unknown, f"{name}: no such label {unknown}"
        prometheus.query(expr)  # the whole expression parses and runs (as in Grafana)

    # The rule file loaded into the real server, and every rule evaluates without error.
    rules = [r for g in prometheus.api("rules")["groups"] for r in g["rules"]]
    assert sorted(r["name"] for r in rules) == sorted(name for name, _ in alerts)
    assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]

    path = draw(prometheus, instance, started, time.time(), tmp_path / "dashboard.png")
    assert path.stat().st_size > 10_000
    if os.environ.get("UPDATE_DOCS_IMAGES"):
        shutil.copy(path, ROOT / "docs" / "images" / "dashboard.png")


# --- the picture ------------------------------------------------------------------------

MAIN_PANELS = (
    ("Traffic and errors", "Request rate by model and status"),
    ("Traffic and errors", "Rejections (RESOURCE_EXHAUSTED) by model and method"),
    ("Traffic and errors", "Tokens/s by model"),
    ("Latency", "End-to-end latency by model"),
    ("Latency", "Queue latency by model"),
    ("Latency", "Compute latency by model and lane"),
    ("Batching and queue", "Batch size (sequences per forward)"),
    ("Sessions and KV cache", "KV cache blocks: used vs total"),
    ("Process", "Process memory by replica"),
)
UNITS = {"reqps": "requests/s", "s": "seconds", "short": "", "bytes": "MiB"}
SCALE = {"bytes": 2**20}


def legend(template: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template)


def draw(prometheus: Prometheus, instance: str, start: float, end: float, path: Path) -> Path:
    """The main panels drawn from query_range, laid out as the dashboard lays them out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_title = {(row, panel.title): panel for row, panel in dashboard().panels()}
    fig, axes = plt.subplots(3, 3, figsize=(16, 10.5), constrained_layout=True)
    for ax, key in zip(axes.flat, MAIN_PANELS, strict=True):
        panel = by_title[key]
        for query in panel.queries:
            data = prometheus.api(
                "query_range",
                query=fill(query.expr, instance),
                start=str(start),
                end=str(end),
                step="1",
            )["result"]
            for series in sorted(data, key=lambda s: legend(query.legend, s["metric"])):
                t = [float(v[0]) - start for v in series["values"]]
                y = [float(v[1]) / SCALE.get(panel.unit, 1) for v in series["values"]]
                ax.plot(t, y, label=legend(query.legend, series["metric"]), linewidth=1.2)
        ax.set_title(panel.title, fontsize=10)
        ax.set_xlabel("seconds into the run", fontsize=8)
        ax.set_ylabel(UNITS.get(panel.unit, panel.unit), fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, loc="upper left", ncol=2)
    fig.suptitle(
        "mha-serve dashboard, main panels: a real Prometheus scraping a real mha-serve "
        "(tests/deploy/test_real_prometheus.py)",
        fontsize=11,
    )
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
