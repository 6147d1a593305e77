"""The mha.v1.AttentionService servicer: converts, delegates, maps errors to status codes."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

from mha_client.api import attention_pb2 as pb
from mha_client.api import attention_pb2_grpc as pb_grpc
from mha_serve import metrics
from mha_serve.batching import Closed, DeadlineExceeded, ModelLanes, QueueFull
from mha_serve.cache import (
    CacheError,
    CacheExhausted,
    InvalidSessionArgument,
    SessionBusy,
    SessionFull,
    SessionNotFound,
)
from mha_serve.engine import (
    Abandoned,
    AttendCall,
    DeadlinePassed,
    Engine,
    HostedModel,
    InvalidRequest,
    ModelNotFound,
    RequestError,
    TooLarge,
)
from mha_serve.transport.convert import encode_result, model_info, session_info, to_call
from mha_serve.transport.handlers import Malformed, MalformedLog

log = logging.getLogger(__name__)
T = TypeVar("T")


class Unavailable(RequestError):
    """The server cannot take requests now (UNAVAILABLE): warming up or draining."""


# Looked up along the exception's class hierarchy; the first match wins.
STATUS_OF: dict[type[Exception], grpc.StatusCode] = {
    QueueFull: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Closed: grpc.StatusCode.UNAVAILABLE,
    DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    ModelNotFound: grpc.StatusCode.NOT_FOUND,
    DeadlinePassed: grpc.StatusCode.DEADLINE_EXCEEDED,
    Abandoned: grpc.StatusCode.CANCELLED,
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    TooLarge: grpc.StatusCode.RESOURCE_EXHAUSTED,
    SessionNotFound: grpc.StatusCode.NOT_FOUND,
    SessionFull: grpc.StatusCode.OUT_OF_RANGE,
    CacheExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    SessionBusy: grpc.StatusCode.ABORTED,
    InvalidSessionArgument: grpc.StatusCode.INVALID_ARGUMENT,
}
EXPECTED = (RequestError, CacheError, QueueFull, Closed, DeadlineExceeded)

# Payloads above this are validated and encoded on a worker thread so that the event loop
# keeps answering health checks and other calls (a 64 MiB reply takes ~0.5 s to encode).
OFFLOAD_BYTES = 1 << 20


def status_of(error: Exception) -> grpc.StatusCode:
    for cls in type(error).__mro__:
        if cls in STATUS_OF:
            return STATUS_OF[cls]
    return grpc.StatusCode.INTERNAL


def _parsed(method: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """A unary method that first answers a request whose bytes did not parse."""

    @functools.wraps(method)
    async def run(self: AttentionServicer, request: Any, context: grpc.aio.ServicerContext) -> T:
        if isinstance(request, Malformed):
            await self._reject(method.__name__, request, context)
        return await method(self, request, context)

    return run


async def _offload(fn: Callable[..., T], *args: Any, nbytes: int) -> T:
    if nbytes < OFFLOAD_BYTES:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


class AttentionServicer(pb_grpc.AttentionServiceServicer):
    """Requests queue in their model's lanes, which run the engine off the event loop."""

    def __init__(self, *, max_request_bytes: int) -> None:
        self._engine: Engine | None = None  # set by the server once models are loaded and warm
        self._lanes: dict[str, ModelLanes] = {}
        self.max_request_bytes = max_request_bytes
        self.malformed_log = MalformedLog()

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            raise Unavailable(
                "the server is still loading its models; retry when health reports SERVING"
            )
        return self._engine

    def attach(self, engine: Engine, lanes: dict[str, ModelLanes]) -> None:
        """Starts serving: the warm engine and one ModelLanes per hosted model."""
        self._lanes = lanes
        self._engine = engine

    def _model_label(self, name: str) -> str:
        """Metric label: the model name when hosted, so unknown names cannot grow the label set."""
        return name if self._engine is not None and name in self._engine.models else "unknown"

    def _label(self, request: pb.AttendRequest) -> str:
        """The model label of an Attend: a session step may leave the model to its session."""
        if request.model or not request.session_id:
            return self._model_label(request.model)
        return self._session_label(request.session_id)

    def _session_label(self, session_id: str) -> str:
        """The model label of a session's RPC: its model, or "unknown" for no live session."""
        name = ""
        if session_id and self._engine is not None:
            with contextlib.suppress(CacheError):  # the RPC itself will answer NOT_FOUND
                name = self._engine.sessions.table.get(session_id).model
        return self._model_label(name)

    # --- attention ---------------------------------------------------------------------

    @_parsed
    async def Attend(
        self, request: pb.AttendRequest, context: grpc.aio.ServicerContext
    ) -> pb.AttendResponse:
        model = self._label(request)
        metrics.IN_FLIGHT.inc()
        try:
            return await self._answer(
                "Attend", model, context, lambda: self._attend(request, context)
            )
        finally:
            metrics.IN_FLIGHT.dec()

    async def StreamSession(
        self, requests: AsyncIterator[pb.AttendRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.AttendResponse]:
        """One session's steps, one per message, answered in order; the first error ends the
        stream. Later messages may leave session_id empty; naming another session is an error."""
        session_id, model = "", ""
        async for request in requests:
            if isinstance(request, Malformed):
                await self._reject("StreamSession", request, context)
            if not session_id:
                session_id = request.session_id
                if not session_id:
                    metrics.count_request("StreamSession", "unknown", "INVALID_ARGUMENT")
                    await context.abort(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        "the first message of a StreamSession needs session_id (CreateSession "
                        "makes one)",
                    )
                model = self._label(request)
            elif not request.session_id:
                request.session_id = session_id
            elif request.session_id != session_id:
                metrics.count_request("StreamSession", model, "INVALID_ARGUMENT")
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"this stream steps session {session_id!r}, but a message names "
                    f"{request.session_id!r}: open one stream per session",
                )
            metrics.IN_FLIGHT.inc()
            try:
                response = await self._answer(
                    "StreamSession", model, context, lambda r=request: self._attend(r, context)
                )
            finally:
                metrics.IN_FLIGHT.dec()
            yield response

    async def _attend(
        self, request: pb.AttendRequest, context: grpc.aio.ServicerContext
    ) -> pb.AttendResponse:
        received = time.perf_counter()
        call, single = to_call(request, self.engine)
        if not call.session_id:
            return await self._attend_call(call, single, received, context)
        with self.engine.sessions.stepping(call.session_id):  # until answered
            return await self._attend_call(call, single, received, context)

    async def _attend_call(
        self, call: AttendCall, single: bool, received: float, context: grpc.aio.ServicerContext
    ) -> pb.AttendResponse:
        # Validation scans the input (NaN/Inf): off the event loop when it is large.
        hosted = await _offload(self.engine.validate, call, nbytes=call.inputs.nbytes)
        batch, seq_len, _ = call.inputs.shape
        remaining = context.time_remaining()
        call.deadline = None if remaining is None else time.monotonic() + remaining
        submitted = time.perf_counter()
        try:
            result, info = await self._lanes[call.model].submit(
                call,
                need_weights=call.need_weights,
                sequences=batch,
                length=seq_len,
                key=self.engine.batch_key(hosted, call),
                deadline=call.deadline,
            )
        except asyncio.CancelledError:  # the client is gone: a session step still running
            call.cancelled = True  # is then rolled back, not kept (Sessions._settle)
            raise
        # Queue time includes decoding and validation before the request was queued.
        queue_ms = (submitted - received + info.queue_s) * 1e3
        reply_bytes = result.output.nbytes + (
            0 if result.weights is None else result.weights.nbytes
        )
        response = await _offload(encode_result, result, single, nbytes=reply_bytes)
        response.model = call.model
        total_s = time.perf_counter() - received
        timing = response.timing
        timing.queue_ms = queue_ms
        timing.compute_ms = info.compute_s * 1e3
        timing.total_ms = total_s * 1e3
        timing.batch_size = result.batch_size  # computed: steps refused at reserve are not
        metrics.observe_attend(
            call.model,
            tokens=batch * seq_len,
            queue_s=queue_ms / 1e3,
            total_s=total_s,
            weights_bytes=0 if result.weights is None else result.weights.nbytes,
        )
        return response

    # --- sessions ----------------------------------------------------------------------

    @_parsed
    async def CreateSession(
        self, request: pb.CreateSessionRequest, context: grpc.aio.ServicerContext
    ) -> pb.SessionInfo:
        def handle() -> pb.SessionInfo:
            if not request.model:
                raise InvalidRequest("model is empty; name one of the models ListModels returns")
            self.engine.get(request.model)
            session = self.engine.sessions.create(
                request.model, request.max_len or None, request.ttl_s or None
            )
            return session_info(self.engine.sessions.table.session_stats(session.id))

        model = self._model_label(request.model)
        return await self._answer("CreateSession", model, context, _sync(handle))

    @_parsed
    async def GetSession(
        self, request: pb.GetSessionRequest, context: grpc.aio.ServicerContext
    ) -> pb.SessionInfo:
        def handle() -> pb.SessionInfo:
            return session_info(self.engine.sessions.table.session_stats(_session_id(request)))

        model = self._session_label(request.session_id)
        return await self._answer("GetSession", model, context, _sync(handle))

    @_parsed
    async def ForkSession(
        self, request: pb.ForkSessionRequest, context: grpc.aio.ServicerContext
    ) -> pb.SessionInfo:
        def handle() -> pb.SessionInfo:
            table = self.engine.sessions.table
            child = table.fork(_session_id(request), ttl_s=request.ttl_s or None)
            return session_info(table.session_stats(child.id))

        model = self._session_label(request.session_id)
        return await self._answer("ForkSession", model, context, _sync(handle))

    @_parsed
    async def TruncateSession(
        self, request: pb.TruncateSessionRequest, context: grpc.aio.ServicerContext
    ) -> pb.SessionInfo:
        def handle() -> pb.SessionInfo:
            sessions = self.engine.sessions
            session = sessions.truncate(_session_id(request), request.num_tokens)
            return session_info(sessions.table.session_stats(session.id))

        model = self._session_label(request.session_id)
        return await self._answer("TruncateSession", model, context, _sync(handle))

    @_parsed
    async def CloseSession(
        self, request: pb.CloseSessionRequest, context: grpc.aio.ServicerContext
    ) -> pb.CloseSessionResponse:
        def handle() -> pb.CloseSessionResponse:
            self.engine.sessions.table.close(_session_id(request))
            return pb.CloseSessionResponse()

        model = self._session_label(request.session_id)
        return await self._answer("CloseSession", model, context, _sync(handle))

    # --- models ------------------------------------------------------------------------

    @_parsed
    async def ListModels(
        self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListModelsResponse:
        def handle() -> pb.ListModelsResponse:
            return pb.ListModelsResponse(
                models=[self._info(h) for h in self.engine.models.values()]
            )

        return await self._answer("ListModels", "", context, _sync(handle))

    @_parsed
    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfo:
        def handle() -> pb.ModelInfo:
            return self._info(self.engine.get(request.name))

        return await self._answer(
            "GetModelInfo", self._model_label(request.name), context, _sync(handle)
        )

    def _info(self, hosted: HostedModel) -> pb.ModelInfo:
        return model_info(
            hosted, self.engine, self.max_request_bytes, self.engine.max_response_bytes
        )

    async def _reject(
        self, method: str, request: Malformed, context: grpc.aio.ServicerContext
    ) -> None:
        """INVALID_ARGUMENT for bytes that are no valid message; the log only summarises."""
        metrics.count_request(method, "unknown", grpc.StatusCode.INVALID_ARGUMENT.name)
        self.malformed_log.note(method, context.peer(), request)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)

    async def _answer(
        self,
        method: str,
        model: str,
        context: grpc.aio.ServicerContext,
        handle: Callable[[], Awaitable[T]],
    ) -> T:
        """Runs a handler; expected errors become their status, anything else INTERNAL.
        An error status is counted before it is sent: a client that has it finds it counted."""
        code, counted = grpc.StatusCode.OK, False
        try:
            return await handle()
        except EXPECTED as e:
            code = status_of(e)
            if _over(context):  # its deadline passed: gRPC answers DEADLINE_EXCEEDED itself,
                raise asyncio.CancelledError from e  # and aborting a finished call logs an ERROR
            metrics.count_request(method, model, code.name)
            counted = True
            await context.abort(code, str(e))
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        except Exception as e:
            if isinstance(e, grpc.aio.AbortError):
                raise
            code = grpc.StatusCode.INTERNAL
            log.exception("%s failed on model %s", method, model)
            metrics.count_request(method, model, code.name)
            counted = True
            await context.abort(code, f"internal error in {method}: {type(e).__name__}: {e}")
        finally:
            if not counted:
                metrics.count_request(method, model, code.name)


def _over(context: grpc.aio.ServicerContext) -> bool:
    """Whether the call is over already: done() turns true only once a status was sent (grpcio
    1.85), so a passed deadline is read from the time remaining."""
    remaining = context.time_remaining()
    return context.done() or (remaining is not None and remaining <= 0)


def _session_id(request: Any) -> str:
    if not request.session_id:
        raise InvalidRequest("session_id is empty; CreateSession returns one")
    return request.session_id


def _sync(fn: Callable[[], T]) -> Callable[[], Awaitable[T]]:
    """A quick synchronous handler as the coroutine function _answer expects."""

    async def run() -> T:
        return fn()

    return run
