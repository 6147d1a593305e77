"""The server's framed codec (issue 16): requests parsed with the input's bytes left in place
and replies framed by hand give exactly what protobuf's messages give, every dtype, and a
real server answers framed and unframed requests alike."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch

from mha_client.api import attention_pb2 as pb
from mha_client.messages import build_attend_request, encode_attend_request, parse_attend_response
from mha_client.sdk import Client
from mha_serve.engine import AttendOutcome
from mha_serve.engine.types import array_of, tensor_of
from mha_serve.transport.convert import (
    FRAME_BYTES,
    Frames,
    encode_frames,
    encode_reply,
    encode_result,
    parse_attend_request,
    to_call,
)
from mha_serve.transport.handlers import Malformed, lenient
from tests.helpers import ServerProcess

DTYPES = ["float32", "float16", "bfloat16"]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seq_len", [1, 40])  # below and above FRAME_BYTES
def test_parsed_request_gives_the_call_protobuf_gives(dtype, seq_len):
    x = np.random.default_rng(0).standard_normal((3, seq_len, 512), dtype=np.float32)
    request = build_attend_request(
        "mha", x, input_dtype=dtype, lengths=[seq_len, 1, 1], causal=True, session_id=""
    )
    data = request.SerializeToString()
    parsed = parse_attend_request(data)
    framed = len(data) >= FRAME_BYTES
    assert (parsed.input_data is not None) == framed
    if framed:  # the message lacks only the bytes, which are a view of what was received
        assert parsed.message.input.data == b""
        assert bytes(parsed.input_data) == request.input.data
    call, single = to_call(parsed.message, parsed.input_data)
    reference, _ = to_call(request)
    assert not single and call.lengths == (seq_len, 1, 1) and call.causal is True
    assert call.inputs.dtype == reference.inputs.dtype == dtype
    assert torch.equal(_bits(tensor_of(call.inputs)), _bits(tensor_of(reference.inputs)))


@pytest.mark.parametrize(
    "mangle",
    [
        lambda d: d[:-7],  # truncated inside the tensor bytes
        lambda d: d + b"\x12\x05\x1a\x03abc",  # a second input: protobuf merges, data "abc"
        lambda d: d + b"\x10\x01",  # input (field 2) as a varint: not a message
        lambda d: d + b"\x12\x00",  # a second, empty input: protobuf merges it, a no-op
    ],
)
def test_bytes_the_framing_cannot_vouch_for_get_protobufs_verdict(mangle):
    x = np.ones((64, 512), np.float32)
    data = mangle(build_attend_request("mha", x).SerializeToString())
    parse = lenient(pb.AttendRequest, parse_attend_request)
    try:
        expected = pb.AttendRequest.FromString(data)
    except Exception:
        assert isinstance(parse(data), Malformed)
        return
    got = parse(data)
    assert not isinstance(got, Malformed)
    message = got.message
    if got.input_data is not None:
        message.input.data = bytes(got.input_data)
    assert message == expected


def _result(dtype: torch.dtype, seq_len: int, weights: bool) -> AttendOutcome:
    g = torch.Generator().manual_seed(0)
    w = torch.rand(2, 3, seq_len, seq_len, generator=g).to(dtype) if weights else None
    return AttendOutcome(
        output=array_of(torch.randn(2, seq_len, 512, generator=g).to(dtype)),
        weights=None if w is None else array_of(w),
        weight_heads=(0, 2, 5) if weights else (),
        weight_query_start=1 if weights else 0,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("weights", [False, True])
@pytest.mark.parametrize("single", [False, True])
def test_framed_reply_is_the_message_reply(dtype, weights, single):
    result = _result(dtype, 40, weights)
    tail = pb.AttendResponse(model="mha", timing=pb.Timing(total_ms=1.5, batch_size=2))
    framed = pb.AttendResponse.FromString(
        encode_frames(result, single).join(tail.SerializeToString())
    )
    expected = encode_result(result, single)
    expected.MergeFrom(tail)
    assert framed == expected
    output = tensor_of(result.output[0] if single else result.output)
    assert framed.output.data == _bits(output).numpy().tobytes()


def test_small_replies_stay_messages_and_large_ones_are_framed():
    assert isinstance(encode_reply(_result(torch.float32, 1, False), True), pb.AttendResponse)
    large = encode_reply(_result(torch.float32, 64, False), True)
    assert isinstance(large, Frames) and large.nbytes == 64 * 512 * 4 >= FRAME_BYTES


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = ServerProcess(log_path=tmp_path_factory.mktemp("framing") / "server.log")
    try:
        proc.wait_serving()
        yield proc
    finally:
        proc.stop()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seq_len", [2, 100])
def test_server_answers_framed_and_protobuf_clients_alike(server, dtype, seq_len):
    """The SDK (messages, protobuf both ways) and a client sending and reading bytes framed by
    hand get the same output bit for bit, with attention weights, small and large."""
    x = np.random.default_rng(1).standard_normal((seq_len, 512), dtype=np.float32)
    options = {"input_dtype": dtype, "output_dtype": dtype, "weights": True, "heads": [1, 3]}
    with Client(server.target) as client:
        via_sdk = client.attend("mha", x, **options)
    with grpc.insecure_channel(server.target) as channel:
        reply = channel.unary_unary("/mha.v1.AttentionService/Attend")(
            encode_attend_request("mha", x, **options), timeout=30
        )
    via_bytes = parse_attend_response(reply, True, 0.0)
    assert via_bytes.output.shape == via_sdk.output.shape == (seq_len, 512)
    assert np.array_equal(via_bytes.output, via_sdk.output)
    assert np.array_equal(via_bytes.weights, via_sdk.weights)
    assert via_bytes.weight_heads == via_sdk.weight_heads == [1, 3]
    assert via_bytes.model == "mha" and via_bytes.timing.batch_size >= 1


def test_streamed_session_steps_are_framed_and_exact(server):
    """A session prefilled with a large (framed) step and stepped with small ones gives the
    outputs of one causal Attend over the whole sequence."""
    x = np.random.default_rng(2).standard_normal((70, 512), dtype=np.float32)
    with Client(server.target) as client:
        whole = client.attend("mha", x, causal=True).output
        with client.create_session("mha") as session:
            first = session.step(x[:64]).output  # 128 KiB: parsed and answered framed
            with session.stream() as stream:
                rest = [stream.step(x[t : t + 1]).output for t in range(64, 70)]
    steps = np.concatenate([first, *rest])
    np.testing.assert_allclose(steps, whole, rtol=1e-5, atol=1e-5)


class _Context:
    """What the servicer asks of a grpc.aio context on an Attend that succeeds."""

    def time_remaining(self) -> None:
        return None

    def done(self) -> bool:
        return False

    def peer(self) -> str:
        return "test"

    async def abort(self, code, details=""):
        raise AssertionError(f"aborted {code}: {details}")


async def test_servicer_answers_a_message_in_messages_and_parsed_bytes_in_bytes():
    """Called with a message (the Ray replica) the servicer answers a message; with a request
    as the gRPC handlers parse it, a large reply leaves framed, equal to that message."""
    from mha_serve.config import default_models
    from mha_serve.engine import Engine
    from mha_serve.engine.threads import ComputeThreads
    from mha_serve.serving import AsyncEngine
    from mha_serve.transport.servicer import AttentionServicer

    engine = Engine(
        default_models(), device=torch.device("cpu"), dtype=torch.float32, max_response_bytes=2**28
    )
    compute = ComputeThreads()
    serving = AsyncEngine(engine, compute)
    servicer = AttentionServicer(max_request_bytes=2**26)
    servicer.attach(serving)
    try:
        x = np.random.default_rng(3).standard_normal((64, 512), dtype=np.float32)
        request = build_attend_request("mha", x)
        as_message = await servicer.Attend(request, _Context())
        parsed = parse_attend_request(request.SerializeToString())
        as_bytes = await servicer.Attend(parsed, _Context())
    finally:
        await serving.close()
        compute.shutdown()
    assert isinstance(as_message, pb.AttendResponse) and isinstance(as_bytes, bytes)
    decoded = pb.AttendResponse.FromString(as_bytes)
    assert decoded.output == as_message.output and decoded.model == as_message.model == "mha"
    assert decoded.timing.batch_size == 1 and decoded.timing.total_ms > 0
