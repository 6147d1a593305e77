"""What every panel of mha-serve's dashboard is made of: a Panel of Queries, the label
matchers that follow the variables picked above the dashboard, and the PromQL helpers the
rows (dashboard_panels.py, dashboard_durable.py) build their queries with."""

from __future__ import annotations

from dataclasses import dataclass, field

# Every panel reads the data source picked above the dashboard (its `datasource` variable).
DATASOURCE_UID = "${datasource}"
# Label matchers every series gets: the replica/pod picked above the dashboard. `replica` is
# the Ray app's label; a standalone server has none and `=~".*"` (All) matches its absence.
TARGET = 'instance=~"$instance", replica=~"$replica"'
MODEL = f'model=~"$model", {TARGET}'
RATE = "$__rate_interval"
QUANTILES = (0.5, 0.95, 0.99)


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    unit: str
    queries: tuple[Query, ...]
    kind: str = "timeseries"  # or "stat"
    width: int = 8
    # Why a query may return nothing on a healthy server: the real-Prometheus test
    # (tests/deploy/test_real_prometheus.py) requires data from every panel without one.
    may_be_empty: str = ""
    extra: dict = field(default_factory=dict)


def rate(metric: str, matchers: str = MODEL, by: str = "model") -> str:
    return f"sum by ({by}) (rate({metric}{{{matchers}}}[{RATE}]))"


def quantiles(metric: str, by: str = "model", matchers: str = MODEL) -> tuple[Query, ...]:
    """p50/p95/p99 of a histogram, one series per `by` group."""
    label = " ".join("{{" + b.strip() + "}}" for b in by.split(","))
    return tuple(
        Query(
            f"histogram_quantile({q}, sum by ({by}, le) "
            f"(rate({metric}_bucket{{{matchers}}}[{RATE}])))",
            f"p{round(q * 100)} {label}",
        )
        for q in QUANTILES
    )


def mean(metric: str, by: str, matchers: str = MODEL) -> str:
    return (
        f"sum by ({by}) (rate({metric}_sum{{{matchers}}}[{RATE}]))\n"
        f"  / sum by ({by}) (rate({metric}_count{{{matchers}}}[{RATE}]))"
    )
