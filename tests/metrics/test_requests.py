"""The per-call metrics (issue 25 binds their labelled children once, per model and per
lane): each observation lands in its own model's and lane's series, by the value given."""

from __future__ import annotations

import bisect
from types import SimpleNamespace

import pytest
from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from mha_serve import metrics
from mha_serve.metrics.requests import _histogram, _inc

MODEL = "requests-test"  # a model name no other test counts under


def value(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_a_lanes_batch_observer_counts_that_lane_only():
    fast = {"model": MODEL, "lane": "fast"}
    weights = {"model": MODEL, "lane": "weights"}
    names = ("mha_serve_batch_compute_seconds", "mha_serve_batch_size", "mha_serve_batch_requests")

    def snapshot() -> dict:
        got = {
            (name + part, lane["lane"]): value(name + part, **lane)
            for name in names
            for lane in (fast, weights)
            for part in ("_count", "_sum")
        }
        for le in ("4.0", "8.0"):  # (cumulative buckets)
            got[le] = value("mha_serve_batch_size_bucket", le=le, **fast)
        return got

    before = snapshot()
    observe = metrics.batch_observer(MODEL, "fast")
    observe(SimpleNamespace(compute_s=0.003, batch_size=5, num_requests=2))
    observe(SimpleNamespace(compute_s=0.02, batch_size=1, num_requests=1))
    after = snapshot()
    for name, total in zip(names, (0.023, 6, 3), strict=True):
        assert after[(name + "_count", "fast")] == before[(name + "_count", "fast")] + 2
        assert abs(after[(name + "_sum", "fast")] - before[(name + "_sum", "fast")] - total) < 1e-9
        assert after[(name + "_count", "weights")] == before[(name + "_count", "weights")]
    # 1 sequence is in the le=4 bucket, 5 only from le=8 on
    assert after["4.0"] == before["4.0"] + 1 and after["8.0"] == before["8.0"] + 2


def test_an_attend_counts_its_tokens_latencies_and_weights_bytes():
    labels = {"model": MODEL}
    names = (
        "mha_serve_tokens_total",
        "mha_serve_request_tokens_sum",
        "mha_serve_queue_latency_seconds_sum",
        "mha_serve_request_latency_seconds_count",
        "mha_serve_attention_weights_bytes_total",
    )
    before = [value(n, **labels) for n in names]
    metrics.observe_attend(MODEL, tokens=16, queue_s=0.001, total_s=0.004, weights_bytes=0)
    metrics.observe_attend(MODEL, tokens=1, queue_s=0.002, total_s=0.003, weights_bytes=640)
    after = [value(n, **labels) for n in names]
    assert after[0] == before[0] + 17 and after[1] == before[1] + 17
    assert abs(after[2] - before[2] - 0.003) < 1e-12
    assert after[3] == before[3] + 2
    assert after[4] == before[4] + 640


def _twin_registries():
    """Two registries, each with one histogram, counter and gauge of the same names."""
    made = []
    for _ in range(2):
        registry = CollectorRegistry()
        made.append(
            (
                registry,
                Histogram(
                    "h_seconds", "h", ["m"], buckets=metrics.LATENCY_BUCKETS_S, registry=registry
                ),
                Counter("c", "c", ["m"], registry=registry),
                Gauge("g", "g", registry=registry),
            )
        )
    return made


def test_the_per_request_increments_expose_what_inc_exposes():
    """_inc skips prometheus-client's checks, not its work: the same amounts give
    the same exposition as its public methods (a counter's, and a gauge's either way)."""
    (public, _, c1, g1), (direct, _, c2, g2) = _twin_registries()
    inc, add = _inc(c2.labels("x")), _inc(g2)
    for amount in [0.0, *metrics.LATENCY_BUCKETS_S, 1e-9, 99.0, 1e6, 3, 0.0004]:
        c1.labels("x").inc(amount)
        inc(amount)
        g1.inc(1)
        add(1)
    g1.dec()
    add(-1)
    assert generate_latest(direct) == generate_latest(public)


# Amounts a latency may be given: every bound, just above each, tiny and huge ones, and the
# edges observe() has rules for (NaN in no bucket, +/-inf, negative).
LATENCIES = [
    0.0,
    *metrics.LATENCY_BUCKETS_S,
    *(b * 1.001 for b in metrics.LATENCY_BUCKETS_S),
    1e-9,
    99.0,
    1e6,
    0.0004,
    float("inf"),
    float("-inf"),
    -1.0,
    float("nan"),
]
COUNTS = [0, 1, 2, 3, 5, *metrics.TOKEN_BUCKETS, *metrics.BATCH_SIZE_BUCKETS, 10**6]


def _series(model: str, *metric) -> dict:
    """Every sample of these metrics under `model`, by name and its other labels (values by
    repr: NaN equals NaN)."""
    return {
        (sample.name, tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model"))): (
            repr(sample.value)
        )
        for m in metric
        for family in m.collect()
        for sample in family.samples
        if sample.labels.get("model") == model
    }


def test_a_models_attend_observer_exposes_what_observe_and_inc_expose():
    """attend_observer writes each histogram's steps out: for every amount, bounds and edges
    included, the same series as prometheus-client's public methods give another model."""
    direct, public = "observer-attend-direct", "observer-attend-public"
    observe = metrics.attend_observer(direct)
    for i, (tokens, latency) in enumerate(zip(COUNTS * 2, LATENCIES * 2, strict=False)):
        weights_bytes = 64 * i if i % 3 else 0
        queue_s = LATENCIES[(i * 7) % len(LATENCIES)]
        observe(tokens, queue_s, latency, weights_bytes)
        metrics.TOKENS.labels(public).inc(tokens)
        metrics.REQUEST_TOKENS.labels(public).observe(tokens)
        metrics.QUEUE_LATENCY.labels(public).observe(queue_s)
        metrics.REQUEST_LATENCY.labels(public).observe(latency)
        if weights_bytes:
            metrics.WEIGHTS_BYTES.labels(public).inc(weights_bytes)
    per_model = (
        metrics.TOKENS,
        metrics.REQUEST_TOKENS,
        metrics.QUEUE_LATENCY,
        metrics.REQUEST_LATENCY,
        metrics.WEIGHTS_BYTES,
    )
    got, want = _series(direct, *per_model), _series(public, *per_model)
    assert got == want and len(got) > 40


def test_a_lanes_batch_observer_exposes_what_observe_exposes():
    direct, public = "observer-batch-direct", "observer-batch-public"
    observe = metrics.batch_observer(direct, "fast")
    for i, (size, compute_s) in enumerate(zip(COUNTS * 2, LATENCIES * 2, strict=False)):
        requests = COUNTS[(i * 5) % len(COUNTS)]
        observe(SimpleNamespace(compute_s=compute_s, batch_size=size, num_requests=requests))
        metrics.COMPUTE_LATENCY.labels(public, "fast").observe(compute_s)
        metrics.BATCH_SIZE.labels(public, "fast").observe(size)
        metrics.BATCH_REQUESTS.labels(public, "fast").observe(requests)
    per_lane = (metrics.COMPUTE_LATENCY, metrics.BATCH_SIZE, metrics.BATCH_REQUESTS)
    got, want = _series(direct, *per_lane), _series(public, *per_lane)
    assert got == want and len(got) > 30


def test_the_per_request_updates_fall_back_to_the_public_methods():
    """A prometheus-client whose children keep their values elsewhere gets its own methods:
    a histogram's observe() as its sum, and one bucket that adds nothing."""

    class Other:
        def __init__(self) -> None:
            self.observed: list[float] = []

        def observe(self, amount: float) -> None:
            self.observed.append(amount)

        def inc(self, amount: float = 1) -> None: ...

    other = Other()
    assert _inc(other) == other.inc
    add_to_sum, bounds, add_to_bucket = _histogram(other)
    assert add_to_sum == other.observe and len(add_to_bucket) == len(bounds) == 1
    add_to_sum(0.5)
    add_to_bucket[bisect.bisect_left(bounds, 0.5)](1)
    assert other.observed == [0.5]


def test_request_counts_counts_what_count_request_counts():
    """A stream's counter, bound once: the same series as count_request, OK or not."""
    method, protocol = "StreamSession", metrics.PROTOCOL_MHA_V1

    def counted(code: str) -> float:
        labels = {"method": method, "model": MODEL, "code": code, "protocol": protocol}
        return value("mha_serve_requests_total", **labels)

    before = {code: counted(code) for code in ("OK", "NOT_FOUND")}
    count = metrics.request_counts(method, MODEL, protocol)
    count("OK")
    count("OK")
    count("NOT_FOUND")
    metrics.count_request(method, MODEL, "OK", protocol)
    assert counted("OK") == before["OK"] + 3
    assert counted("NOT_FOUND") == before["NOT_FOUND"] + 1


def test_a_models_attend_observer_is_observe_attend():
    labels = {"model": MODEL}
    names = (
        "mha_serve_tokens_total",
        "mha_serve_request_tokens_count",
        "mha_serve_queue_latency_seconds_sum",
        "mha_serve_request_latency_seconds_sum",
        "mha_serve_attention_weights_bytes_total",
    )
    before = [value(n, **labels) for n in names]
    assert metrics.attend_observer(MODEL) is metrics.attend_observer(MODEL)  # bound once
    metrics.attend_observer(MODEL)(3, 0.25, 0.5, 0)
    metrics.observe_attend(MODEL, tokens=2, queue_s=0.25, total_s=0.5, weights_bytes=8)
    after = [value(n, **labels) for n in names]
    got = [a - b for a, b in zip(after, before, strict=True)]
    assert got == pytest.approx([5, 2, 0.5, 1.0, 8], abs=1e-9)
