"""The hand-written wire code (issue 16) against protobuf itself: every byte string
protobuf parses, the framed parser parses to the same message; every one protobuf rejects,
the framed parser rejects (INVALID_ARGUMENT on the server, never OK with garbage); a framed
reply is the message protobuf would serialize; and the zero-copy input is never written.

Requests are built with protobuf and then re-encoded field by field: reordered, duplicated,
nested messages split across occurrences, unknown fields added, varints padded, bytes
mutated. Derandomized and bounded: the same examples every run, in a few seconds."""

from __future__ import annotations

import time
from unittest import mock

import grpc
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mha_client.api import attention_pb2 as pb
from mha_client.messages import _RESPONSE_TENSORS, build_attend_request, parse_attend_response
from mha_client.tensors import MAX_SCAN_FIELDS, parse_with_tensors, split_fields
from mha_serve.cache import SessionStats
from mha_serve.config import default_models
from mha_serve.engine import AttendOutcome, Engine
from mha_serve.engine.types import array_of, tensor_of
from mha_serve.transport import convert
from mha_serve.transport.convert import encode_frames, encode_result, to_call
from mha_serve.transport.handlers import Malformed, lenient
from tests.helpers import ServerProcess

FUZZ = settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
INT32 = st.integers(-(2**31), 2**31 - 1)
INT64 = st.integers(-(2**63), 2**63 - 1)
UINT64 = st.integers(0, 2**64 - 1)

# ----- a reference wire codec (written for the test, no shortcut shared with the code)


def _varint(n: int, pad: int = 0) -> bytes:
    """n's varint (two's complement for negatives), with `pad` redundant 0x80 bytes."""
    n &= (1 << 64) - 1
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    if pad:
        out += bytes([n | 0x80]) + b"\x80" * (pad - 1)
        n = 0
    out.append(n)
    return bytes(out)


def _fields(data: bytes) -> list[tuple[int, int, bytes]]:
    """(number, wire type, value bytes) of a valid encoding without groups."""
    out, pos = [], 0

    def varint() -> int:
        nonlocal pos
        result = shift = 0
        while True:
            byte = data[pos]
            pos += 1
            result |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                return result

    while pos < len(data):
        key = varint()
        number, wire_type = key >> 3, key & 7
        start = pos
        if wire_type == 0:
            varint()
        elif wire_type == 1:
            pos += 8
        elif wire_type == 5:
            pos += 4
        else:
            size = varint()
            start = pos
            pos += size
        out.append((number, wire_type, data[start:pos]))
    return out


def _encode(fields: list[tuple[int, int, bytes]], pads: list[int] | None = None) -> bytes:
    """fields' encoding; pads: redundant bytes for each tag and length, in turn."""
    pads = list(pads or [])
    out = bytearray()
    for number, wire_type, value in fields:
        out += _varint(number << 3 | wire_type, pads.pop() if pads else 0)
        if wire_type == 2:
            out += _varint(len(value), pads.pop() if pads else 0)
        out += value
    return bytes(out)


# ----- the two parsers


def _protobuf(cls, data: bytes):
    try:
        return cls.FromString(data)
    except Exception:
        return None


def _framed(cls, fields: dict[int, str], data: bytes):
    """parse_with_tensors, its views put back into the message; None when it raises."""
    try:
        message, payloads = parse_with_tensors(data, cls, fields)
    except Exception:
        return None
    for name, payload in payloads.items():
        getattr(message, name).data = bytes(payload)
    return message


def _server(data: bytes):
    """The server's request parser (framing every size), as the gRPC handler runs it."""
    with mock.patch.object(convert, "FRAME_BYTES", 0):
        got = lenient(pb.AttendRequest, convert.parse_attend_request)(data)
    if isinstance(got, Malformed):
        return None
    if got.input_data is not None:
        got.message.input.data = bytes(got.input_data)
    return got.message


def _same(a, b) -> bool:
    """Equal messages (unknown fields too; NaN floats compare by their bits)."""
    if a is None or b is None:
        return a is b
    return a.SerializeToString(deterministic=True) == b.SerializeToString(deterministic=True)


def assert_request_parity(data: bytes) -> None:
    expected = _protobuf(pb.AttendRequest, data)
    got = _server(data)
    assert _same(got, expected), (data, expected, got)


