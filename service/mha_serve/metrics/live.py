"""The gauges read at scrape time from the engine (queue depth, KV cache, sessions, the spill
tier): one collector, LIVE, registered once, and the watch_* calls that feed it."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .sessions import _durable


class LiveGauges:
    """The gauges read at scrape time from the engine: queue depth per lane, per model the
    KV cache (the same figures GetModelInfo returns) and its sessions, and the spill tier
    (sessions and bytes in the spill directory, its budget). A collector of its own, not
    Gauge.set_function, so that it works unchanged in multiprocess mode (where only the
    engine's process can read them)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queues: dict[tuple[str, str], Callable[[], int]] = {}
        self._caches: dict[str, Callable] = {}
        self._spills: dict[str, Callable] = {}

    def watch_queue(self, model: str, lane: str, depth: Callable[[], int]) -> None:
        with self._lock:
            self._queues[(model, lane)] = depth

    def watch_kv_cache(self, model: str, cache_info: Callable) -> None:
        with self._lock:
            self._caches[model] = cache_info

    def watch_spill(self, model: str, spill_info: Callable) -> None:
        with self._lock:
            self._spills[model] = spill_info

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return self._families()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        with self._lock:
            queues, caches, spills = dict(self._queues), dict(self._caches), dict(self._spills)
        return self._families(
            queues,
            {m: info() for m, info in caches.items()},
            {m: info() for m, info in spills.items()},
        )

    @staticmethod
    def _families(queues: dict | None = None, caches: dict | None = None, spills=None):
        queues, caches, spills = queues or {}, caches or {}, spills or {}
        depth = GaugeMetricFamily(
            "mha_serve_queue_depth",
            "Requests waiting for a batch, by model and lane.",
            labels=["model", "lane"],
        )
        for (model, lane), read in queues.items():
            depth.add_metric([model, lane], read())
        blocks = GaugeMetricFamily(
            "mha_serve_kv_cache_blocks",
            "KV cache blocks per model: total and used.",
            labels=["model", "state"],
        )
        budget = GaugeMetricFamily(
            "mha_serve_kv_cache_budget_bytes", "KV cache memory budget per model.", labels=["model"]
        )
        used = GaugeMetricFamily(
            "mha_serve_kv_cache_bytes_used",
            "KV cache memory held by sessions per model.",
            labels=["model"],
        )
        sessions = GaugeMetricFamily(
            "mha_serve_sessions", "Open KV-cache sessions per model.", labels=["model"]
        )
        slid = CounterMetricFamily(
            "mha_serve_kv_cache_window_freed_blocks",
            "KV cache blocks freed because they fell out of a session's sliding window.",
            labels=["model"],
        )
        for model, info in caches.items():
            blocks.add_metric([model, "total"], info.num_blocks)
            blocks.add_metric([model, "used"], info.num_blocks_used)
            budget.add_metric([model], info.budget_bytes)
            used.add_metric([model], info.num_blocks_used * info.bytes_per_block)
            sessions.add_metric([model], info.num_sessions)
            slid.add_metric([model], info.num_blocks_out_of_window)
        spilled = GaugeMetricFamily(
            "mha_serve_spill_sessions",
            "Sessions held in the spill directory (model empty: one tier for every model).",
            labels=["model"],
        )
        spill_used = GaugeMetricFamily(
            "mha_serve_spill_bytes_used",
            "Bytes of the session files in the spill directory.",
            labels=["model"],
        )
        spill_budget = GaugeMetricFamily(
            "mha_serve_spill_budget_bytes",
            "The spill directory's byte budget; beyond it the oldest spilled sessions expire.",
            labels=["model"],
        )
        for model, info in spills.items():
            spilled.add_metric([model], info.num_sessions)
            spill_used.add_metric([model], info.nbytes)
            spill_budget.add_metric([model], info.budget_bytes)
        return iter(
            (depth, blocks, budget, used, sessions, slid, spilled, spill_used, spill_budget)
        )


LIVE = LiveGauges()
REGISTRY.register(LIVE)


def watch_kv_cache(model: str, cache_info) -> None:
    """KV-cache gauges read at scrape time from cache_info() (the engine's CacheInfo); the
    model's durable-session series are exported from here on, at 0 until counted."""
    LIVE.watch_kv_cache(model, cache_info)
    _durable(model)


def watch_spill(model: str, spill_info: Callable) -> None:
    """Spill-tier gauges read at scrape time: mha_serve_spill_sessions, _spill_bytes_used
    and _spill_budget_bytes from spill_info(), an object with num_sessions, nbytes and
    budget_bytes. model: "" for one tier shared by every model. spill_info runs on every
    scrape, in the engine's process: it must read counters kept in memory, not the disk."""
    LIVE.watch_spill(model, spill_info)


def watch_queue(model: str, lane: str, depth: Callable[[], int]) -> None:
    """mha_serve_queue_depth{model, lane}, read at scrape time."""
    LIVE.watch_queue(model, lane, depth)
