"""Every Prometheus metric of mha-serve, defined in this one place.

One process (the standalone server, a Ray replica) or several: with `--frontend-workers N`
the gRPC frontends and the engine process share prometheus-client's multiprocess mode
(PROMETHEUS_MULTIPROC_DIR, set before this module is first imported): counters and
histograms add up across processes, the two plain gauges say how (`multiprocess_mode`),
and the gauges read live from the engine (queue depth, KV cache, sessions) are one
collector, LIVE, in the engine's process, beside the files (serve_metrics).
"""

from __future__ import annotations

import bisect
import functools
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    multiprocess,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from mha_serve.net import host_port

# No `*_created` series beside every counter and histogram: in the text format they are
# gauges of start timestamps that double the series count and that no query here reads.
disable_created_metrics()

# Seconds; attention requests on small inputs take ~1 ms, long ones seconds.
LATENCY_BUCKETS_S = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
TOKEN_BUCKETS = (16, 64, 256, 1024, 4096, 16384, 65536)
# Seconds to read a spilled session back: from 1 ms (a short session, a local disk) to
# 30 s (a long one on a slow network volume).
RESTORE_BUCKETS_S = (*LATENCY_BUCKETS_S[1:], 30.0)

# The `protocol` label of mha_serve_requests_total: which API a request came through.
PROTOCOL_MHA_V1 = "mha.v1"
PROTOCOL_KSERVE_V2 = "kserve-v2"  # the Open Inference Protocol (inference.GRPCInferenceService)

REQUESTS = Counter(
    "mha_serve_requests_total",
    "RPCs finished, by method, model, gRPC status code and protocol (mha.v1 or kserve-v2).",
    ["method", "model", "code", "protocol"],
)
REQUEST_LATENCY = Histogram(
    "mha_serve_request_latency_seconds",
    "Server-side time from receipt to reply of an Attend or a session step.",
    ["model"],
    buckets=LATENCY_BUCKETS_S,
)
QUEUE_LATENCY = Histogram(
    "mha_serve_queue_latency_seconds",
    "Time an Attend or session step waited before its forward began (decoding included).",
    ["model"],
    buckets=LATENCY_BUCKETS_S,
)
COMPUTE_LATENCY = Histogram(
    "mha_serve_batch_compute_seconds",
    "Time of one batch's forward pass, by lane (fast or weights).",
    ["model", "lane"],
    buckets=LATENCY_BUCKETS_S,
)
BATCH_SIZE = Histogram(
    "mha_serve_batch_size",
    "Sequences per forward pass, by lane.",
    ["model", "lane"],
    buckets=BATCH_SIZE_BUCKETS,
)
BATCH_REQUESTS = Histogram(
    "mha_serve_batch_requests",
    "Requests sharing one forward pass, by lane.",
    ["model", "lane"],
    buckets=BATCH_SIZE_BUCKETS,
)
REQUEST_TOKENS = Histogram(
    "mha_serve_request_tokens",
    "Tokens (batch x seq_len) per Attend or session step.",
    ["model"],
    buckets=TOKEN_BUCKETS,
)
TOKENS = Counter(
    "mha_serve_tokens_total", "Tokens processed by Attend and session steps.", ["model"]
)
WEIGHTS_BYTES = Counter(
    "mha_serve_attention_weights_bytes_total", "Bytes of attention weights returned.", ["model"]
)
IN_FLIGHT = Gauge(
    "mha_serve_requests_in_flight",
    "Attend requests and session steps received and not yet answered.",
    multiprocess_mode="livesum",  # frontend workers: the sum over live processes
)
READY = Gauge(
    "mha_serve_ready",
    "1 when models are loaded and warm and the server is not draining.",
    # Frontend workers: 1 while any live frontend serves (the engine process never sets it).
    multiprocess_mode="livemax",
)
SESSIONS_ENDED = Counter(
    "mha_serve_sessions_ended_total",
    "Sessions that ended, by reason: closed, expired (idle past their TTL), evicted, or lost "
    "(its spill file could not be kept or read: mha_serve_sessions_lost_total says why).",
    ["reason"],
)
for _reason in ("closed", "expired", "evicted", "lost"):  # exported at 0 before the first
    SESSIONS_ENDED.labels(_reason)