def assert_response_parity(data: bytes) -> None:
    expected = _protobuf(pb.AttendResponse, data)
    got = _framed(pb.AttendResponse, _RESPONSE_TENSORS, data)
    assert _same(got, expected), (data, expected, got)


# ----- random messages, re-encoded


def _tensors():
    return st.builds(
        pb.Tensor,
        dtype=st.integers(0, 3) | INT32,
        shape=st.lists(st.integers(0, 70) | INT64, max_size=4),
        data=st.binary(max_size=48),
    )


@st.composite
def attend_requests(draw) -> pb.AttendRequest:
    request = pb.AttendRequest(
        model=draw(st.text(max_size=6)),
        lengths=draw(st.lists(INT32, max_size=4)),
        head_mask=draw(st.lists(st.floats(width=32), max_size=4)),
        output_dtype=draw(st.integers(0, 3) | INT32),
        session_id=draw(st.text(max_size=6)),
    )
    if draw(st.booleans()):
        request.input.CopyFrom(draw(_tensors()))
    if draw(st.booleans()):
        request.causal = draw(st.booleans())  # presence: False set is not False unset
    if draw(st.booleans()):
        request.weights.CopyFrom(
            pb.WeightsRequest(
                enabled=draw(st.booleans()),
                heads=draw(st.lists(INT32, max_size=4)),
                query_start=draw(INT32),
                query_end=draw(INT32),
                dtype=draw(st.integers(0, 3) | INT32),
            )
        )
    return request


@st.composite
def attend_responses(draw) -> pb.AttendResponse:
    response = pb.AttendResponse(
        model=draw(st.text(max_size=6)),
        weight_heads=draw(st.lists(INT32, max_size=4)),
        weight_query_start=draw(INT32),
    )
    if draw(st.booleans()):
        response.output.CopyFrom(draw(_tensors()))
    if draw(st.booleans()):
        response.attention_weights.CopyFrom(draw(_tensors()))
    if draw(st.booleans()):
        response.timing.total_ms = draw(st.floats())
        response.timing.batch_size = draw(INT32)
    if draw(st.booleans()):
        response.session.session_id = draw(st.text(max_size=6))
        response.session.bytes_held = draw(INT64)
    return response


def _unpacked(value: bytes) -> list[tuple[int, bytes]]:
    """A packed run of varints as separate (wire type 0) values."""
    out, pos = [], 0
    while pos < len(value):
        end = pos
        while value[end] & 0x80:
            end += 1
        out.append((0, value[pos : end + 1]))
        pos = end + 1
    return out


@st.composite
def re_encoded(
    draw,
    message,
    nested: tuple[int, ...],
    packed_varints: dict[int, set[int]],
    packed_fixed32: frozenset[int] = frozenset(),
):
    """message's bytes as another valid encoding protobuf reads as a message, not always the
    same one: nested messages split across occurrences (protobuf merges them) and their
    fields shuffled, packed varints and floats unpacked, fields reordered and duplicated, unknown fields,
    tags and lengths padded (past protobuf's 5 bytes too: then it rejects them)."""
    fields = []
    for number, wire_type, value in _fields(message.SerializeToString()):
        if number in packed_fixed32 and draw(st.booleans()):  # floats one by one
            fields += [(number, 5, value[i : i + 4]) for i in range(0, len(value), 4)]
            continue
        if number in packed_varints.get(0, set()) and draw(st.booleans()):
            fields += [(number, wt, v) for wt, v in _unpacked(value)]
            continue
        if number in nested and draw(st.booleans()):
            sub = _fields(value)
            inner_packed = packed_varints.get(number, set())
            sub = [
                part
                for n, wt, v in sub
                for part in (
                    [(n, t, x) for t, x in _unpacked(v)]
                    if n in inner_packed and draw(st.booleans())
                    else [(n, wt, v)]
                )
            ]
            sub = draw(st.permutations(sub))
            if draw(st.booleans()):
                sub.append((draw(st.integers(9, 2**29 - 1)), 0, _varint(draw(UINT64))))
            cut = draw(st.integers(0, len(sub)))
            pads = draw(st.lists(st.integers(0, 6), max_size=4)) if draw(st.booleans()) else None
            for part in [sub[:cut], sub[cut:]] if draw(st.booleans()) else [sub]:
                fields.append((number, 2, _encode(part, pads)))
            continue
        fields.append((number, wire_type, value))
    if draw(st.booleans()):
        fields = draw(st.permutations(fields))
    for _ in range(draw(st.integers(0, 3))):
        at = draw(st.integers(0, len(fields)))
        kind = draw(st.sampled_from(["dup", "varint", "len", "fixed64", "fixed32"]))
        if kind == "dup" and fields:
            fields.insert(at, draw(st.sampled_from(fields)))
        elif kind == "varint":
            fields.insert(at, (draw(st.integers(9, 2**29 - 1)), 0, _varint(draw(UINT64))))
        elif kind == "len":
            fields.insert(at, (draw(st.integers(9, 2**29 - 1)), 2, draw(st.binary(max_size=8))))
        elif kind == "fixed64":
            fields.insert(
                at, (draw(st.integers(9, 99)), 1, draw(st.binary(min_size=8, max_size=8)))
            )
        elif kind == "fixed32":
            fields.insert(
                at, (draw(st.integers(9, 99)), 5, draw(st.binary(min_size=4, max_size=4)))
            )
    pads = (
        draw(st.lists(st.integers(0, 4) | st.integers(0, 6), max_size=8))
        if draw(st.booleans())
        else None
    )
    return _encode(fields, pads)


