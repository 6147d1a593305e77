"""Each SDK call written once: the RPC it makes and how its reply is read. The blocking and
the asyncio clients (and their sessions) only send it (`Client._run`, `AsyncClient._run`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import grpc
import numpy as np

from mha_client.api import attention_pb2 as pb
from mha_client.errors import MhaServeError
from mha_client.messages import (
    AttendResult,
    ModelInfo,
    SessionInfo,
    attend_request_bytes,
    check_keep,
    check_options,
    read_attend_reply,
    step_request_bytes,
)

T = TypeVar("T")
ERROR = object()  # Rpc.on_tolerated: answer the tolerated error itself instead of raising it


@dataclass
class Rpc(Generic[T]):
    """One unary call: `method` of the AttentionService stub (of the Health stub when
    `health`, of the BytesStub when `raw`: request and reply serialized), its request, and
    `read(reply, round_trip_ms)` for the result. A status in `tolerate` answers
    `on_tolerated` instead of raising (a close of a session already gone)."""

    method: str
    request: Any
    read: Callable[[Any, float], T]
    health: bool = False
    raw: bool = False
    kw: dict[str, Any] = field(default_factory=dict)
    tolerate: tuple[grpc.StatusCode, ...] = ()
    on_tolerated: Any = None
    started: float = field(default_factory=time.perf_counter)

    def done(self, reply: Any) -> T:
        return self.read(reply, (time.perf_counter() - self.started) * 1e3)

    def failed(self, err: MhaServeError) -> T:
        if err.code in self.tolerate:
            return err if self.on_tolerated is ERROR else self.on_tolerated
        raise err


def list_models() -> Rpc[list[ModelInfo]]:
    return Rpc(
        "ListModels",
        pb.ListModelsRequest(),
        lambda r, _: [ModelInfo.from_proto(m) for m in r.models],
    )


def model_info(name: str) -> Rpc[ModelInfo]:
    return Rpc("GetModelInfo", pb.GetModelInfoRequest(name=name), _read(ModelInfo))


class BytesStub:
    """Attend and StreamSession without (de)serializers: they send the bytes they are given
    and answer the bytes received, which the SDK encodes and decodes itself, a large tensor
    framed (messages.FRAME_BYTES: one payload copy to send, none to read, besides gRPC's)."""

    def __init__(self, channel: Any) -> None:
        service = pb.DESCRIPTOR.services_by_name["AttentionService"].full_name
        self.Attend = channel.unary_unary(f"/{service}/Attend", _registered_method=True)
        self.StreamSession = channel.stream_stream(
            f"/{service}/StreamSession", _registered_method=True
        )


def attend(model: str, x: np.ndarray, options: dict[str, Any]) -> Rpc[AttendResult]:
    if options:
        check_options(options, "attend")
    request = attend_request_bytes(model, x, **options)
    squeeze = np.ndim(x) == 2
    return Rpc("Attend", request, lambda r, ms: read_attend_reply(r, squeeze, ms), raw=True)


def create_session(model: str, max_len: int | None, ttl_s: float | None) -> Rpc[SessionInfo]:
    req = pb.CreateSessionRequest(model=model, max_len=max_len or 0, ttl_s=ttl_s or 0.0)
    return Rpc("CreateSession", req, _read(SessionInfo))


def step(session: Any, x: np.ndarray, options: dict[str, Any]) -> Rpc[AttendResult]:
    """A session step; the reply's session state becomes session.info."""
    request = step_request_bytes(session.id, x, options)
    return Rpc("Attend", request, step_reader(session, x), raw=True)


def step_reader(session: Any, x: np.ndarray) -> Callable[[bytes, float], AttendResult]:
    """Reads a step's reply (as bytes) into its result and session.info."""
    squeeze = np.ndim(x) == 2
    return lambda reply, round_trip_ms: read_step(session, reply, squeeze, round_trip_ms)


def read_step(session: Any, reply: bytes, squeeze: bool, round_trip_ms: float) -> AttendResult:
    """A step's reply (unary or streamed, as bytes) read into its result and session.info;
    squeeze: the step's input was 2-D."""
    result = read_attend_reply(reply, squeeze, round_trip_ms)
    session.info = result.session or session.info
    return result


def refresh(session: Any) -> Rpc[SessionInfo]:
    return Rpc("GetSession", pb.GetSessionRequest(session_id=session.id), _into(session))


def fork(session_id: str, ttl_s: float | None) -> Rpc[SessionInfo]:
    req = pb.ForkSessionRequest(session_id=session_id, ttl_s=ttl_s or 0.0)
    return Rpc("ForkSession", req, _read(SessionInfo))


def truncate(session: Any, num_tokens: int) -> Rpc[SessionInfo]:
    check_keep(num_tokens)
    req = pb.TruncateSessionRequest(session_id=session.id, num_tokens=num_tokens)
    return Rpc("TruncateSession", req, _into(session))


def close(session_id: str) -> Rpc[None]:
    """Closing a session that is already gone is a no-op (NOT_FOUND tolerated)."""
    req = pb.CloseSessionRequest(session_id=session_id)
    return Rpc("CloseSession", req, lambda r, _: None, tolerate=(grpc.StatusCode.NOT_FOUND,))


def health(service: str, wait_for_ready: bool) -> Rpc[str]:
    """The grpc.health.v1 status name of service ("" is the whole server), e.g. "SERVING"."""
    health_pb2 = health_stubs()[0]
    return Rpc(
        "Check",
        health_pb2.HealthCheckRequest(service=service),
        lambda r, _: health_pb2.HealthCheckResponse.ServingStatus.Name(r.status),
        health=True,
        kw={"wait_for_ready": wait_for_ready},
    )


def health_stubs() -> tuple[Any, Any]:
    try:
        from grpc_health.v1 import health_pb2, health_pb2_grpc
    except ImportError:
        raise ImportError(
            "health checks need the grpcio-health-checking package: "
            "pip install grpcio-health-checking"
        ) from None
    return health_pb2, health_pb2_grpc


def _read(cls: Any) -> Callable[[Any, float], Any]:
    return lambda reply, _: cls.from_proto(reply)


def _into(session: Any) -> Callable[[Any, float], SessionInfo]:
    """Reads a SessionInfo reply into session.info, and returns it."""

    def read(reply: pb.SessionInfo, _: float) -> SessionInfo:
        session.info = SessionInfo.from_proto(reply)
        return session.info

    return read
