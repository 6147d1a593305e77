"""Each replica's /metrics: the same mha_serve_* series as the standalone server, plus labels
naming the replica, so one Prometheus query sums or splits them (docs/ray.md, "Metrics"),
on metrics_port + the replica's local rank, following that rank as Ray renumbers a node's
replicas."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

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


log = logging.getLogger(__name__)


def serve_replica_metrics(port: int, labels: dict[str, str], host: str = "0.0.0.0") -> Any:
    """Serves this process's metrics, labelled, on http://host:port/metrics (a thread);
    returns the HTTP server (its shutdown() and server_close() stop it)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(Labelled(REGISTRY, labels))
    server, _ = start_http_server(port, addr=host, registry=registry)
    return server


class RankedMetrics:
    """A replica's /metrics on base + its local rank on its node. Ray renumbers a node's
    replicas 0..K-1 once others there have stopped (a redeploy starts the new replicas
    beside the old, at the next ranks; a scale-down leaves gaps), telling each replica
    its new rank (AttentionReplica.reconfigure): the endpoint moves with it, so the ports
    a node serves stay base .. base + K - 1, what a scrape configuration lists."""

    def __init__(self, base: int, labels: dict[str, str], host: str = "0.0.0.0") -> None:
        self.base, self.labels, self.host = base, labels, host
        self.port: int | None = None  # where it serves now
        self._server: Any = None

    def serve_at(self, local_rank: int) -> None:
        """Serves on base + local_rank, then stops serving where it did before (a port still
        taken: it stays where it is, and says so loudly)."""
        port = self.base + local_rank
        if port == self.port:
            return
        try:
            server = serve_replica_metrics(port, self.labels, self.host)
        except OSError as e:
            where = f"it stays on port {self.port}" if self.port else "no /metrics"
            log.error(
                "replica %s: port %d for its /metrics (local rank %d) is taken (%s): %s; "
                "give the app a metrics_port whose next ports (one per replica on a node) "
                "are free",
                self.labels.get("replica", "?"), port, local_rank, e, where,
            )  # fmt: skip
            return
        self.close()
        self._server, self.port = server, port
        log.info("replica %s: metrics on port %d", self.labels.get("replica", "?"), port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        self._server, self.port = None, None