@st.composite
def mutated(draw, data: bytes) -> bytes:
    """data with a few bytes changed, inserted or deleted (mostly no longer valid)."""
    b = bytearray(data)
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(b)))
        op = draw(st.sampled_from(["set", "insert", "delete", "pad"]))
        if op == "set" and at < len(b):
            b[at] = draw(st.integers(0, 255))
        elif op == "insert":
            b[at:at] = bytes([draw(st.integers(0, 255))])
        elif op == "delete":
            del b[at : at + draw(st.integers(1, 4))]
        else:  # a redundant continuation byte: a tag or length one byte longer
            b[at:at] = b"\x80"
    return bytes(b)


REQUEST_NESTED = (2, 5)  # input (Tensor), weights (WeightsRequest)
REQUEST_PACKED = {0: {3}, 2: {2}, 5: {2}}  # lengths; Tensor.shape; WeightsRequest.heads
# head_mask (field 6, packed floats) is unpacked too
RESPONSE_NESTED = (2, 3, 6, 7)
RESPONSE_PACKED = {0: {4}, 2: {2}, 3: {2}}


@FUZZ
@given(st.data())
def test_requests_protobuf_reads_are_read_alike(data):
    request = data.draw(attend_requests())
    wire = data.draw(re_encoded(request, REQUEST_NESTED, REQUEST_PACKED, frozenset({6})))
    assert_request_parity(wire)
    assert_request_parity(data.draw(mutated(wire)))


@FUZZ
@given(st.data())
def test_responses_protobuf_reads_are_read_alike(data):
    response = data.draw(attend_responses())
    wire = data.draw(re_encoded(response, RESPONSE_NESTED, RESPONSE_PACKED))
    assert_response_parity(wire)
    assert_response_parity(data.draw(mutated(wire)))


@FUZZ
@given(st.binary(max_size=64))
def test_random_bytes_get_protobufs_verdict(data):
    assert_request_parity(data)
    assert_response_parity(data)


# ----- the cases the fuzz found, named


def _input(data: bytes = bytes(8)) -> bytes:
    return pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[1, 2], data=data).SerializeToString()


@pytest.mark.parametrize(
    "data",
    [
        # input's tag (0x12) in 6 bytes: protobuf reads a tag in at most 5
        b"\x92\x80\x80\x80\x80\x00" + bytes([len(_input())]) + _input(),
        b"\x92" + b"\x80" * 8 + b"\x00" + bytes([len(_input())]) + _input(),
        # input's length in 6 and 10 bytes
        b"\x12" + _varint(len(_input()), pad=5) + _input(),
        b"\x12" + _varint(len(_input()), pad=9) + _input(),
        # an empty input, its length in 6 bytes (found by the fuzz, with other fields after)
        b"\x12\x80\x80\x80\x80\x80\x00\n\x0102\x04\x00\x00\x00\x008\x01B\x010",
        # Tensor.data's tag (0x1a) and length in 6 bytes, inside input
        b"\x12\x15\x08\x01\x12\x02\x01\x02\x9a\x80\x80\x80\x80\x00\x08" + bytes(8),
        b"\x12\x15\x08\x01\x12\x02\x01\x02\x1a\x88\x80\x80\x80\x80\x00" + bytes(8),
    ],
)
def test_tags_and_lengths_protobuf_rejects_are_rejected(data):
    """Was: the framed parser read up to 10 bytes of a tag or length and answered OK with
    the tensor; protobuf rejects the request (INVALID_ARGUMENT)."""
    assert _protobuf(pb.AttendRequest, data) is None
    assert _server(data) is None
    assert _framed(pb.AttendResponse, _RESPONSE_TENSORS, data) is None


