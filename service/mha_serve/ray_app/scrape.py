"""Each replica's /metrics: the same mha_serve_* series as the standalone server, plus labels
naming the replica, so one Prometheus query sums or splits them (docs/ray.md, "Metrics")."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import REGISTRY, CollectorRegistry, start_http_server
from prometheus_client.metrics_core import Metric


class Labelled:
    """A collector that yields every metric of `registry` with `labels` added to each sample."""

    def __init__(self, registry: CollectorRegistry, labels: dict[str, str]) -> None:
        self.registry = registry
        self.labels = labels

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            labelled = Metric(family.name, family.documentation, family.type, family.unit)
            for s in family.samples:
                labelled.add_sample(
                    s.name, {**s.labels, **self.labels}, s.value, s.timestamp, s.exemplar
                )
            yield labelled


def serve_replica_metrics(port: int, labels: dict[str, str], host: str = "0.0.0.0") -> None:
    """Serves this process's metrics, labelled, on http://host:port/metrics (a thread)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(Labelled(REGISTRY, labels))
    start_http_server(port, addr=host, registry=registry)
