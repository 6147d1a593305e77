"""mha-serve's Grafana dashboard as code (grafana-foundation-sdk), written to mha-serve.json.

    python deploy/grafana/dashboard.py            # rewrite deploy/grafana/mha-serve.json
    python deploy/grafana/dashboard.py --check    # exit 1 when the committed JSON is stale

The panels themselves, as data, are in dashboard_panels.py beside this file (and the
files it imports: dashboard_queries.py, dashboard_durable.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# Beside this file (a script's folder is on sys.path; tests/deploy/sources.py puts it there).
from dashboard_panels import REPEATED_ROW, ROWS
from dashboard_queries import DATASOURCE_UID, Panel
from grafana_foundation_sdk.builders import common as common_b
from grafana_foundation_sdk.builders import dashboard as dash
from grafana_foundation_sdk.builders import prometheus, stat, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models.dashboard import (
    DashboardCursorSync,
    DataSourceRef,
    VariableRefresh,
    VariableSort,
)

OUT = Path(__file__).with_name("mha-serve.json")
UID = "mha-serve"
DATASOURCE = DataSourceRef(type_val="prometheus", uid=DATASOURCE_UID)


def panel_builder(panel: Panel):
    if panel.kind == "stat":
        builder = (
            stat.Panel()
            .graph_mode(common.BigValueGraphMode.AREA)
            .reduce_options(common_b.ReduceDataOptions().calcs(["lastNotNull"]))
        )
        height = 4
    else:
        legend = (
            common_b.VizLegendOptions()
            .display_mode(common.LegendDisplayMode.LIST)
            .placement(common.LegendPlacement.BOTTOM)
            .show_legend(True)
        )
        tooltip = (
            common_b.VizTooltipOptions()
            .mode(common.TooltipDisplayMode.MULTI)
            .sort(common.SortOrder.DESCENDING)
        )
        builder = timeseries.Panel().legend(legend).tooltip(tooltip).fill_opacity(10)
        height = 8
    builder = (
        builder.title(panel.title)
        .description(panel.description)
        .unit(panel.unit)
        .datasource(DATASOURCE)
        .height(height)
        .span(panel.width)
    )
    for ref, query in zip("ABCDEFGH", panel.queries, strict=False):
        builder = builder.with_target(
            prometheus.Dataquery().expr(query.expr).legend_format(query.legend).ref_id(ref)
        )
    return builder


def variables() -> list:
    def query_var(name: str, label: str, query: str, **all_value: str):
        var = (
            dash.QueryVariable(name)
            .label(label)
            .datasource(DATASOURCE)
            .query(query)
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(VariableSort.ALPHABETICAL_ASC)
            .multi(True)
            .include_all(True)
        )
        return var.all_value(all_value["all_value"]) if all_value else var

    return [
        dash.DatasourceVariable("datasource").label("Data source").type("prometheus"),
        # Every model, "unknown" and the empty model of ListModels alike: All is ".*".
        query_var(
            "model", "Model", "label_values(mha_serve_requests_total, model)", all_value=".*"
        ),
        # All is the list of mha-serve targets (not ".*"), so the process panels show no
        # other job's processes.
        query_var("instance", "Instance (pod)", "label_values(mha_serve_ready, instance)"),
        query_var(
            "replica",
            "Ray replica",
            'label_values(mha_serve_ready{instance=~"$instance"}, replica)',
            all_value=".*",
        ),
    ]


def build() -> dict:
    board = (
        dash.Dashboard("mha-serve")
        .uid(UID)
        .description("Multi-head attention over gRPC: traffic, latency, batching, KV cache.")
        .tags(["mha-serve", "inference"])
        .editable()
        .tooltip(DashboardCursorSync.CROSSHAIR)
        .refresh("30s")
        .time("now-1h", "now")
        .timezone("browser")
    )
    for var in variables():
        board = board.with_variable(var)
    ids = iter(range(1, 1000))  # stable panel ids: links and repeats refer to them
    for title, panels in ROWS:
        row = dash.Row(title).id(next(ids))
        if title == REPEATED_ROW:
            row = row.repeat("instance")
        board = board.with_row(row)
        for panel in panels:
            board = board.with_panel(panel_builder(panel).id(next(ids)))
    return json.loads(json.dumps(board.build(), cls=JSONEncoder))


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


def panels() -> list[tuple[str, Panel]]:
    """(row title, panel) for every panel, in order: what the tests evaluate."""
    return [(title, panel) for title, row in ROWS for panel in row]


def main() -> int:
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("--check", action="store_true", help="fail if mha-serve.json is stale")
    args = cli.parse_args()
    text = render()
    if args.check:
        if OUT.read_text() != text:
            print(f"{OUT} is stale: run python {__file__}", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
