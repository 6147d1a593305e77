"""deploy/grafana: the committed dashboard is the generated one, and it covers every metric."""

from __future__ import annotations

import json
import re

import prometheus_client

import mha_serve.metrics  # noqa: F401 - registers every metric of the server
from tests.deploy.sources import ROOT, dashboard

COMMITTED = ROOT / "deploy" / "grafana" / "mha-serve.json"


def all_panels(board: dict) -> list[dict]:
    return [p for p in board["panels"] if p["type"] != "row"]


def test_committed_json_is_the_generated_one():
    assert COMMITTED.read_text() == dashboard().render(), (
        "deploy/grafana/mha-serve.json is stale: run python deploy/grafana/dashboard.py "
        "(and python deploy/k8s/generate.py for the ConfigMap)"
    )


def test_check_flag_fails_on_a_stale_file(tmp_path, monkeypatch):
    module = dashboard()
    stale = tmp_path / "mha-serve.json"
    stale.write_text(module.render().replace("mha_serve_ready", "mha_serve_readyy"))
    monkeypatch.setattr(module, "OUT", stale)
    monkeypatch.setattr("sys.argv", ["dashboard.py", "--check"])
    assert module.main() == 1
    monkeypatch.setattr("sys.argv", ["dashboard.py"])
    assert module.main() == 0
    assert stale.read_text() == module.render()


def test_every_panel_is_described_and_reads_the_chosen_datasource():
    board = json.loads(COMMITTED.read_text())
    for panel in all_panels(board):
        title = panel["title"]
        assert panel["description"].strip(), f"{title}: say what it shows"
        assert panel["fieldConfig"]["defaults"]["unit"], f"{title}: no unit"
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, title
        assert panel["targets"] and all(t["expr"].strip() for t in panel["targets"]), title
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), f"{title}: refIds {refs}"


def test_panel_ids_are_unique():
    ids = [p["id"] for p in json.loads(COMMITTED.read_text())["panels"]]
    assert len(ids) == len(set(ids)) and all(isinstance(i, int) and i > 0 for i in ids)


def test_template_variables_and_the_row_per_replica():
    board = json.loads(COMMITTED.read_text())
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert list(variables) == ["datasource", "model", "instance", "replica"]
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("model", "instance", "replica"):
        assert variables[name]["type"] == "query" and variables[name]["multi"], name
    repeated = [p for p in board["panels"] if p["type"] == "row" and p.get("repeat")]
    assert [p["repeat"] for p in repeated] == ["instance"]
    assert board["panels"][-1 - len(dashboard().ROWS[-1][1])] is repeated[0], "repeat row last"


def test_every_server_query_follows_the_chosen_replicas():
    """A query that ignored $instance would mix every pod into a panel the reader filtered."""
    for row, panel in dashboard().panels():
        for query in panel.queries:
            if "mha_serve_" in query.expr or "process_" in query.expr:
                for selector in re.findall(r"(?:mha_serve|process)_\w+\{[^}]*\}", query.expr):
                    assert 'instance=~"$instance"' in selector, f"{row} / {panel.title}: {selector}"


def test_every_metric_of_the_server_is_on_the_dashboard():
    exprs = "\n".join(
        t["expr"] for p in all_panels(json.loads(COMMITTED.read_text())) for t in p["targets"]
    )
    families = {
        m.name for m in prometheus_client.REGISTRY.collect() if m.name.startswith("mha_serve_")
    }
    assert len(families) >= 15, sorted(families)
    missing = sorted(name for name in families if name not in exprs)
    assert not missing, f"metrics no panel shows: {missing}"
    for name in (
        "process_cpu_seconds_total",
        "process_resident_memory_bytes",
        "DCGM_FI_DEV_FB_USED",
    ):
        assert name in exprs, name