@pytest.mark.parametrize("pad", [1, 4])
def test_tags_and_lengths_padded_within_5_bytes_are_read(pad):
    data = _varint(0x12, pad) + _varint(len(_input()), pad) + _input() + b"\x0a\x03mha"
    assert _protobuf(pb.AttendRequest, data) is not None
    assert_request_parity(data)


def test_a_message_of_many_small_fields_is_not_scanned_in_python():
    """Was: every field went through the Python scanner, on the event loop: a 64 MiB request
    of 2-byte fields took 40 s there (protobuf's C: 0.7 s). Past MAX_SCAN_FIELDS, protobuf
    gets the bytes whole, and reads them as before."""
    many = b"\x18\x01" * MAX_SCAN_FIELDS + b"\x12" + bytes([len(_input())]) + _input()
    assert split_fields(memoryview(many), (2,)) is None
    assert_request_parity(many)
    few = b"\x18\x01" * (MAX_SCAN_FIELDS - 2) + b"\x12" + bytes([len(_input())]) + _input()
    assert split_fields(memoryview(few), (2,)) is not None
    assert_request_parity(few)
    hostile = b"\x18\x01" * (4 << 20)  # 8 MiB
    start = time.perf_counter()
    _server(hostile)
    assert time.perf_counter() - start < 2.0  # 1.8 s scanning it before, 30 ms now


# ----- framed replies


def _session() -> SessionStats:
    return SessionStats(
        session_id="s",
        model="mha",
        num_tokens=7,
        num_blocks=1,
        bytes_held=4096,
        max_len=64,
        ttl_s=30.0,
    )


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    batch=st.integers(1, 3),
    seq_len=st.integers(1, 9),
    embed=st.sampled_from([1, 8, 512]),
    heads=st.lists(st.integers(0, 7), min_size=1, max_size=3) | st.none(),
    weights_dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    single=st.booleans(),
    session=st.booleans(),
    timing=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_framed_reply_is_the_serialized_message(
    dtype, batch, seq_len, embed, heads, weights_dtype, single, session, timing, seed
):
    """encode_frames(...).join(tail) as protobuf reads it is encode_result's message with
    the tail's fields: every dtype, shape, weights on and off, session and timing."""
    if single:
        batch = 1
    g = torch.Generator().manual_seed(seed)
    output = torch.randn(batch, seq_len, embed, generator=g).to(dtype)
    weights = None
    if heads is not None:
        weights = torch.rand(batch, len(heads), seq_len, seq_len, generator=g).to(weights_dtype)
    result = AttendOutcome(
        output=array_of(output),
        weights=None if weights is None else array_of(weights),
        weight_heads=tuple(heads or ()),
        weight_query_start=seed % 3 if heads else 0,
        session=_session() if session else None,
    )
    tail = pb.AttendResponse(model="mha")
    if timing:
        tail.timing.CopyFrom(pb.Timing(queue_ms=0.5, compute_ms=1.5, total_ms=2.5, batch_size=3))
    data = encode_frames(result, single).join(tail.SerializeToString())
    expected = encode_result(result, single)
    expected.MergeFrom(tail)
    framed = pb.AttendResponse.FromString(data)
    assert framed == expected
    assert framed.HasField("session") == session and framed.HasField("timing") == timing
    # ... and the client's framed reader of those bytes decodes what the message decodes
    got = parse_attend_response(data, single, 0.0)
    want = parse_attend_response(expected, single, 0.0)
    assert got.output.dtype == want.output.dtype and got.output.shape == want.output.shape
    assert got.output.tobytes() == want.output.tobytes()
    assert (got.weights is None) == (want.weights is None)
    if want.weights is not None:
        assert got.weights.tobytes() == want.weights.tobytes()
    assert (got.session, got.timing, got.weight_heads) == (
        want.session,
        want.timing,
        want.weight_heads,
    )


