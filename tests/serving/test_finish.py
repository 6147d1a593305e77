"""A computed call's finish (serving/finish.py): a small reply encoded here (finish_here, no
coroutine) and one through finish give the same Served and count the same metrics; a large
one is left to finish, which encodes it off the loop."""

from __future__ import annotations

import asyncio

import numpy as np
from prometheus_client import REGISTRY

from mha_serve.engine.requests import Array, AttendOutcome, AttendRequest
from mha_serve.serving.finish import OFFLOAD_BYTES, Computed, finish, finish_here

MODEL = "finish-test"  # a model name no other test counts under


def _computed(seq_len: int) -> Computed:
    x = Array(np.ones((1, seq_len, 4), np.float32), "float32")
    outcome = AttendOutcome(x, None, None, 0, 0.5, 1, None)
    return Computed(AttendRequest(MODEL, x), MODEL, outcome, 1.5, 0.5, 0.25)


def _counted() -> tuple[float, float]:
    labels = {"model": MODEL}
    return (
        REGISTRY.get_sample_value("mha_serve_tokens_total", labels) or 0.0,
        REGISTRY.get_sample_value("mha_serve_request_latency_seconds_count", labels) or 0.0,
    )


def _encode(outcome: AttendOutcome) -> bytes:
    return outcome.output.tobytes()


def test_a_small_reply_is_finished_alike_here_and_through_finish():
    computed = _computed(3)
    before = _counted()
    here = finish_here(computed, _encode, received=0.0)
    between = _counted()
    through = asyncio.run(finish(computed, _encode, received=0.0))
    after = _counted()
    assert here is not None
    assert here.reply == through.reply == computed.outcome.output.tobytes()
    assert here.model == through.model == MODEL
    for t in (here.timing, through.timing):
        assert (t.queue_ms, t.compute_ms, t.batch_size, t.restore_ms) == (1.5, 0.5, 1, 0.25)
    assert between == (before[0] + 3, before[1] + 1)  # 3 tokens, one request
    assert after == (between[0] + 3, between[1] + 1)


def test_a_large_reply_is_left_to_finish():
    computed = _computed(OFFLOAD_BYTES // 16 + 1)  # (4 float32 per token)
    before = _counted()
    assert finish_here(computed, _encode, received=0.0) is None
    assert _counted() == before  # nothing counted for it yet
    served = asyncio.run(finish(computed, _encode, received=0.0))
    assert served.reply == computed.outcome.output.tobytes()
    assert _counted()[1] == before[1] + 1
