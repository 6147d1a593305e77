"""The panels of mha-serve's Grafana dashboard, as data: rows of panels, each with its queries.

deploy/grafana/dashboard.py turns them into Grafana JSON; tests/deploy evaluate every query
against a real Prometheus. Every query aggregates with `sum by (...)` (or keeps every label),
so labels added later (a `protocol` on requests, a `replica` from the Ray app) neither break
nor double a panel. What a panel is and the PromQL helpers are in dashboard_queries.py; the
durable-session row is in dashboard_durable.py.
"""

from __future__ import annotations

from dashboard_durable import DURABLE
from dashboard_queries import (
    MODEL,
    RATE,
    TARGET,
    Panel,
    Query,
    mean,
    quantiles,
    rate,
)

SERVER_ERRORS = 'code=~"INTERNAL|UNKNOWN|UNAVAILABLE|DEADLINE_EXCEEDED|DATA_LOSS"'

OVERVIEW = (
    Panel(
        "Ready replicas",
        "Replicas whose models are loaded and warm and that are not draining (health SERVING).",
        "short",
        (Query(f"sum(mha_serve_ready{{{TARGET}}})", "ready"),),
        kind="stat",
        width=4,
    ),
    Panel(
        "Requests/s",
        "Attend calls and session steps and RPCs finished per second, every status.",
        "reqps",
        (Query(f"sum(rate(mha_serve_requests_total{{{MODEL}}}[{RATE}]))", "requests/s"),),
        kind="stat",
        width=4,
    ),
    Panel(
        "Error ratio",
        "Share of RPCs answered with any status but OK (client errors included).",
        "percentunit",
        (
            Query(
                f'sum(rate(mha_serve_requests_total{{code!="OK", {MODEL}}}[{RATE}]))\n'
                f"  / sum(rate(mha_serve_requests_total{{{MODEL}}}[{RATE}]))",
                "errors",
            ),
        ),
        kind="stat",
        width=4,
    ),
    Panel(
        "p99 latency",
        "Server-side p99 from receipt to reply over every selected model.",
        "s",
        (
            Query(
                "histogram_quantile(0.99, sum by (le) "
                f"(rate(mha_serve_request_latency_seconds_bucket{{{MODEL}}}[{RATE}])))",
                "p99",
            ),
        ),
        kind="stat",
        width=4,
    ),
    Panel(
        "Tokens/s",
        "Tokens (batch x seq_len) processed per second.",
        "short",
        (Query(f"sum(rate(mha_serve_tokens_total{{{MODEL}}}[{RATE}]))", "tokens/s"),),
        kind="stat",
        width=4,
    ),
    Panel(
        "In flight",
        "Requests received and not yet answered.",
        "short",
        (Query(f"sum(mha_serve_requests_in_flight{{{TARGET}}})", "in flight"),),
        kind="stat",
        width=4,
    ),
)

TRAFFIC = (
    Panel(
        "Request rate by model and status",
        "RPCs finished per second, by model and gRPC status code.",
        "reqps",
        (Query(rate("mha_serve_requests_total", by="model, code"), "{{model}} {{code}}"),),
    ),
    Panel(
        "Errors by model and status",
        "RPCs answered with an error per second. INVALID_ARGUMENT and NOT_FOUND are the "
        "clients' mistakes; INTERNAL, UNAVAILABLE and DEADLINE_EXCEEDED are the server's.",
        "reqps",
        (
            Query(
                rate("mha_serve_requests_total", f'code!="OK", {MODEL}', by="model, code"),
                "{{model}} {{code}}",
            ),
        ),
    ),
    Panel(
        "Server error ratio by model",
        "Share of RPCs that failed on the server's side (the MhaServeHighErrorRatio alert).",
        "percentunit",
        (
            Query(
                f"(\n  {rate('mha_serve_requests_total', f'{SERVER_ERRORS}, {MODEL}')}\n"
                f"  or {rate('mha_serve_requests_total')} * 0\n)\n"
                f"/ {rate('mha_serve_requests_total')}",
                "{{model}}",
            ),
        ),
    ),
    Panel(
        "Tokens/s by model",
        "Tokens (batch x seq_len) processed per second by Attend and session steps.",
        "short",
        (Query(rate("mha_serve_tokens_total"), "{{model}}"),),
    ),
    Panel(
        "Attention weights returned by model",
        "Bytes of per-head attention weights sent back per second (requests with weights=true).",
        "Bps",
        (Query(rate("mha_serve_attention_weights_bytes_total"), "{{model}}"),),
    ),
    Panel(
        "Rejections (RESOURCE_EXHAUSTED) by model and method",
        "Requests refused for load: a full queue or a full KV cache. Scale out, or raise "
        "max_queue_requests / kv_cache_bytes.",
        "reqps",
        (
            Query(
                rate(
                    "mha_serve_requests_total",
                    f'code="RESOURCE_EXHAUSTED", {MODEL}',
                    by="model, method",
                ),
                "{{model}} {{method}}",
            ),
        ),
    ),
)

