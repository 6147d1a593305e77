"""Bad input over a real channel, the cases tests/e2e/test_errors.py leaves out: each gets
its status and a message naming what was wrong; sizes that would allocate gigabytes are
refused before allocating (the server's peak memory says so); a session stepped before,
between and after them keeps exactly its tokens; the server keeps serving."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mha_client.api import attention_pb2 as pb
from tests.reliability.conftest import peak_rss_bytes

EMBED = 512
INVALID, NOT_FOUND = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND
EXHAUSTED, OUT_OF_RANGE = grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.OUT_OF_RANGE
GiB = 2**30


def tensor(x: np.ndarray, dtype: int = pb.DTYPE_FLOAT32, shape=None, data=None) -> pb.Tensor:
    return pb.Tensor(
        dtype=dtype,
        shape=list(x.shape if shape is None else shape),
        data=x.tobytes() if data is None else data,
    )


def attend(x: pb.Tensor, model: str = "mha", **fields) -> pb.AttendRequest:
    return pb.AttendRequest(model=model, input=x, **fields)


x26 = np.zeros((2, 6, EMBED), np.float32)
bf16_nan = np.zeros((1, 2, EMBED), np.int16)
bf16_nan[0, 1, 3] = 0x7FC0  # a bfloat16 NaN, as its bits
f16_inf = np.zeros((1, 2, EMBED), np.float16)
f16_inf[0, 0, 0] = np.inf

ATTEND_CASES = {
    "negative dimension": (
        attend(tensor(x26, shape=[-2, 6, EMBED])),
        INVALID,
        "has a negative dimension",
    ),
    "dimensions whose product overflows int64": (
        attend(tensor(x26, shape=[2**62, 2**62, EMBED])),
        INVALID,
        "bytes but shape",
    ),
    "rank 1": (attend(tensor(np.zeros(EMBED, np.float32))), INVALID, "(seq_len, embed_dim)"),
    "rank 0": (attend(tensor(np.zeros((), np.float32), shape=[])), INVALID, "embed_dim"),
    "bytes for a shape of gigabytes": (  # 64 x 4096 x 512 x 4 = 512 MiB claimed, 8 KiB sent
        attend(tensor(np.zeros(2048, np.float32), shape=[64, 4096, EMBED])),
        INVALID,
        "needs 536870912",
    ),
    "odd byte count for float16": (
        attend(tensor(x26, dtype=pb.DTYPE_FLOAT16, data=b"\0" * 3)),
        INVALID,
        "bytes but shape",
    ),
    "bfloat16 NaN": (
        attend(tensor(bf16_nan, dtype=pb.DTYPE_BFLOAT16)),
        INVALID,
        "NaN or Inf",
    ),
    "float16 Inf": (attend(tensor(f16_inf, dtype=pb.DTYPE_FLOAT16)), INVALID, "NaN or Inf"),
    "negative length": (attend(tensor(x26), lengths=[-1, 6]), INVALID, "lengths[0] = -1"),
    "negative head index": (
        attend(tensor(x26), weights=pb.WeightsRequest(enabled=True, heads=[-1])),
        INVALID,
        "head -1 is out of range",
    ),
    "query rows past seq_len": (
        attend(tensor(x26), weights=pb.WeightsRequest(enabled=True, query_end=7)),
        INVALID,
        "within seq_len 6",
    ),
    "NaN in head_mask": (attend(tensor(x26), head_mask=[float("nan")] * 8), INVALID, "NaN"),
    "unknown weights dtype": (
        attend(tensor(x26), weights=pb.WeightsRequest(enabled=True, dtype=9)),
        INVALID,
        "9 is not a supported dtype",
    ),
    "unknown model": (attend(tensor(x26), model="gpt"), NOT_FOUND, "'gpt' is not served"),
    "weights of gigabytes": (  # 8 heads x 4096 x 4096 x 4 bytes = 512 MiB asked, 4 MiB sent
        attend(
            tensor(np.zeros((1, 4096, EMBED), np.float16), dtype=pb.DTYPE_FLOAT16),
            weights=pb.WeightsRequest(enabled=True),
        ),
        EXHAUSTED,
        "attention weights would be 512.0 MiB",
    ),
    "session step with lengths": (
        None,  # filled in with a live session id by the test
        INVALID,
        "lengths",
    ),
}


def assert_status(call, request, code, fragment):
    with pytest.raises(grpc.RpcError) as err:
        call(request, timeout=60)
    assert err.value.code() == code, err.value.details()
    assert fragment in err.value.details(), err.value.details()


@pytest.fixture(scope="module")
def bystander(stub):
    """A session of another client, stepped before and checked after the bad inputs."""
    sid = stub.CreateSession(pb.CreateSessionRequest(model="gqa"), timeout=10).session_id
    x = np.random.default_rng(3).standard_normal((1, 5, EMBED), dtype=np.float32)
    first = stub.Attend(pb.AttendRequest(session_id=sid, input=tensor(x)), timeout=30)
    yield sid, x, first
    info = stub.GetSession(pb.GetSessionRequest(session_id=sid), timeout=10)
    assert info.num_tokens == 5  # every bad input left it as it was
    stub.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=10)


@pytest.mark.parametrize("name", list(ATTEND_CASES))
def test_bad_attend_gets_its_status_and_nothing_else_changes(server, stub, bystander, name):
    request, code, fragment = ATTEND_CASES[name]
    if request is None:
        request = pb.AttendRequest(
            session_id=bystander[0], input=tensor(np.zeros((1, 2, EMBED), np.float32)), lengths=[1]
        )
    peak = peak_rss_bytes(server.proc.pid)
    assert_status(stub.Attend, request, code, fragment)
    # Refused before allocating: the server's peak memory did not grow by the claimed size.
    assert peak_rss_bytes(server.proc.pid) - peak < 256 * 2**20
    good = stub.Attend(attend(tensor(np.ones((1, 3, EMBED), np.float32))), timeout=30)
    assert list(good.output.shape) == [1, 3, EMBED]


def test_session_calls_with_bad_arguments(stub, bystander):
    sid = bystander[0]
    cases = [
        (stub.CreateSession, pb.CreateSessionRequest(model="gpt"), NOT_FOUND, "'gpt'"),
        (stub.CreateSession, pb.CreateSessionRequest(model=""), INVALID, "model is empty"),
        (stub.CreateSession, pb.CreateSessionRequest(model="mha", max_len=-3), INVALID, "max_len"),
        (
            stub.CreateSession,
            pb.CreateSessionRequest(model="mha", max_len=10**9),
            INVALID,
            "past the max_seq_len 4096 of model 'mha'",
        ),
        (stub.CreateSession, pb.CreateSessionRequest(model="mha", ttl_s=-1), INVALID, "ttl"),
        (
            stub.CreateSession,
            pb.CreateSessionRequest(model="mha", ttl_s=float("nan")),
            INVALID,
            "ttl",
        ),
        (stub.GetSession, pb.GetSessionRequest(session_id="nope"), NOT_FOUND, "'nope'"),
        (stub.GetSession, pb.GetSessionRequest(session_id=""), INVALID, "session_id is empty"),
        (stub.ForkSession, pb.ForkSessionRequest(session_id="nope"), NOT_FOUND, "'nope'"),
        (stub.CloseSession, pb.CloseSessionRequest(session_id="nope"), NOT_FOUND, "'nope'"),
        (
            stub.TruncateSession,
            pb.TruncateSessionRequest(session_id=sid, num_tokens=6),
            INVALID,
            "holds 5 tokens",
        ),
        (
            stub.TruncateSession,
            pb.TruncateSessionRequest(session_id=sid, num_tokens=2**64 - 1),
            INVALID,
            "holds 5 tokens",
        ),
        (
            stub.Attend,
            pb.AttendRequest(
                session_id=sid,
                input=tensor(np.zeros((1, 4096, EMBED), np.float16), pb.DTYPE_FLOAT16),
            ),
            OUT_OF_RANGE,
            "max_len",
        ),
        (
            stub.Attend,
            pb.AttendRequest(
                session_id=sid, model="mqa", input=tensor(np.zeros((1, 2, EMBED), np.float32))
            ),
            INVALID,
            "mqa",
        ),
    ]
    for call, request, code, fragment in cases:
        assert_status(call, request, code, fragment)


def test_the_server_still_serves_and_the_bystander_answers_as_before(channel, stub, bystander):
    health = health_pb2_grpc.HealthStub(channel)
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == (
        health_pb2.HealthCheckResponse.SERVING
    )
    # The bystander's cache is intact: a fork of it, truncated to 0 and re-fed the same five
    # tokens, answers its first step exactly (same keys, same outputs).
    sid, x, first = bystander
    fork = stub.ForkSession(pb.ForkSessionRequest(session_id=sid), timeout=10).session_id
    stub.TruncateSession(pb.TruncateSessionRequest(session_id=fork, num_tokens=0), timeout=10)
    again = stub.Attend(pb.AttendRequest(session_id=fork, input=tensor(x)), timeout=30)
    assert again.output.data == first.output.data
    stub.CloseSession(pb.CloseSessionRequest(session_id=fork), timeout=10)
