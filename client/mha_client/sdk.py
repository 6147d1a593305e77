"""Python SDK for mha-serve: `Client` (blocking) and `AsyncClient` (asyncio) with the same methods.

Both speak mha.v1 over gRPC and turn every failed call into `MhaServeError`: what the server
refused, and what the client refused before sending (`InvalidArgumentError` for arguments,
`ClosedError` for a call after close()). Each call is written once in `mha_client.ops` (its
request and how its reply is read); the two clients only send it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, Unpack

import grpc
import numpy as np

from mha_client import ops
from mha_client.api import attention_pb2_grpc as pb_grpc
from mha_client.channel import ChannelSecurity, open_channel
from mha_client.errors import ClosedError, MhaServeError, ReplyError
from mha_client.messages import (  # re-exported: the SDK's public values
    AttendOptions,
    AttendResult,
    KVCacheInfo,
    ModelInfo,
    SessionInfo,
    Timing,
    build_attend_request,
    parse_attend_response,
)
from mha_client.sessions import AsyncSession, Session

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DEFAULT_TARGET",
    "AsyncClient",
    "AttendOptions",
    "AttendResult",
    "Client",
    "KVCacheInfo",
    "ModelInfo",
    "SessionInfo",
    "Timing",
    "build_attend_request",
    "channel_options",
    "parse_attend_response",
]

T = TypeVar("T")
DEFAULT_TARGET = "127.0.0.1:50051"
DEFAULT_MAX_MESSAGE_BYTES = 256 * 2**20
# wait_ready sleeps this long between health answers that are not yet SERVING.
WAIT_READY_POLL_S = 0.1


def channel_options(
    max_message_bytes: int, options: Sequence[tuple[str, Any]] | None
) -> list[tuple[str, Any]]:
    """Channel arguments: message limits, quick reconnects, then the caller's overrides."""
    merged: dict[str, Any] = {
        "grpc.max_send_message_length": max_message_bytes,
        "grpc.max_receive_message_length": max_message_bytes,
        # gRPC's default reconnect backoff grows to 120 s, so a client started before its
        # server would notice the server minutes late; attention servers restart often.
        "grpc.initial_reconnect_backoff_ms": 200,
        "grpc.max_reconnect_backoff_ms": 2000,
    }
    merged.update(dict(options or ()))
    return list(merged.items())


class _ReadyWait:
    """wait_ready's loop, for both clients: health until SERVING, within the timeout."""

    def __init__(self, target: str, timeout: float) -> None:
        self.target, self.timeout = target, timeout
        self.deadline = time.monotonic() + timeout
        self.last = "no answer"

    def remaining(self) -> float:
        """Seconds left for the next health call; TimeoutError when there are none."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(
                f"mha-serve at {self.target} was not SERVING within {self.timeout:g} s (last "
                f"answer: {self.last}); check that the server is running there and read its log"
            )
        return left

    def serving(self, answer: str | MhaServeError) -> bool:
        """Whether the answer is SERVING; an error other than "still starting" is raised."""
        starting = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        if isinstance(answer, MhaServeError) and answer.code not in starting:
            raise answer
        self.last = str(answer)
        return answer == "SERVING"

    def pause(self) -> float:
        return min(WAIT_READY_POLL_S, max(0.0, self.deadline - time.monotonic()))


def _read(rpc: ops.Rpc[T], reply: Any, target: str) -> T:
    """The call's result from its reply; a reply it cannot read is a ReplyError from target."""
    try:
        return rpc.done(reply)
    except ReplyError as e:
        e.target = target
        raise


def _ready_check(service: str) -> ops.Rpc:
    """Health with wait_for_ready; a still-starting server's error is an answer, not raised."""
    rpc = ops.health(service, wait_for_ready=True)
    rpc.tolerate = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    rpc.on_tolerated = ops.ERROR
    return rpc


class _Channel:
    """What both clients hold: the target, the default deadline, the channel and its stubs."""

    _AIO = False  # a grpc.aio channel (AsyncClient) or a blocking one (Client)

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        timeout: float | None = 60.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        options: Sequence[tuple[str, Any]] | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        security: ChannelSecurity | None = None,
        metadata: Sequence[tuple[str, str]] = (),
        propagate_trace: bool = False,
    ) -> None:
        """propagate_trace: every call carries the caller's current OpenTelemetry trace
        context (W3C traceparent, by opentelemetry-api's propagator), so that a server
        tracing its calls (--tracing-endpoint) records each as a child of the caller's span;
        needs opentelemetry-api."""
        self.target = target
        self.timeout = timeout  # default deadline in seconds per call; None waits forever
        self.security = security  # as given (None: plaintext, or explicit credentials)
        # Sent with every call, e.g. (("application", "mha"),): the Ray Serve app to reach
        # when a Ray cluster's gRPC proxy serves several (docs/ray.md).
        self.metadata = tuple(metadata) or None
        self._inject: Callable[[dict[str, str]], None] | None = None
        if propagate_trace:
            try:
                from opentelemetry.propagate import inject
            except ImportError:
                raise ImportError(
                    "propagate_trace needs OpenTelemetry's API: pip install opentelemetry-api"
                ) from None
            self._inject = inject
        opts = channel_options(max_message_bytes, options)
        self._channel = open_channel(
            target, opts, aio=self._AIO, credentials=credentials, security=security
        )
        self._stub = pb_grpc.AttentionServiceStub(self._channel)
        self._bytes_stub = ops.BytesStub(self._channel)  # Attend, StreamSession: framed codec
        self._health_stub: Any = None  # made at the first health call (its package may lack)
        self._closed = False

    def _check_open(self) -> None:
        """ClosedError for a call after close(): gRPC's own error there (a ValueError from a
        blocking channel, a UsageError from an aio one) names neither the client nor the fix."""
        if self._closed:
            raise ClosedError(
                f"this {type(self).__name__} is closed (close() was called or its `with` block "
                f"ended); create a new one to call {self.target}",
                self.target,
            )

    def _method(self, rpc: ops.Rpc, timeout: float | None) -> tuple[Any, dict[str, Any]]:
        self._check_open()
        if rpc.health and self._health_stub is None:
            self._health_stub = ops.health_stubs()[1].HealthStub(self._channel)
        stub = self._health_stub if rpc.health else self._bytes_stub if rpc.raw else self._stub
        deadline = self.timeout if timeout is None else timeout
        kw = {"timeout": deadline, **rpc.kw}
        metadata = self.call_metadata()
        if metadata:
            kw["metadata"] = metadata
        return getattr(stub, rpc.method), kw

    def call_metadata(self) -> tuple[tuple[str, str], ...] | None:
        """What a call (or a stream, when it opens) sends as metadata: `metadata`, and with
        propagate_trace the trace context current in the caller."""
        if self._inject is None:
            return self.metadata
        carrier: dict[str, str] = {}
        self._inject(carrier)
        return (*(self.metadata or ()), *carrier.items()) or None


