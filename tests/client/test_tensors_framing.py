"""The client's framed codec (issue 16): requests serialized with one copy of the array and
replies read as views of the received bytes equal protobuf's, every dtype, and the framing
hands protobuf whatever it cannot vouch for."""

from __future__ import annotations

import numpy as np
import pytest

from mha_client.api import attention_pb2 as pb
from mha_client.messages import build_attend_request, encode_attend_request, parse_attend_response
from mha_client.tensors import array_field, parse_with_tensors, split_fields, to_proto

DTYPES = ["float32", "float16", "bfloat16"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 512), (2, 3, 8)])
def test_framed_request_is_the_protobuf_request(dtype, shape):
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    options = {"input_dtype": dtype, "causal": False, "weights": True, "heads": [0, 1]}
    framed = pb.AttendRequest.FromString(encode_attend_request("mha", x, **options))
    assert framed == build_attend_request("mha", x, **options)
    assert framed.input.data == to_proto(x, dtype).data


def test_framed_request_checks_its_arguments_like_build_attend_request():
    with pytest.raises(ValueError, match="expected \\(seq_len, embed_dim\\)"):
        encode_attend_request("mha", np.ones(4, np.float32))
    with pytest.raises(ValueError, match="pass weights=True"):
        encode_attend_request("mha", np.ones((2, 4), np.float32), heads=[0])


def test_non_contiguous_arrays_are_framed_in_logical_order():
    x = np.arange(12, dtype=np.float32).reshape(3, 4).T  # (4, 3), Fortran order
    field = b"".join(array_field(2, x))
    message = pb.AttendRequest.FromString(field)
    assert np.array_equal(np.frombuffer(message.input.data, np.float32).reshape(4, 3), x)


def _response(dtype: str, weights: bool) -> pb.AttendResponse:
    rng = np.random.default_rng(1)
    r = pb.AttendResponse(model="mha", weight_heads=[2], weight_query_start=1)
    r.output.CopyFrom(to_proto(rng.standard_normal((1, 6, 8)).astype(np.float32), dtype))
    if weights:
        r.attention_weights.CopyFrom(to_proto(rng.random((1, 1, 5, 6)).astype(np.float32), dtype))
    r.timing.total_ms = 2.0
    r.session.session_id = "s"
    return r


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weights", [False, True])
@pytest.mark.parametrize("squeeze", [False, True])
def test_reply_read_from_bytes_is_the_reply_read_from_the_message(dtype, weights, squeeze):
    response = _response(dtype, weights)
    data = response.SerializeToString()
    from_bytes = parse_attend_response(data, squeeze, 1.0)
    from_message = parse_attend_response(pb.AttendResponse.FromString(data), squeeze, 1.0)
    assert np.array_equal(from_bytes.output, from_message.output)
    assert from_bytes.output.dtype == from_message.output.dtype
    if weights:
        assert np.array_equal(from_bytes.weights, from_message.weights)
    else:
        assert from_bytes.weights is None and from_message.weights is None
    assert from_bytes.timing == from_message.timing and from_bytes.session.session_id == "s"
    if dtype != "bfloat16":  # a view of the received bytes: never copied, never writable
        assert not from_bytes.output.flags.writeable


def test_parse_keeps_tensor_bytes_out_of_protobuf_as_views():
    data = _response("float32", True).SerializeToString()
    message, payloads = parse_with_tensors(
        data, pb.AttendResponse, {2: "output", 3: "attention_weights"}
    )
    assert message.output.data == b"" and list(message.output.shape) == [1, 6, 8]
    assert message.HasField("attention_weights") and message.model == "mha"
    assert isinstance(payloads["output"], memoryview) and payloads["output"].obj is data
    assert bytes(payloads["output"]) == pb.AttendResponse.FromString(data).output.data


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"\x12\x05abc", "length past the end"),
        (b"\x10\x01", "the wanted field as a varint"),
        (b"\x12\x00\x12\x00", "the wanted field twice (protobuf merges)"),
        (b"\x02\x00", "field number 0"),
        (b"\x13", "a group"),
        (b"\x08\xff\xff", "truncated varint"),
    ],
)
def test_split_gives_up_on_what_it_cannot_vouch_for(data, why):
    assert split_fields(memoryview(data), (2,)) is None, why


def test_split_skips_every_other_wire_type():
    fields = (
        b"\x08\x96\x01" + b"\x19" + bytes(8) + b"\x25" + bytes(4) + b"\x12\x02hi" + b"\x0a\x01m"
    )
    rest, found = split_fields(memoryview(fields), (2,))
    assert bytes(found[2]) == b"hi"
    assert (
        b"".join(rest) == b"\x08\x96\x01" + b"\x19" + bytes(8) + b"\x25" + bytes(4) + b"\x0a\x01m"
    )
