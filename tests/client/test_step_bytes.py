"""step_request_bytes and attend_request_bytes (what the SDK sends for a session step and an
Attend) against protobuf's messages: a plain request's cached head joined to its array's
bytes parses to the same message, whatever the array, session id, model and options;
anything else takes protobuf's way (or its framing) and raises what it raises."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mha_client import ops
from mha_client.api import attention_pb2 as pb
from mha_client.errors import InvalidArgumentError
from mha_client.messages import (
    FRAME_BYTES,
    _plain_head,
    attend_request_bytes,
    build_attend_request,
    step_request,
    step_request_bytes,
)
from mha_client.tensors import parse_with_tensors


@settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    shape=st.lists(st.integers(0, 4), min_size=1, max_size=4),
    dtype=st.sampled_from(["<f2", "<f4", "<f8", ">f4", ">f2", "<i4"]),
    transpose=st.booleans(),
    seed=st.integers(0, 99),
    # long ids (a length past one varint byte) and any text
    session_id=st.text(max_size=3) | st.text(min_size=130, max_size=200),
    options=st.sampled_from(
        [{}, {"causal": True}, {"lengths": [1]}, {"output_dtype": "float16"}, {"weights": True}]
    ),
)
def test_a_step_sends_the_message_protobuf_would(
    shape, dtype, transpose, seed, session_id, options
):
    x = (np.random.default_rng(seed).standard_normal(shape) * 1e3).astype(dtype)
    if transpose and x.ndim > 1:  # not C-contiguous
        x = x.swapaxes(-1, -2)
    try:
        built = step_request(session_id, x, options)
    except ValueError as e:
        with pytest.raises(ValueError) as sent:
            step_request_bytes(session_id, x, options)
        assert str(sent.value) == str(e)
        return
    assert pb.AttendRequest.FromString(step_request_bytes(session_id, x, options)) == built
    # an Attend alike (a model, no session)
    built = build_attend_request(session_id or "m", x, **options)
    sent = attend_request_bytes(session_id or "m", x, **options)
    assert pb.AttendRequest.FromString(sent) == built


def test_a_plain_decode_step_takes_the_cached_head():
    """One head per session and shape, made once; a float64 array (converted) or a step with
    options does not take it."""
    _plain_head.cache_clear()
    x = np.arange(8, dtype=np.float32).reshape(1, 8)
    for sid in ("a", "b", "a"):
        data = step_request_bytes(sid, x, {})
        assert pb.AttendRequest.FromString(data) == step_request(sid, x, {})
        assert data.endswith(x.tobytes())
    info = _plain_head.cache_info()
    assert (info.misses, info.hits) == (2, 1)
    step_request_bytes("a", x.astype(np.float64), {})
    step_request_bytes("a", x, {"causal": True})
    step_request_bytes("a", x.reshape(2, 4)[:, ::2], {})  # not contiguous
    assert _plain_head.cache_info().misses == 2 and _plain_head.cache_info().hits == 1


def test_a_step_at_the_framing_size_parses_alike_both_ways():
    """A request whose array is just under FRAME_BYTES is itself larger: the server then cuts
    its tensor out by hand (parse_with_tensors), which must find the same message and bytes
    whatever the fields' order."""
    E = FRAME_BYTES // 4 - 1
    x = np.random.default_rng(0).standard_normal((1, E)).astype(np.float32)
    data = step_request_bytes("session-1", x, {})
    assert len(data) >= FRAME_BYTES > x.nbytes
    message, payloads = parse_with_tensors(data, pb.AttendRequest, {2: "input"})
    assert bytes(payloads["input"]) == x.tobytes()
    message.input.data = bytes(payloads["input"])
    assert message == step_request("session-1", x, {})


@pytest.mark.parametrize(
    "send",
    [
        lambda x, **o: step_request_bytes("s", x, o),
        lambda x, **o: attend_request_bytes("m", x, **o) if not o else ops.attend("m", x, o),
    ],
)
def test_an_unknown_option_is_an_invalid_argument_naming_it(send):
    """Not a TypeError naming build_attend_request: what the option is, and the choices."""
    x = np.ones((1, 8), np.float32)
    with pytest.raises(InvalidArgumentError, match=r"unknown option 'bogus' for .*causal"):
        send(x, bogus=1)
    with pytest.raises(InvalidArgumentError, match=r"unknown options 'a', 'b'"):
        send(x, b=1, a=2)


@pytest.mark.parametrize("shape", [(2, 1, 8), (0, 1, 8), (8,), (1, 1, 1, 8)])
def test_a_step_of_other_than_one_sequence_is_refused_before_sending(shape):
    """The server refuses it too, which would end a stream's call: the SDK says so first,
    whichever way the request is made (plain, protobuf's, framed)."""
    x = np.ones(shape, np.float32)
    for options in ({}, {"causal": True}):
        with pytest.raises(InvalidArgumentError, match=r"a session step takes one sequence"):
            step_request_bytes("s", x, options)
    big = np.ones((2, 1, FRAME_BYTES // 4), np.float32)  # framed
    with pytest.raises(InvalidArgumentError, match=r"x has shape \(2, 1, 16384\); a session"):
        step_request_bytes("s", big, {})
    assert attend_request_bytes("m", np.ones((2, 1, 8), np.float32))  # an Attend's batch: fine
