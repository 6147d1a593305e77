"""mha.v1 messages <-> engine calls (transport/convert.py), against plain references: fields a
request leaves out read as their defaults, and a reply built in place holds exactly what the
outcome and its timing say (issue 25 reads and writes them in fewer steps)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from mha_client.api import attention_pb2 as pb
from mha_serve.cache.types import SessionStats
from mha_serve.engine import AttendOutcome
from mha_serve.engine.errors import InvalidRequest
from mha_serve.engine.requests import Array
from mha_serve.serving.protocol import Timing
from mha_serve.transport.convert import encode_result, session_info, stamp, to_call


def _request(shape: tuple[int, ...], **fields) -> pb.AttendRequest:
    x = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    tensor = pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=shape, data=x.tobytes())
    return pb.AttendRequest(model="mha", input=tensor, **fields)


def _fields(call) -> dict:
    """A call's fields but its input (an array, compared apart)."""
    return {f.name: getattr(call, f.name) for f in dataclasses.fields(call) if f.name != "inputs"}


def test_absent_fields_read_as_their_defaults():
    bare, _ = to_call(_request((3, 512)))
    # every optional part present and at its default value: the same call
    present, _ = to_call(_request((3, 512), weights=pb.WeightsRequest(enabled=False)))
    assert _fields(bare) == _fields(present)
    assert _fields(bare) == {
        "model": "mha",
        "lengths": None,
        "causal": None,
        "need_weights": False,
        "weight_heads": None,
        "query_start": 0,
        "query_end": 0,
        "weights_dtype": "float32",
        "head_mask": None,
        "output_dtype": None,
        "session_id": None,
    }


def test_set_fields_are_read():
    call, _ = to_call(
        _request(
            (2, 3, 512),
            lengths=[3, 2],
            causal=False,
            head_mask=[1.0, 0.5],
            output_dtype=pb.DTYPE_FLOAT16,
            weights=pb.WeightsRequest(
                enabled=True, heads=[2, 0], query_start=1, query_end=3, dtype=pb.DTYPE_BFLOAT16
            ),
        )
    )
    assert (call.lengths, call.causal, call.head_mask, call.output_dtype) == (
        (3, 2),
        False,
        (1.0, 0.5),
        "float16",
    )
    assert (call.need_weights, call.weight_heads, call.query_start, call.query_end) == (
        True,
        (2, 0),
        1,
        3,
    )
    assert call.weights_dtype == "bfloat16"


def test_weights_fields_without_enabled_are_refused():
    with pytest.raises(InvalidRequest, match="weights.enabled is false"):
        to_call(_request((3, 512), weights=pb.WeightsRequest(query_end=2)))


@pytest.mark.parametrize("shape", [(3, 512), (1, 3, 512), (2, 3, 512)])
def test_the_input_is_the_message_bytes_a_single_sequence_a_batch_of_one(shape):
    call, single = to_call(_request(shape))
    assert single == (len(shape) == 2)
    want = np.arange(np.prod(shape), dtype=np.float32).reshape((1, *shape) if single else shape)
    assert call.inputs.dtype == "float32"
    np.testing.assert_array_equal(call.inputs.data, want)


@pytest.mark.parametrize("single", [False, True])
@pytest.mark.parametrize("weights", [False, True])
def test_the_reply_holds_the_outcome(single, weights):
    rng = np.random.default_rng(0)
    output = rng.standard_normal((2, 3, 8), dtype=np.float32)
    w = rng.standard_normal((2, 2, 3, 3), dtype=np.float32) if weights else None
    stats = SessionStats("s-1", "mha", num_tokens=7, num_blocks=1, bytes_held=512, ttl_s=9.0)
    outcome = AttendOutcome(
        output=Array(output, "float32"),
        weights=None if w is None else Array(w, "float32"),
        weight_heads=(1, 0) if weights else (),
        weight_query_start=2 if weights else 0,
        session=stats,
    )
    reply = encode_result(outcome, single)
    # the reference: each part built as a message of its own
    want_out = output[0] if single else output
    want = pb.AttendResponse(
        output=pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=want_out.shape, data=want_out.tobytes()),
        weight_heads=outcome.weight_heads,
        weight_query_start=outcome.weight_query_start,
        session=session_info(stats),
    )
    if w is not None:
        want_w = w[0] if single else w
        want.attention_weights.CopyFrom(
            pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=want_w.shape, data=want_w.tobytes())
        )
    assert reply == want
    assert reply.session == pb.SessionInfo(
        session_id="s-1", model="mha", num_tokens=7, num_blocks=1, bytes_held=512, ttl_s=9.0
    )


def test_stamp_sets_the_model_and_every_timing_field():
    reply = pb.AttendResponse()
    stamp(reply, "gqa", Timing(0.5, 1.25, 2.0, 3, restore_ms=4.5))
    assert reply.model == "gqa"
    assert reply.timing == pb.Timing(
        queue_ms=0.5, compute_ms=1.25, total_ms=2.0, batch_size=3, restore_ms=4.5
    )


@pytest.mark.parametrize("limits", [{}, {"max_len": 0, "ttl_s": 0.0}])
def test_fields_at_their_default_are_left_unset_the_same_bytes(limits):
    """A session without limits and a call that restored nothing leave max_len, ttl_s and
    restore_ms unset: proto3 sends a field at 0 as no field, so the bytes are the same."""
    stats = SessionStats("s-1", "mha", num_tokens=7, num_blocks=1, bytes_held=512, **limits)
    info = session_info(stats)
    want = pb.SessionInfo(session_id="s-1", model="mha", num_tokens=7, num_blocks=1)
    want.bytes_held, want.max_len, want.ttl_s = 512, 0, 0.0
    assert info == want and info.SerializeToString() == want.SerializeToString()
    assert info.max_len == 0 and info.ttl_s == 0.0
    reply = pb.AttendResponse()
    stamp(reply, "mha", Timing(0.5, 1.25, 2.0, 3))
    assert reply.timing.restore_ms == 0.0
    assert reply.timing == pb.Timing(
        queue_ms=0.5, compute_ms=1.25, total_ms=2.0, batch_size=3, restore_ms=0.0
    )
