"""What a load run measured (mha_client.loadgen): its counts, rates and latency percentiles,
as text for a terminal and as a dict for JSON."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

PERCENTILES = (50, 95, 99)


@dataclass
class LatencyStats:
    count: int
    mean_ms: float
    p50_ms: float
    p95_ms: float
    p99_ms: float
    max_ms: float


def latency_stats(latencies_ms: Sequence[float]) -> LatencyStats:
    """Mean, p50/p95/p99 (linear interpolation between order statistics) and max; NaN if empty."""
    lat = np.asarray(latencies_ms, dtype=np.float64)
    if lat.size == 0:
        return LatencyStats(0, *([math.nan] * 5))
    p50, p95, p99 = np.percentile(lat, PERCENTILES)
    mean, peak = float(lat.mean()), float(lat.max())
    return LatencyStats(int(lat.size), mean, float(p50), float(p95), float(p99), peak)


@dataclass
class LoadResult:
    mode: str
    label: str
    model: str
    seq_lens: str
    batch: int
    weights: bool
    concurrency: int | None
    rate: float | None
    arrivals: str | None
    warmup: int
    ok: int  # measured requests that succeeded
    errors: dict[str, int]  # measured failures by status code
    error_messages: dict[str, str]  # the first measured failure's message of each code
    skipped: int  # open loop: arrivals dropped at max_in_flight
    elapsed_s: float  # first measured request sent -> last measured reply
    requests_per_s: float  # successful requests only
    sequences_per_s: float
    tokens_per_s: float  # real tokens (batch x length) of successful requests
    latency: LatencyStats
    client_cpu_s: float  # CPU time of the generator's process over the whole run
    # Wall time of that same whole run (warm-up included): the span client_cpu_s is spent
    # in, so client_cpu_s / client_wall_s is the cores the generator kept busy. elapsed_s,
    # the measured window alone, is shorter: CPU divided by it could exceed the machine.
    client_wall_s: float
    interrupted: bool = False  # stopped by Ctrl-C: the figures are of what answered by then
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The fields, JSON-ready: JSON has no NaN, so the latency of no answer is null."""
        d = asdict(self)
        d["latency"] = {k: v if math.isfinite(v) else None for k, v in d["latency"].items()}
        return d

    @property
    def error_rate(self) -> float:
        """The fraction of the measured requests that failed (arrivals skipped at
        max_in_flight were never sent: not counted)."""
        failed = sum(self.errors.values())
        return failed / (failed + self.ok) if failed + self.ok else 0.0

    @property
    def client_cores(self) -> float:
        """Cores the generator's process kept busy on average over its run."""
        return self.client_cpu_s / self.client_wall_s if self.client_wall_s > 0 else 0.0

    def format(self) -> str:
        loop = (
            f"closed loop, {self.concurrency} clients"
            if self.mode == "closed"
            else f"open loop, {self.rate:g} req/s {self.arrivals}"
        )
        head = f"{self.label + ': ' if self.label else ''}{loop}; model {self.model}, "
        head += f"seq_len {self.seq_lens}, batch {self.batch}{', weights' if self.weights else ''}"
        lat = self.latency
        errors = ", ".join(f"{k} {v}" for k, v in sorted(self.errors.items())) or "none"
        if self.skipped:
            errors += f"; {self.skipped} arrivals skipped (over max_in_flight)"
        stopped = "; stopped by Ctrl-C" if self.interrupted else ""
        # What a refusal says (a limit, what to change): the counts alone do not tell it.
        errors += "".join(
            f"\n             first {k}: {m}" for k, m in sorted(self.error_messages.items()) if m
        )
        return "\n".join(
            [
                head,
                f"requests     {self.ok} ok in {self.elapsed_s:.2f} s "
                f"(warm-up {self.warmup} excluded{stopped})",
                f"throughput   {self.requests_per_s:.1f} req/s  {self.sequences_per_s:.1f} seq/s  "
                f"{self.tokens_per_s:.0f} tokens/s",
                f"latency ms   p50 {lat.p50_ms:.2f}  p95 {lat.p95_ms:.2f}  p99 {lat.p99_ms:.2f}  "
                f"max {lat.max_ms:.2f}  mean {lat.mean_ms:.2f}",
                f"errors       {errors}",
                f"client cpu   {self.client_cpu_s:.3f} s in {self.client_wall_s:.3f} s, "
                f"warm-up included ({self.client_cores:.2f} cores)",
            ]
        )
