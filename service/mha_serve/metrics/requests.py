"""The per-request series, updated on every answered call: the request counters and the
attend and batch observers, each model's (and lane's) children looked up once."""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable
from typing import Any

from .definitions import (
    BATCH_REQUESTS,
    BATCH_SIZE,
    COMPUTE_LATENCY,
    IN_FLIGHT,
    PROTOCOL_MHA_V1,
    QUEUE_LATENCY,
    REQUEST_LATENCY,
    REQUEST_TOKENS,
    REQUESTS,
    TOKENS,
    WEIGHTS_BYTES,
)

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
