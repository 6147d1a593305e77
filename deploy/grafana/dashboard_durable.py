"""The dashboard's "Durable sessions" row: the spill tier (sessions moved out of a full KV
cache and read back), sessions a server adopted from its spill directory at start, and
sessions moved or lost (docs/operations.md, "Durable sessions")."""

from __future__ import annotations

from dashboard_queries import MODEL, RATE, TARGET, Panel, Query, quantiles, rate

# The spill tier's gauges: one tier serves every model, so its series carry model="" (named
# "every model" in the legend), kept whichever models are picked above the dashboard.
SPILL_TIER = f'model=~"$model|", {TARGET}'


def spill_gauge(metric: str) -> str:
    return (
        f'sum by (model) (label_replace({metric}{{{SPILL_TIER}}}, "model", "every model", '
        '"model", ""))'
    )


# Why a spill-tier panel is empty in tests/deploy/test_real_prometheus.py.
NO_SPILL_DIR = (
    "the spill tier's gauges exist only with a spill directory (session_spill_dir); the test's "
    "server has none, so that its small KV cache refuses (RESOURCE_EXHAUSTED) rather than spills"
)

DURABLE = (
    Panel(
        "Sessions spilled by model and reason",
        "Sessions written to the spill directory per second: room (moved out of a full KV "
        "cache, least recently used first) and shutdown (written out after draining). Room "
        "spills all the time: the KV cache is too small for the sessions in use, and each one "
        "costs a restore on its next call; raise kv_cache_bytes or add replicas.",
        "ops",
        (
            Query(
                rate("mha_serve_sessions_spilled_total", by="model, reason"), "{{model}} {{reason}}"
            ),
        ),
    ),
    Panel(
        "Bytes spilled by model",
        "Bytes of session files written to the spill directory per second: the write load "
        "on its volume.",
        "Bps",
        (Query(rate("mha_serve_spilled_bytes_total"), "{{model}}"),),
    ),
    Panel(
        "Session restores by model",
        "Spilled sessions read back into the KV cache per second, each by its next call "
        "(a step, stream, fork, truncate or GetSession).",
        "ops",
        (Query(rate("mha_serve_session_restores_total"), "{{model}}"),),
    ),
    Panel(
        "Restore latency by model",
        "p50 and p99 time to read one spilled session back, which its next call waits for "
        "(the reply's timing says so too). Rising: larger sessions or a slower volume.",
        "s",
        quantiles("mha_serve_session_restore_seconds")[::2],  # p50, p99
        may_be_empty="no session is restored in the test's run: a quantile of nothing",
    ),
    Panel(
        "Spill tier: bytes used vs budget",
        "Bytes of the session files in the spill directory against its budget "
        "(session_spill_bytes). Used at the budget: the oldest spilled sessions expire and "
        "are lost (MhaServeSessionsLost, reason spill_full).",
        "bytes",
        (
            Query(spill_gauge("mha_serve_spill_bytes_used"), "used {{model}}"),
            Query(spill_gauge("mha_serve_spill_budget_bytes"), "budget {{model}}"),
        ),
        may_be_empty=NO_SPILL_DIR,
    ),
    Panel(
        "Sessions in the spill tier",
        "Sessions held in the spill directory: spilled to make room, or written out at "
        "shutdown and not yet adopted and called again.",
        "short",
        (Query(spill_gauge("mha_serve_spill_sessions"), "{{model}}"),),
        may_be_empty=NO_SPILL_DIR,
    ),
    Panel(
        "Sessions adopted at start",
        "Sessions each running server took over from its spill directory when it started "
        "(the count itself, not a rate: it is counted before the first scrape). Zero after "
        "a restart whose predecessor held sessions: the pod did not get its volume back, or "
        "its files were refused (sessions lost, reason bad_file; the log says why).",
        "short",
        (
            Query(
                f"sum by (instance, model) (mha_serve_sessions_adopted_total{{{MODEL}}})",
                "{{instance}} {{model}}",
            ),
        ),
    ),
    Panel(
        "Ray: sessions moved and lost",
        "Sessions moved off Ray replicas that Ray stopped (scale-down, redeploy); lost with "
        "a replica that died before it could move them (replica killed: look into the "
        "crash); lost by a replica Ray stopped that could not move them (move failed: give "
        "the replicas room, or raise graceful_shutdown_timeout_s). Moved sessions keep "
        "their ids.",
        "ops",
        (
            Query(f"sum(rate(mha_serve_sessions_moved_total{{{TARGET}}}[{RATE}]))", "moved"),
            Query(
                "sum(rate(mha_serve_sessions_lost_total"
                f'{{reason="replica_killed", {TARGET}}}[{RATE}]))',
                "lost: replica killed",
            ),
            Query(
                "sum(rate(mha_serve_sessions_lost_total"
                f'{{reason="move_failed", {TARGET}}}[{RATE}]))',
                "lost: move failed",
            ),
        ),
    ),
    Panel(
        "Sessions lost by reason",
        "Sessions lost for good per second: spill_full (expired from a full spill tier), "
        "replica_killed (a Ray replica died), move_failed (a Ray replica stopped and could "
        "not move them), bad_file (a spill file refused at adoption or restore). Any "
        "loss fires MhaServeSessionsLost; docs/operations.md says what to do for each.",
        "ops",
        (Query(rate("mha_serve_sessions_lost_total", TARGET, by="reason"), "{{reason}}"),),
    ),
)