LATENCY = (
    Panel(
        "End-to-end latency by model",
        "Server-side time from receipt to reply of an Attend or a session step.",
        "s",
        quantiles("mha_serve_request_latency_seconds"),
    ),
    Panel(
        "Queue latency by model",
        "Receipt until the forward began: decoding, validation and waiting for a batch.",
        "s",
        quantiles("mha_serve_queue_latency_seconds"),
    ),
    Panel(
        "Compute latency by model and lane",
        "One batch's forward pass; the weights lane materialises attention weights.",
        "s",
        quantiles("mha_serve_batch_compute_seconds", by="model, lane"),
    ),
)

BATCHING = (
    Panel(
        "Batch size (sequences per forward)",
        "Mean and p95 sequences per forward pass. Well above 1: batching at work.",
        "short",
        (
            Query(mean("mha_serve_batch_size", "model, lane"), "mean {{model}} {{lane}}"),
            Query(
                "histogram_quantile(0.95, sum by (model, lane, le) "
                f"(rate(mha_serve_batch_size_bucket{{{MODEL}}}[{RATE}])))",
                "p95 {{model}} {{lane}}",
            ),
        ),
        width=6,
    ),
    Panel(
        "Batch fill (requests per forward)",
        "Mean requests sharing one forward pass: how full the batcher makes each batch.",
        "short",
        (Query(mean("mha_serve_batch_requests", "model, lane"), "{{model}} {{lane}}"),),
        width=6,
    ),
    Panel(
        "Tokens per request",
        "p50 and p95 of tokens (batch x seq_len) per Attend or session step: the work each "
        "request brings to a batch.",
        "short",
        quantiles("mha_serve_request_tokens")[:2],
        width=6,
    ),
    Panel(
        "Queue depth by model and lane",
        "Requests waiting for a batch. Growing steadily: the replica is saturated.",
        "short",
        (
            Query(
                f"sum by (model, lane) (mha_serve_queue_depth{{{MODEL}}})",
                "{{model}} {{lane}}",
            ),
        ),
        width=6,
    ),
)

SESSIONS = (
    Panel(
        "Sessions open by model",
        "KV-cache sessions held (models with kv_cache_bytes > 0).",
        "short",
        (Query(f"sum by (model) (mha_serve_sessions{{{MODEL}}})", "{{model}}"),),
    ),
    Panel(
        "KV cache blocks: used vs total",
        "Blocks of each model's pool. Used near total: new sessions and steps are refused "
        "(RESOURCE_EXHAUSTED) or idle sessions evicted.",
        "short",
        (
            Query(
                f'sum by (model) (mha_serve_kv_cache_blocks{{state="used", {MODEL}}})',
                "used {{model}}",
            ),
            Query(
                f'sum by (model) (mha_serve_kv_cache_blocks{{state="total", {MODEL}}})',
                "total {{model}}",
            ),
        ),
    ),
    Panel(
        "KV cache bytes: used vs budget",
        "Memory of the blocks sessions hold, against kv_cache_bytes.",
        "bytes",
        (
            Query(f"sum by (model) (mha_serve_kv_cache_bytes_used{{{MODEL}}})", "used {{model}}"),
            Query(
                f"sum by (model) (mha_serve_kv_cache_budget_bytes{{{MODEL}}})",
                "budget {{model}}",
            ),
        ),
    ),
    Panel(
        "Sessions ended by reason",
        "closed by the client, expired (idle past session_ttl_s), evicted (to make room). "
        "Evictions mean the budget is too small for the sessions kept open.",
        "ops",
        (Query(rate("mha_serve_sessions_ended_total", TARGET, by="reason"), "{{reason}}"),),
    ),
    Panel(
        "KV cache blocks freed out of sliding windows",
        "Blocks a sliding-window model's sessions gave back because no future step could see "
        "them (docs/models.md): a windowed session's memory stays flat as it grows.",
        "ops",
        (Query(rate("mha_serve_kv_cache_window_freed_blocks_total"), "{{model}}"),),
    ),
)