@functools.cache
def _ended(reason: str):
    return SESSIONS_ENDED.labels(reason)


def count_session_end(reason: str) -> None:
    """SessionTable.on_end: runs under the table's lock, so it only counts. A reason of
    LOST_REASONS (the spill tier's) is a session lost, counted so too."""
    if reason in LOST_REASONS:
        count_lost(reason)
        reason = "lost"
    _ended(reason).inc()


# --- durable sessions (issue 24): the spill tier, restarts, moves between Ray replicas ---
# The per-model series below exist, at 0, for every model with a KV cache (watch_kv_cache
# exports them), so that a dashboard reads 0 rather than "no data" before the first spill.

SPILL_REASONS = ("room", "shutdown")  # to make room in a full KV cache; after draining
LOST_REASONS = ("spill_full", "replica_killed", "move_failed", "bad_file")

SESSIONS_SPILLED = Counter(
    "mha_serve_sessions_spilled_total",
    "Sessions written to the spill directory, by reason: room (the KV cache was full) or "
    "shutdown (written out after draining).",
    ["model", "reason"],
)
SPILLED_BYTES = Counter(
    "mha_serve_spilled_bytes_total",
    "Bytes of session files written to the spill directory.",
    ["model"],
)
SESSION_RESTORES = Counter(
    "mha_serve_session_restores_total",
    "Spilled sessions read back into the KV cache (by their next call).",
    ["model"],
)
RESTORE_LATENCY = Histogram(
    "mha_serve_session_restore_seconds",
    "Time to read one spilled session back into the KV cache.",
    ["model"],
    buckets=RESTORE_BUCKETS_S,
)
SESSIONS_ADOPTED = Counter(
    "mha_serve_sessions_adopted_total",
    "Sessions this process took over from the spill directory when it started.",
    ["model"],
)
SESSIONS_LOST = Counter(
    "mha_serve_sessions_lost_total",
    "Sessions lost, by reason: spill_full (the spill tier expired its oldest), "
    "replica_killed (their Ray replica died: killed, crashed, out of memory, its node lost), "
    "move_failed (their Ray replica stopped, a scale-down or redeploy, and could not move "
    "them to another), bad_file (a spill file refused).",
    ["reason"],
)
for _reason in LOST_REASONS:
    SESSIONS_LOST.labels(_reason)
SESSIONS_MOVED = Counter(
    "mha_serve_sessions_moved_total",
    "Sessions a Ray replica took from a replica that Ray stopped (scale-down, redeploy), "
    "counted by the replica that took them.",
)


@functools.cache
def _durable(model: str) -> tuple:
    children = (
        SPILLED_BYTES.labels(model),
        SESSION_RESTORES.labels(model),
        RESTORE_LATENCY.labels(model),
        SESSIONS_ADOPTED.labels(model),
    )
    for reason in SPILL_REASONS:
        SESSIONS_SPILLED.labels(model, reason)
    return children


def count_spilled(model: str, nbytes: int, reason: str) -> None:
    """One session of `model` written to the spill directory, its file `nbytes` long;
    reason: "room" (moved out of a full KV cache) or "shutdown" (written after draining)."""
    if reason not in SPILL_REASONS:
        raise ValueError(f"spill reason {reason!r} is not one of {SPILL_REASONS}")
    SESSIONS_SPILLED.labels(model, reason).inc()
    _durable(model)[0].inc(nbytes)


def observe_restore(model: str, seconds: float) -> None:
    """One spilled session of `model` read back into the KV cache, in `seconds`."""
    _, restores, latency, _ = _durable(model)
    restores.inc()
    latency.observe(seconds)


def count_adopted(model: str, n: int) -> None:
    """`n` sessions of `model` taken over from the spill directory at start-up. Counted
    before the first scrape, it shows Prometheus no increase: the dashboard shows the value
    itself (what this process adopted when it started)."""
    if n:
        _durable(model)[3].inc(n)