# ----- the zero-copy input


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(
        default_models(), device=torch.device("cpu"), dtype=torch.float32, max_response_bytes=2**26
    )


def _within(a, buffer: bytes) -> bool:
    """Whether an Array's memory lies inside buffer (a view of it, not a copy)."""
    base = np.frombuffer(buffer, np.uint8).ctypes.data
    start = a.data.ctypes.data
    return base <= start and start + a.nbytes <= base + len(buffer)


@pytest.mark.parametrize("pad", [0, 1, 2, 3])  # the input's bytes need not be aligned
def test_the_received_bytes_are_read_in_place_and_never_written(engine, pad):
    """The input is a view of the bytes gRPC handed over (no copy), at whatever offset the
    framing puts it; the forward pass (which takes a float32 CPU input as it is), padding
    masks and a session step included, leaves those bytes as they were and answers what
    protobuf's copy of the input gives."""
    x = np.random.default_rng(pad).standard_normal((2, 40, 512)).astype(np.float32)
    request = pb.AttendRequest(
        model="mha", lengths=[40, 23], causal=True, weights=pb.WeightsRequest(enabled=True)
    )
    request.input.dtype = pb.DTYPE_FLOAT32
    request.input.shape[:] = x.shape
    request.input.data = x.tobytes()
    # an unknown field of 2 + pad bytes first: the input's offset takes every value mod 4
    data = b"\x4a" + bytes([pad]) + bytes(pad) + request.SerializeToString()
    received = bytes(bytearray(data))  # what gRPC hands the parser: its own bytes object
    parsed = convert.parse_attend_request(received)
    assert parsed.input_data is not None and parsed.input_data.obj is received
    session = engine.create_session("mha")
    step = pb.AttendRequest(model="mha", session_id=session.session_id)
    step.input.CopyFrom(pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[1, 40, 512], data=x[0].tobytes()))
    step_bytes = bytes(bytearray(step.SerializeToString()))
    step_parsed = convert.parse_attend_request(step_bytes)
    try:
        call, _ = to_call(parsed.message, parsed.input_data)
        assert _within(call.inputs, received)  # a view: no copy made
        framed = engine.attend(call)
        reference = engine.attend(to_call(pb.AttendRequest.FromString(data))[0])
        step_call, _ = to_call(step_parsed.message, step_parsed.input_data)
        assert _within(step_call.inputs, step_bytes)
        stepped = engine.attend(step_call)
    finally:
        engine.close_session(session.session_id)
    assert received == data and step_bytes == step.SerializeToString()  # never written
    assert torch.equal(tensor_of(framed.output), tensor_of(reference.output))
    assert torch.equal(tensor_of(framed.weights), tensor_of(reference.weights))
    assert stepped.output.shape == (1, 40, 512)
    del parsed, call  # the view keeps the bytes it reads alive, not gRPC
    assert torch.equal(tensor_of(framed.output), tensor_of(reference.output))


# ----- over a real server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = ServerProcess(log_path=tmp_path_factory.mktemp("wire_fuzz") / "server.log")
    try:
        proc.wait_serving()
        yield proc
    finally:
        proc.stop()


def test_a_server_answers_protobufs_verdict_on_padded_tags(server):
    """A framed-size request (128 KiB) whose input tag takes 5 bytes is answered as the plain
    one; in 6 bytes protobuf rejects it, and so does the server (was: OK, with the output)."""
    x = np.random.default_rng(3).standard_normal((64, 512)).astype(np.float32)
    body = b"".join(
        f
        for n, wt, v in _fields(build_attend_request("mha", x).SerializeToString())
        for f in [_encode([(n, wt, v)], [0, 4 if n == 2 else 0])]
    )
    with grpc.insecure_channel(server.target) as channel:
        attend = channel.unary_unary("/mha.v1.AttentionService/Attend")
        plain = pb.AttendResponse.FromString(
            attend(build_attend_request("mha", x).SerializeToString(), timeout=30)
        )
        padded = pb.AttendResponse.FromString(attend(body, timeout=30))
        assert padded.output == plain.output
        too_long = body.replace(b"\x92\x80\x80\x80\x00", b"\x92\x80\x80\x80\x80\x00", 1)
        assert _protobuf(pb.AttendRequest, too_long) is None
        with pytest.raises(grpc.RpcError) as e:
            attend(too_long, timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
