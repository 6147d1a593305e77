"""Every Prometheus metric of mha-serve, defined in this one place."""

from __future__ import annotations

import functools

from prometheus_client import (
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    start_http_server,
)

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
QUEUE_DEPTH = Gauge(
    "mha_serve_queue_depth", "Requests waiting for a batch, by model and lane.", ["model", "lane"]
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
)
READY = Gauge(
    "mha_serve_ready", "1 when models are loaded and warm and the server is not draining."
)


KV_CACHE_BLOCKS = Gauge(
    "mha_serve_kv_cache_blocks", "KV cache blocks per model: total and used.", ["model", "state"]
)
KV_CACHE_BUDGET_BYTES = Gauge(
    "mha_serve_kv_cache_budget_bytes", "KV cache memory budget per model.", ["model"]
)
KV_CACHE_BYTES_USED = Gauge(
    "mha_serve_kv_cache_bytes_used", "KV cache memory held by sessions per model.", ["model"]
)
SESSIONS = Gauge("mha_serve_sessions", "Open KV-cache sessions per model.", ["model"])
SESSIONS_ENDED = Counter(
    "mha_serve_sessions_ended_total",
    "Sessions that ended, by reason: closed, expired (idle past their TTL) or evicted.",
    ["reason"],
)
for _reason in ("closed", "expired", "evicted"):  # exported at 0 before the first
    SESSIONS_ENDED.labels(_reason)


@functools.cache
def _ended(reason: str):
    return SESSIONS_ENDED.labels(reason)


def count_session_end(reason: str) -> None:
    """SessionTable.on_end: runs under the table's lock, so it only counts."""
    _ended(reason).inc()


def watch_kv_cache(model: str, cache_info) -> None:
    """Gauges read at scrape time from cache_info() (the engine's CacheInfo of the model),
    the same figures GetModelInfo returns."""
    first = cache_info()
    KV_CACHE_BLOCKS.labels(model, "total").set(first.num_blocks)
    KV_CACHE_BLOCKS.labels(model, "used").set_function(lambda: cache_info().num_blocks_used)
    KV_CACHE_BUDGET_BYTES.labels(model).set(first.budget_bytes)
    KV_CACHE_BYTES_USED.labels(model).set_function(
        lambda: cache_info().num_blocks_used * first.bytes_per_block
    )
    SESSIONS.labels(model).set_function(lambda: cache_info().num_sessions)


@functools.cache
def _per_model(model: str) -> tuple:
    """Label lookups cost microseconds per request; models are few, so keep their children."""
    return (
        TOKENS.labels(model),
        REQUEST_TOKENS.labels(model),
        QUEUE_LATENCY.labels(model),
        REQUEST_LATENCY.labels(model),
        WEIGHTS_BYTES.labels(model),
    )


def observe_attend(
    model: str, *, tokens: int, queue_s: float, total_s: float, weights_bytes: int
) -> None:
    """Called once per answered Attend or session step (model: a hosted model's name)."""
    tokens_c, tokens_h, queue_h, latency_h, weights_c = _per_model(model)
    tokens_c.inc(tokens)
    tokens_h.observe(tokens)
    queue_h.observe(queue_s)
    latency_h.observe(total_s)
    if weights_bytes:
        weights_c.inc(weights_bytes)


@functools.cache
def _per_lane(model: str, lane: str) -> tuple:
    return (
        COMPUTE_LATENCY.labels(model, lane),
        BATCH_SIZE.labels(model, lane),
        BATCH_REQUESTS.labels(model, lane),
    )


def observe_batch(model: str, lane: str, info) -> None:
    """Called by the batcher once per batch (info: mha_serve.batching.BatchInfo)."""
    compute_h, size_h, requests_h = _per_lane(model, lane)
    compute_h.observe(info.compute_s)
    size_h.observe(info.batch_size)
    requests_h.observe(info.num_requests)


@functools.cache
def _request_counter(method: str, model: str, code: str, protocol: str):
    return REQUESTS.labels(method, model, code, protocol)


def count_request(method: str, model: str, code: str, protocol: str = PROTOCOL_MHA_V1) -> None:
    """One finished RPC. The label values are bounded: method names, hosted models (or
    "unknown"), status code names and the two protocols."""
    _request_counter(method, model, code, protocol).inc()


def serve_metrics(port: int, host: str = "0.0.0.0") -> None:
    """Starts the HTTP /metrics endpoint in a background thread."""
    start_http_server(port, addr=host)
