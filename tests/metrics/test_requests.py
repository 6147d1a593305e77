"""The per-call metrics (issue 25 binds their labelled children once, per model and per
lane): each observation lands in its own model's and lane's series, by the value given."""

from __future__ import annotations

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


def test_the_per_request_updates_expose_what_observe_and_inc_expose():
    """metrics._observe and _inc skip prometheus-client's checks, not its work: the same
    amounts, bounds included, give the same exposition as its public methods."""
    (public, h1, c1, g1), (direct, h2, c2, g2) = _twin_registries()
    bounds = metrics.LATENCY_BUCKETS_S
    amounts = [0.0, *bounds, *(b * 1.001 for b in bounds), 1e-9, 99.0, 1e6, 3, 0.0004]
    observe, inc, add = (
        metrics._observe(h2.labels("x")),
        metrics._inc(c2.labels("x")),
        metrics._inc(g2),
    )
    for amount in amounts:
        h1.labels("x").observe(amount)
        observe(amount)
        c1.labels("x").inc(amount)
        inc(amount)
        g1.inc(1)
        add(1)
    g1.dec()
    add(-1)
    assert generate_latest(direct) == generate_latest(public)
    assert direct.get_sample_value("h_seconds_count", {"m": "x"}) == len(amounts)


def test_the_per_request_updates_fall_back_to_the_public_methods():
    """A prometheus-client whose children keep their values elsewhere gets its own methods."""

    class Other:
        def observe(self, amount: float) -> None: ...

        def inc(self, amount: float = 1) -> None: ...

    other = Other()
    assert metrics._observe(other) == other.observe
    assert metrics._inc(other) == other.inc


def test_a_histograms_edge_amounts_land_where_observe_puts_them():
    """NaN (in no bucket), +/-inf and negative amounts: the same exposition as observe()."""
    (public, h1, _, _), (direct, h2, _, _) = _twin_registries()
    observe = metrics._observe(h2.labels("x"))
    for amount in (float("-inf"), -1.0, float("inf"), float("nan"), 0.5):
        h1.labels("x").observe(amount)
        observe(amount)
    assert generate_latest(direct) == generate_latest(public)
    assert direct.get_sample_value("h_seconds_count", {"m": "x"}) == 4  # NaN in no bucket


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
