"""Bytes that are no valid message: INVALID_ARGUMENT naming the message type, for every method,
and a log that does not grow with them."""

from __future__ import annotations

import random

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mha_client.api import attention_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["AttentionService"]
UNARY = [m for m in SERVICE.methods if not m.client_streaming]


def garbage(rng: random.Random, message_cls) -> bytes:
    """Random bytes that do not parse as message_cls (checked here, with the same parser)."""
    while True:
        data = rng.randbytes(rng.randint(1, 64))
        try:
            message_cls.FromString(data)
        except Exception:
            return data


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(server.target) as channel:
        yield channel


def raw(channel, method, kind="unary_unary"):
    """The method as bytes in, bytes out: what a hostile client can send."""
    return getattr(channel, kind)(f"/{SERVICE.full_name}/{method.name}")


def test_every_unary_method_answers_invalid_argument_and_the_log_stays_small(server, channel):
    rng = random.Random(0)
    before = len(server.log())
    sent = 0
    for _ in range(25):
        for method in UNARY:
            request_cls = getattr(pb, method.input_type.name)
            with pytest.raises(grpc.RpcError) as err:
                raw(channel, method)(garbage(rng, request_cls), timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
            expected = f"request is not a valid {method.input_type.full_name} message"
            assert expected in err.value.details()
            sent += 1
    assert sent == 25 * len(UNARY) == 225  # 9 unary methods (AnalyzeHeads the 9th)
    grown = server.log()[before:]
    # One summary line at most (the first malformed request may already have been logged
    # by an earlier test of this server: then none), never a traceback per request.
    assert grown.count("\n") <= 1 and "Traceback" not in grown, grown
    health = health_pb2_grpc.HealthStub(channel)
    reply = health.Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_a_malformed_stream_message_ends_the_stream_with_invalid_argument(stub, channel):
    session = stub.CreateSession(pb.CreateSessionRequest(model="mqa"), timeout=10)
    x = np.ones((1, 512), np.float32)
    good = pb.AttendRequest(
        session_id=session.session_id,
        input=pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[1, 512], data=x.tobytes()),
    ).SerializeToString()
    bad = garbage(random.Random(1), pb.AttendRequest)
    stream = raw(channel, SERVICE.methods_by_name["StreamSession"], "stream_stream")
    replies = stream(iter([good, bad, good]), timeout=30)
    first = pb.AttendResponse.FromString(next(replies))
    assert first.session.num_tokens == 1
    with pytest.raises(grpc.RpcError) as err:
        next(replies)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "request is not a valid mha.v1.AttendRequest message" in err.value.details()
    # The session kept its good step and nothing else; the server goes on.
    info = stub.GetSession(pb.GetSessionRequest(session_id=session.session_id), timeout=10)
    assert info.num_tokens == 1
    stub.CloseSession(pb.CloseSessionRequest(session_id=session.session_id), timeout=10)
