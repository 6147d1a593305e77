"""encode_attend_request (the framed request, one copy of x) against build_attend_request
(protobuf's): the same message for any array and options, the same ValueError otherwise."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mha_client.api import attention_pb2 as pb
from mha_client.messages import build_attend_request, encode_attend_request


@settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    shape=st.lists(st.integers(0, 4), min_size=2, max_size=3),
    dtype=st.sampled_from(["<f2", "<f4", "<f8", ">f4", ">f2"]),
    input_dtype=st.sampled_from([None, "float32", "float16", "bfloat16"]),
    transpose=st.booleans(),
    seed=st.integers(0, 99),
    causal=st.none() | st.booleans(),
    lengths=st.none() | st.lists(st.integers(0, 5), max_size=3),
    session_id=st.none() | st.text(max_size=3),
    weights=st.booleans(),
)
def test_framed_request_is_the_built_request(
    shape, dtype, input_dtype, transpose, seed, causal, lengths, session_id, weights
):
    x = (np.random.default_rng(seed).standard_normal(shape) * 1e3).astype(dtype)
    if transpose:  # not C-contiguous
        x = x.swapaxes(-1, -2)
    options = {
        "input_dtype": input_dtype,
        "causal": causal,
        "lengths": lengths,
        "session_id": session_id,
        "weights": weights,
    }
    if weights:
        options |= {"heads": [1, 0], "query_range": (1, None), "weights_dtype": "float16"}
    try:
        built = build_attend_request("m", x, **options)
    except ValueError as e:  # (a session step of a batch other than 1)
        with pytest.raises(ValueError) as framed_error:
            encode_attend_request("m", x, **options)
        assert str(framed_error.value) == str(e)
        return
    framed = pb.AttendRequest.FromString(encode_attend_request("m", x, **options))
    assert framed == built


@pytest.mark.parametrize(
    "x",
    [
        np.float32(1.0),  # was: IndexError from slicing a 0-d array
        np.ones(3, np.float32),  # was: "x has shape (0,)"
        np.ones((2, 2, 2, 2), np.float32),  # was: "x has shape (2, 2, 2, 0)"
        np.ones((2, 3), np.int32),
    ],
)
def test_framed_request_raises_the_built_requests_error(x):
    with pytest.raises(ValueError) as built:
        build_attend_request("m", x)
    with pytest.raises(ValueError) as framed:
        encode_attend_request("m", x)
    assert str(framed.value) == str(built.value)