def count_lost(reason: str, n: int = 1) -> None:
    """`n` sessions lost, reason one of LOST_REASONS: "spill_full" (the spill tier expired
    its oldest to make room), "replica_killed" (their Ray replica died without moving them),
    "move_failed" (their Ray replica stopped gracefully but could not move them: it told
    SequenceDirectory, which the replica answering NOT_FOUND asks), "bad_file" (a spill file
    refused at adoption or restore). MhaServeSessionsLost fires."""
    if reason not in LOST_REASONS:
        raise ValueError(f"lost reason {reason!r} is not one of {LOST_REASONS}")
    if n:
        SESSIONS_LOST.labels(reason).inc(n)


def count_moved(n: int = 1) -> None:
    """`n` sessions moved to this Ray replica from one Ray stopped (counted here, where they
    live on: the stopping replica exits before Prometheus would scrape its count)."""
    if n:
        SESSIONS_MOVED.inc(n)


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


# --- the per-request series -----------------------------------------------------------
# Every answered call updates about ten series. prometheus-client's observe() and inc() check
# on each call that the child has its labels and (inc) that the amount is not negative: 3 of
# observe's 5 Python calls. The children below are labelled once and only ever given
# non-negative amounts, so their updates go straight to the child's values (the same
# values, locks and multiprocess files: tests/metrics/test_requests.py holds the exposition
# equal to observe()'s and inc()'s), each call's in one function (attend_observer,
# batch_observer). A prometheus-client laid out otherwise gets its public methods.


def _histogram(child: Any) -> tuple[Callable[[float], None], Any, list]:
    """A histogram child's parts for observing without its checks, written out where a
    call observes several (one function, not one closure each): (add_to_sum, bounds,
    add_to_bucket), an amount adding to the sum and, unless NaN, 1 to
    add_to_bucket[bisect_left(bounds, amount)] (_observe's steps). A prometheus-client
    laid out otherwise: observe() as the sum, and one bucket that adds nothing."""
    try:
        bounds, buckets, total = child._upper_bounds, child._buckets, child._sum
    except AttributeError:
        return child.observe, (float("inf"),), [_nothing]
    return total.inc, bounds, [bucket.inc for bucket in buckets]


def _nothing(amount: float) -> None:
    pass


def _inc(child: Any) -> Callable[[float], None]:
    """child.inc(amount) for amount >= 0 (a gauge's too, any sign), without its checks."""
    value = getattr(child, "_value", None)
    return child.inc if value is None else value.inc


# IN_FLIGHT += change: in_flight(1) when a computation begins, in_flight(-1) once answered.
in_flight: Callable[[float], None] = _inc(IN_FLIGHT)


@functools.cache
def attend_observer(model: str) -> Callable[[int, float, float, int], None]:
    """observe_attend of one model, its children looked up once (label lookups cost
    microseconds per request; models are few): observe(tokens, queue_s, total_s,
    weights_bytes), the histograms' steps written out (_histogram)."""
    count_tokens = _inc(TOKENS.labels(model))
    tokens_sum, tokens_bounds, tokens_buckets = _histogram(REQUEST_TOKENS.labels(model))
    queue_sum, queue_bounds, queue_buckets = _histogram(QUEUE_LATENCY.labels(model))
    total_sum, total_bounds, total_buckets = _histogram(REQUEST_LATENCY.labels(model))
    count_weights = _inc(WEIGHTS_BYTES.labels(model))

    def observe(tokens: int, queue_s: float, total_s: float, weights_bytes: int) -> None:
        count_tokens(tokens)
        tokens_sum(tokens)  # (a count of tokens: never NaN)
        tokens_buckets[bisect.bisect_left(tokens_bounds, tokens)](1)
        queue_sum(queue_s)
        if queue_s == queue_s:  # NaN: in no bucket, as observe() counts it
            queue_buckets[bisect.bisect_left(queue_bounds, queue_s)](1)
        total_sum(total_s)
        if total_s == total_s:
            total_buckets[bisect.bisect_left(total_bounds, total_s)](1)
        if weights_bytes:
            count_weights(weights_bytes)

    return observe


def observe_attend(
    model: str, *, tokens: int, queue_s: float, total_s: float, weights_bytes: int
) -> None:
    """Called once per answered Attend or session step (model: a hosted model's name)."""
    attend_observer(model)(tokens, queue_s, total_s, weights_bytes)