class Client(_Channel):
    """Blocking client. `with Client("host:port") as c: c.attend("model", x)`."""

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._closed = True
        self._channel.close()

    def _run(self, rpc: ops.Rpc[T], timeout: float | None = None) -> T:
        method, kw = self._method(rpc, timeout)
        try:
            reply = method(rpc.request, **kw)
        except grpc.RpcError as err:
            return rpc.failed(MhaServeError.from_rpc_error(err, self.target))
        return _read(rpc, reply, self.target)

    def list_models(self, *, timeout: float | None = None) -> list[ModelInfo]:
        return self._run(ops.list_models(), timeout)

    def model_info(self, name: str, *, timeout: float | None = None) -> ModelInfo:
        return self._run(ops.model_info(name), timeout)

    def attend(
        self,
        model: str,
        x: np.ndarray,
        *,
        timeout: float | None = None,
        **options: Unpack[AttendOptions],
    ) -> AttendResult:
        """Run attention over x (L, E) or (B, L, E); options as in build_attend_request."""
        return self._run(ops.attend(model, x, options), timeout)

    def create_session(
        self,
        model: str,
        *,
        max_len: int | None = None,
        ttl_s: float | None = None,
        timeout: float | None = None,
    ) -> Session:
        """A new KV-cache session on model (max_len None: the model's; ttl_s None: the server's)."""
        return Session(self, self._run(ops.create_session(model, max_len, ttl_s), timeout))

    def session(self, session_id: str) -> Session:
        """A handle on an existing session (nothing is sent until it is used)."""
        return Session(self, SessionInfo(session_id, "", 0, 0, 0.0, 0, 0))

    def health(
        self, service: str = "", *, timeout: float | None = None, wait_for_ready: bool = False
    ) -> str:
        """The grpc.health.v1 status name of service ("" is the whole server), e.g. "SERVING"."""
        return self._run(ops.health(service, wait_for_ready), timeout)

    def wait_ready(self, timeout: float, service: str = "") -> None:
        """Block until health says SERVING; TimeoutError after timeout seconds."""
        wait = _ReadyWait(self.target, timeout)
        while not wait.serving(self._run(_ready_check(service), wait.remaining())):
            time.sleep(wait.pause())


class AsyncClient(_Channel):
    """asyncio client. `async with AsyncClient("host:port") as c: await c.attend("model", x)`."""

    _AIO = True

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        self._closed = True
        await self._channel.close()

    async def _run(self, rpc: ops.Rpc[T], timeout: float | None = None) -> T:
        method, kw = self._method(rpc, timeout)
        try:
            reply = await method(rpc.request, **kw)
        except grpc.RpcError as err:
            return rpc.failed(MhaServeError.from_rpc_error(err, self.target))
        return _read(rpc, reply, self.target)

    async def list_models(self, *, timeout: float | None = None) -> list[ModelInfo]:
        return await self._run(ops.list_models(), timeout)

    async def model_info(self, name: str, *, timeout: float | None = None) -> ModelInfo:
        return await self._run(ops.model_info(name), timeout)

    async def attend(
        self,
        model: str,
        x: np.ndarray,
        *,
        timeout: float | None = None,
        **options: Unpack[AttendOptions],
    ) -> AttendResult:
        """Run attention over x (L, E) or (B, L, E); options as in build_attend_request."""
        return await self._run(ops.attend(model, x, options), timeout)

    async def create_session(
        self,
        model: str,
        *,
        max_len: int | None = None,
        ttl_s: float | None = None,
        timeout: float | None = None,
    ) -> AsyncSession:
        """A new KV-cache session on model (max_len None: the model's; ttl_s None: the server's)."""
        info = await self._run(ops.create_session(model, max_len, ttl_s), timeout)
        return AsyncSession(self, info)

    def session(self, session_id: str) -> AsyncSession:
        """A handle on an existing session (nothing is sent until it is used)."""
        return AsyncSession(self, SessionInfo(session_id, "", 0, 0, 0.0, 0, 0))

    async def health(
        self, service: str = "", *, timeout: float | None = None, wait_for_ready: bool = False
    ) -> str:
        """The grpc.health.v1 status name of service ("" is the whole server), e.g. "SERVING"."""
        return await self._run(ops.health(service, wait_for_ready), timeout)

    async def wait_ready(self, timeout: float, service: str = "") -> None:
        """Wait until health says SERVING; TimeoutError after timeout seconds."""
        wait = _ReadyWait(self.target, timeout)
        while not wait.serving(await self._run(_ready_check(service), wait.remaining())):
            await asyncio.sleep(wait.pause())
