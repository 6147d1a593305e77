"""Every metric mha-serve registers with prometheus-client, its name, labels, help text and
buckets (the edges as named constants), created once here; the label values they take."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, disable_created_metrics

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