def batch_observer(model: str, lane: str) -> Callable[[Any], None]:
    """What the batcher calls once per batch of a lane (with a mha_serve.batching.BatchInfo);
    the lane's labelled children are looked up once, here, the histograms' steps written
    out (_histogram)."""
    compute_sum, compute_bounds, compute_buckets = _histogram(COMPUTE_LATENCY.labels(model, lane))
    size_sum, size_bounds, size_buckets = _histogram(BATCH_SIZE.labels(model, lane))
    requests_sum, requests_bounds, requests_buckets = _histogram(BATCH_REQUESTS.labels(model, lane))

    def observe(info) -> None:
        compute_s, size, requests = info.compute_s, info.batch_size, info.num_requests
        compute_sum(compute_s)
        if compute_s == compute_s:  # NaN: in no bucket, as observe() counts it
            compute_buckets[bisect.bisect_left(compute_bounds, compute_s)](1)
        size_sum(size)  # (counts: never NaN)
        size_buckets[bisect.bisect_left(size_bounds, size)](1)
        requests_sum(requests)
        requests_buckets[bisect.bisect_left(requests_bounds, requests)](1)

    return observe


@functools.cache
def _request_counter(method: str, model: str, code: str, protocol: str) -> Callable[[int], None]:
    return _inc(REQUESTS.labels(method, model, code, protocol))


def count_request(method: str, model: str, code: str, protocol: str = PROTOCOL_MHA_V1) -> None:
    """One finished RPC. The label values are bounded: method names, hosted models (or
    "unknown"), status code names and the two protocols."""
    _request_counter(method, model, code, protocol)(1)


def request_counts(method: str, model: str, protocol: str) -> Callable[[str], None]:
    """count_request(method, model, code, protocol) with all but the code bound, its "OK"
    child looked up once (a stream counts each of its messages)."""
    ok = _request_counter(method, model, "OK", protocol)

    def count(code: str) -> None:
        if code == "OK":
            ok(1)
        else:
            _request_counter(method, model, code, protocol)(1)

    return count


MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def multiprocess_mode() -> bool:
    """Whether this process writes its metrics to PROMETHEUS_MULTIPROC_DIR's files."""
    return bool(os.environ.get(MULTIPROC_ENV))


class ProcessTree:
    """process_* (CPU seconds, memory, open files) summed over this process and `others()`
    (the frontend workers), so that one server's CPU and memory are what the dashboard
    shows whether it runs in one process or several; the start time is this process's."""

    SUMMED = (
        "process_cpu_seconds_total",
        "process_resident_memory_bytes",
        "process_virtual_memory_bytes",
        "process_open_fds",
    )

    def __init__(self, others: Callable[[], list[int]]) -> None:
        self.others = others

    def collect(self) -> Iterator:
        families = {}
        for pid in [os.getpid(), *self.others()]:
            collector = ProcessCollector(pid=lambda p=pid: p, registry=None)
            for family in collector.collect():  # nothing for a process gone meanwhile
                name = family.name + ("_total" if family.type == "counter" else "")
                if name not in families:
                    families[name] = family
                elif name in self.SUMMED:
                    kept = families[name].samples[0]
                    value = kept.value + family.samples[0].value
                    families[name].samples[0] = kept._replace(value=value)
        return iter(families.values())


def serve_metrics(
    port: int, host: str = "0.0.0.0", *, others: Callable[[], list[int]] | None = None
) -> None:
    """Starts the HTTP /metrics endpoint in a background thread: this process's metrics,
    or in multiprocess mode every process's files, this process's LIVE gauges and the
    process_* figures of this process and `others()`. host: an address or name, an IPv6
    address with or without brackets. OSError saying which port when it cannot listen."""
    addr = host.strip("[]")
    registry = REGISTRY
    if multiprocess_mode():
        registry = CollectorRegistry(auto_describe=True)
        multiprocess.MultiProcessCollector(registry)
        registry.register(LIVE)
        registry.register(ProcessTree(others or list))
    try:
        start_http_server(port, addr=addr, registry=registry)
    except OSError as e:
        raise OSError(
            f"could not serve /metrics on {host_port(addr, port)} (--metrics-port, --metrics-host): "
            f"{e.strerror or e}"
        ) from e


def process_gone(pid: int) -> None:
    """Multiprocess mode: a process exited; its live* gauges stop counting."""
    if multiprocess_mode():
        multiprocess.mark_process_dead(pid)
