"""Property-based fuzz of mha.v1 requests over a real channel (hypothesis): random field
values, tensors whose shape, dtype, bytes and values disagree, random session ids, and
random bytes for every method. Only defined statuses come back (never INTERNAL or UNKNOWN),
and health stays SERVING. Derandomized and bounded: the same examples every CI run."""

from __future__ import annotations

import math

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mha_client.api import attention_pb2 as pb

pytestmark = pytest.mark.slow

DEFINED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.OUT_OF_RANGE,
}
FUZZ = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
INT32 = st.integers(-(2**31), 2**31 - 1)
INT64 = st.integers(-(2**63), 2**63 - 1)
DTYPES = st.one_of(st.sampled_from([0, 1, 2, 3]), INT32)
SERVICE = pb.DESCRIPTOR.services_by_name["AttentionService"]
# Sessions made by the fuzz (CreateSession, ForkSession) are closed after each example.
LIVE = "live"


@st.composite
def tensors(draw) -> pb.Tensor:
    dtype = draw(DTYPES)
    if draw(st.booleans()):  # the shape a hosted model takes, so that some get through
        shape = [draw(st.integers(1, 3)), draw(st.integers(1, 6)), 512]
    else:
        dims = st.one_of(st.integers(0, 6), st.sampled_from([64, 512]), INT64)
        shape = draw(st.lists(dims, max_size=4))
    itemsize = {1: 4, 2: 2, 3: 2}.get(dtype, 4)
    count = math.prod(shape) if all(d >= 0 for d in shape) else -1
    if 0 <= count <= 6 * 6 * 512 and draw(st.booleans()):  # bytes that match the shape
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        scale = draw(st.sampled_from([1.0, 1e4, 1e20, 3e38]))
        with np.errstate(over="ignore"):  # inf is one of the values meant to be sent
            x = (rng.standard_normal(count) * scale).astype(np.float32)
        if count and draw(st.booleans()):
            x[draw(st.integers(0, count - 1))] = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
        with np.errstate(over="ignore"):
            x = x.astype({2: np.float16}.get(dtype, np.float32))
        data = x.tobytes()[: count * itemsize]
    else:
        data = draw(st.binary(max_size=2048))
    return pb.Tensor(dtype=dtype, shape=shape, data=data)


@st.composite
def attend_requests(draw) -> pb.AttendRequest:
    request = pb.AttendRequest(
        model=draw(
            st.one_of(st.sampled_from(["mha", "gqa", "mqa", "", "nope"]), st.text(max_size=12))
        ),
        lengths=draw(st.just([]) | st.lists(INT32 | st.integers(0, 7), max_size=4)),
        head_mask=draw(
            st.just([]) | st.lists(st.floats(width=32) | st.sampled_from([0.0, 1.0]), max_size=9)
        ),
        output_dtype=draw(st.sampled_from([0, 1, 2, 3]) | DTYPES),
        session_id=draw(st.sampled_from(["", "", "", LIVE, "nope"]) | st.text(max_size=8)),
    )
    if draw(st.integers(0, 4)):
        request.input.CopyFrom(draw(tensors()))
    causal = draw(st.none() | st.booleans())
    if causal is not None:
        request.causal = causal
    if draw(st.booleans()):
        request.weights.CopyFrom(
            pb.WeightsRequest(
                enabled=draw(st.booleans()),
                heads=draw(st.lists(INT32 | st.integers(0, 8), max_size=4)),
                query_start=draw(INT32 | st.integers(0, 6)),
                query_end=draw(INT32 | st.integers(0, 6)),
                dtype=draw(DTYPES),
            )
        )
    return request


@st.composite
def one_field_off(draw) -> pb.AttendRequest:
    """A valid request with at most one field drawn at random: most answer OK, the rest
    probe one check at a time."""
    batch, seq_len = draw(st.integers(1, 3)), draw(st.integers(1, 6))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    x = rng.standard_normal((batch, seq_len, 512)).astype(np.float32)
    request = pb.AttendRequest(
        model=draw(st.sampled_from(["mha", "gqa", "mqa"])),
        input=pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=x.shape, data=x.tobytes()),
    )
    field = draw(st.sampled_from(["none", "lengths", "head_mask", "weights", "dtype", "model"]))
    if field == "lengths":
        request.lengths.extend(draw(st.lists(st.integers(0, 7) | INT32, max_size=4)))
    elif field == "head_mask":
        request.head_mask.extend(draw(st.lists(st.floats(width=32), min_size=8, max_size=8)))
    elif field == "weights":
        request.weights.CopyFrom(
            pb.WeightsRequest(
                enabled=True,
                heads=draw(st.lists(st.integers(-1, 8), max_size=3)),
                query_start=draw(st.integers(-1, 6)),
                query_end=draw(st.integers(-1, 7)),
                dtype=draw(st.sampled_from([0, 1, 2, 3, 4])),
            )
        )
    elif field == "dtype":
        request.output_dtype = draw(st.sampled_from([0, 1, 2, 3, 4]))
    elif field == "model":
        request.model = draw(st.text(max_size=6))
    return request