PROCESS = (
    Panel(
        "Process CPU by replica",
        "CPU seconds per second of each server process (1 = one core busy).",
        "short",
        (Query(rate("process_cpu_seconds_total", TARGET, by="instance"), "{{instance}}"),),
    ),
    Panel(
        "Process memory by replica",
        "Resident memory of each server process.",
        "bytes",
        (
            Query(
                f"sum by (instance) (process_resident_memory_bytes{{{TARGET}}})",
                "{{instance}}",
            ),
        ),
    ),
    Panel(
        "GPU memory (NVIDIA DCGM exporter)",
        "Frame-buffer memory used and total per GPU of the mha-serve pods, from NVIDIA's "
        "dcgm-exporter (the GPU Operator installs it). No data on CPU-only replicas.",
        "bytes",
        (
            Query(
                'sum by (pod, gpu) (DCGM_FI_DEV_FB_USED{container="mha-serve"}) * 2^20',
                "used {{pod}} GPU {{gpu}}",
            ),
            Query(
                'sum by (pod, gpu) (DCGM_FI_DEV_FB_USED{container="mha-serve"}'
                ' + DCGM_FI_DEV_FB_FREE{container="mha-serve"}) * 2^20',
                "total {{pod}} GPU {{gpu}}",
            ),
        ),
        may_be_empty="GPU only: dcgm-exporter's series exist where a GPU does",
    ),
)

# One row per replica (repeated over $instance), the signals that tell one bad pod apart.
ONE = 'instance=~"$instance"'
PER_REPLICA = (
    Panel(
        "Requests/s by status",
        "This replica's RPCs per second by status code.",
        "reqps",
        (Query(rate("mha_serve_requests_total", ONE, by="code"), "{{code}}"),),
        width=6,
    ),
    Panel(
        "p99 latency by model",
        "This replica's server-side p99.",
        "s",
        (
            Query(
                "histogram_quantile(0.99, sum by (model, le) "
                f"(rate(mha_serve_request_latency_seconds_bucket{{{ONE}}}[{RATE}])))",
                "{{model}}",
            ),
        ),
        width=6,
    ),
    Panel(
        "Queue depth",
        "Requests waiting for a batch on this replica.",
        "short",
        (Query(f"sum by (model, lane) (mha_serve_queue_depth{{{ONE}}})", "{{model}} {{lane}}"),),
        width=6,
    ),
    Panel(
        "KV cache used",
        "Share of this replica's KV cache blocks in use.",
        "percentunit",
        (
            Query(
                f'sum by (model) (mha_serve_kv_cache_blocks{{state="used", {ONE}}})\n'
                f'  / sum by (model) (mha_serve_kv_cache_blocks{{state="total", {ONE}}})',
                "{{model}}",
            ),
        ),
        width=6,
    ),
)

ROWS: tuple[tuple[str, tuple[Panel, ...]], ...] = (
    ("Overview", OVERVIEW),
    ("Traffic and errors", TRAFFIC),
    ("Latency", LATENCY),
    ("Batching and queue", BATCHING),
    ("Sessions and KV cache", SESSIONS),
    ("Durable sessions", DURABLE),
    ("Process", PROCESS),
    ("Replica $instance", PER_REPLICA),
)
REPEATED_ROW = "Replica $instance"