def code_of(call, request) -> grpc.StatusCode:
    try:
        reply = call(request, timeout=60)
    except grpc.RpcError as e:
        assert e.code() in DEFINED, f"{e.code()}: {e.details()}\nfor {request!r:.2000}"
        return e.code()
    return grpc.StatusCode.OK if reply is not None else grpc.StatusCode.UNKNOWN


@pytest.fixture(scope="module")
def live(stub):
    sid = stub.CreateSession(pb.CreateSessionRequest(model="mqa"), timeout=10).session_id
    yield sid
    stub.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=10)


@pytest.fixture(scope="module")
def seen():
    codes: dict[str, set[grpc.StatusCode]] = {}
    yield codes
    print("statuses seen by the fuzz:", {k: sorted(c.name for c in v) for k, v in codes.items()})


@FUZZ
@given(request=st.one_of(attend_requests(), one_field_off()))
def test_attend_answers_only_defined_statuses(stub, live, seen, request):
    if request.session_id == LIVE:
        request.session_id = live
    seen.setdefault("Attend", set()).add(code_of(stub.Attend, request))


@FUZZ
@given(
    method=st.sampled_from(["CreateSession", "GetSession", "ForkSession", "TruncateSession"]),
    model=st.sampled_from(["mha", "mqa", "", "nope"]) | st.text(max_size=8),
    session_id=st.sampled_from([LIVE, "", "nope"]) | st.text(max_size=8),
    max_len=INT32,
    ttl_s=st.floats() | st.sampled_from([0.0, 1.0, 1e9]),
    num_tokens=st.integers(0, 2**64 - 1) | st.integers(0, 8),
)
def test_session_calls_answer_only_defined_statuses(
    stub, live, seen, method, model, session_id, max_len, ttl_s, num_tokens
):
    sid = live if session_id == LIVE else session_id
    request = {
        "CreateSession": pb.CreateSessionRequest(model=model, max_len=max_len, ttl_s=ttl_s),
        "GetSession": pb.GetSessionRequest(session_id=sid),
        "ForkSession": pb.ForkSessionRequest(session_id=sid, ttl_s=ttl_s),
        # never shortens the live session below its tokens: a truncation past them is refused
        "TruncateSession": pb.TruncateSessionRequest(session_id=sid, num_tokens=num_tokens),
    }[method]
    call = getattr(stub, method)
    try:
        reply = call(request, timeout=30)
        code = grpc.StatusCode.OK
        if method in ("CreateSession", "ForkSession"):
            stub.CloseSession(pb.CloseSessionRequest(session_id=reply.session_id), timeout=10)
    except grpc.RpcError as e:
        assert e.code() in DEFINED, f"{method}: {e.code()}: {e.details()}"
        code = e.code()
    seen.setdefault(method, set()).add(code)


@FUZZ
@given(method=st.sampled_from(list(SERVICE.methods)), data=st.binary(max_size=512))
def test_random_bytes_to_every_method(channel, seen, method, data):
    path = f"/{SERVICE.full_name}/{method.name}"
    if method.client_streaming:
        call = channel.stream_stream(path)
        replies = call(iter([data]), timeout=30)
        try:
            for _ in replies:
                pass
            code = grpc.StatusCode.OK
        except grpc.RpcError as e:
            code = e.code()
    else:
        try:
            channel.unary_unary(path)(data, timeout=30)
            code = grpc.StatusCode.OK
        except grpc.RpcError as e:
            code = e.code()
    assert code in DEFINED, f"{method.name}: {code}"
    seen.setdefault("bytes:" + method.name, set()).add(code)


def test_health_is_serving_after_the_fuzz(channel, stub, server):
    health = health_pb2_grpc.HealthStub(channel)
    reply = health.Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    assert "Traceback" not in server.log()
