"""The mha.v1.AttentionService servicer: converts, delegates, maps errors to status codes."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import grpc

from mha_client.api import attention_pb2 as pb
from mha_client.api import attention_pb2_grpc as pb_grpc
from mha_serve import metrics
from mha_serve.engine.requests import ModelView
from mha_serve.serving import EngineClient, Unavailable
from mha_serve.serving.finish import offload
from mha_serve.transport.answer import answer, note_malformed, parsed
from mha_serve.transport.auth import client_identity
from mha_serve.transport.convert import (
    Frames,
    Received,
    encode_reply,
    encode_result,
    model_info,
    parse_attend_request,
    session_info,
    to_call,
)
from mha_serve.transport.handlers import Malformed, MalformedLog
from mha_serve.transport.heads import heads_response
from mha_serve.transport.status import STATUS_OF, status_of

log = logging.getLogger(__name__)
T = TypeVar("T")

__all__ = ["STATUS_OF", "AttentionServicer", "Unavailable", "status_of"]


class AttentionServicer(pb_grpc.AttentionServiceServicer):
    """mha.v1 over the AsyncEngine: decodes, delegates, encodes, maps errors to statuses."""

    PROTOCOL = metrics.PROTOCOL_MHA_V1

    # On a gRPC server (handlers.add_service), Attend and StreamSession requests arrive parsed
    # with a large input's bytes left in place, and large replies leave as framed bytes: one
    # copy of a tensor each way instead of protobuf's five to eight (convert.FRAME_BYTES).
    # Called directly (the Ray replica), they take and give messages.
    request_parsers = {"Attend": parse_attend_request, "StreamSession": parse_attend_request}

    def __init__(self, *, max_request_bytes: int) -> None:
        self._serving: EngineClient | None = None  # set once models are loaded and warm
        self.max_request_bytes = max_request_bytes
        self.malformed_log = MalformedLog()

    @property
    def serving(self) -> EngineClient:
        if self._serving is None:
            raise Unavailable(
                "the server is still loading its models; retry when health reports SERVING"
            )
        return self._serving

    def attach(self, serving: EngineClient) -> None:
        """Starts serving: the warm engine behind its lanes."""
        self._serving = serving

    def _model_label(self, name: str) -> str:
        return "unknown" if self._serving is None else self._serving.model_label(name)

    async def _session_label(self, session_id: str) -> str:
        """A metric label never fails a call: with frontend workers it is a round trip that
        can fail (the engine gone), and the call itself then answers why."""
        if self._serving is None:
            return "unknown"
        try:
            return await self._serving.session_label(session_id)
        except Exception:
            return "unknown"

    async def _label(self, request: pb.AttendRequest) -> str:
        """The model label of an Attend: a session step may leave the model to its session."""
        if request.model or not request.session_id:
            return self._model_label(request.model)
        return await self._session_label(request.session_id)

    # --- attention ---------------------------------------------------------------------

    @parsed
    async def Attend(
        self, request: pb.AttendRequest | Received, context: grpc.aio.ServicerContext
    ) -> pb.AttendResponse | bytes:
        received = request if isinstance(request, Received) else None
        request = request.message if isinstance(request, Received) else request
        model = await self._label(request)
        metrics.IN_FLIGHT.inc()
        try:
            return await self._answer(
                "Attend", model, context, lambda: self._attend(request, context, received)
            )
        finally:
            metrics.IN_FLIGHT.dec()

    async def StreamSession(
        self,
        requests: AsyncIterator[pb.AttendRequest | Received],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.AttendResponse | bytes]:
        """One session's steps, one per message, answered in order; the first error ends the
        stream. Later messages may leave session_id empty; naming another session is an error."""
        session_id, model, caller = "", "", None
        async for request in requests:
            if isinstance(request, Malformed):
                await self._reject("StreamSession", request, context)
            received = request if isinstance(request, Received) else None
            request = request.message if isinstance(request, Received) else request
            if not session_id:
                session_id = request.session_id
                if not session_id:
                    metrics.count_request("StreamSession", "unknown", "INVALID_ARGUMENT")
                    await context.abort(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        "the first message of a StreamSession needs session_id (CreateSession "
                        "makes one)",
                    )
                model = await self._label(request)
                caller = client_identity(context)  # the stream's, once
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
                    "StreamSession",
                    model,
                    context,
                    lambda r=request, rc=received, c=caller: self._attend(r, context, rc, c),
                )
            finally:
                metrics.IN_FLIGHT.dec()
            yield response

    async def _attend(
        self,
        request: pb.AttendRequest,
        context: grpc.aio.ServicerContext,
        parsed: Received | None = None,
        caller: str | None = None,
    ) -> pb.AttendResponse | bytes:
        """parsed: how the request came off the wire; then a large answer is framed bytes.
        caller: the client's identity, when already known (a stream's)."""
        received = time.perf_counter()
        serving = self.serving
        call, single = to_call(request, parsed and parsed.input_data)
        remaining = context.time_remaining()
        served = await serving.attend(
            call,
            functools.partial(encode_result if parsed is None else encode_reply, single=single),
            received=received,
            deadline=None if remaining is None else time.monotonic() + remaining,
            caller=(caller or client_identity(context)) if call.session_id else None,
        )
        response, timing = served.reply, served.timing
        if isinstance(response, Frames):  # the model and timing fields go after the tensors
            tail = pb.AttendResponse(
                model=served.model,
                timing=pb.Timing(
                    queue_ms=timing.queue_ms,
                    compute_ms=timing.compute_ms,
                    total_ms=timing.total_ms,
                    batch_size=timing.batch_size,
                    restore_ms=timing.restore_ms,
                ),
            ).SerializeToString()
            return await offload(response.join, tail, nbytes=response.nbytes)
        response.model = served.model
        response.timing.queue_ms = timing.queue_ms
        response.timing.compute_ms = timing.compute_ms
        response.timing.total_ms = timing.total_ms
        response.timing.batch_size = timing.batch_size
        if timing.restore_ms:
            response.timing.restore_ms = timing.restore_ms
        return response

    # --- sessions ----------------------------------------------------------------------

    @parsed
    async def CreateSession(
        self, request: pb.CreateSessionRequest, context: grpc.aio.ServicerContext
    ) -> pb.SessionInfo:
        async def handle() -> pb.SessionInfo:
            return session_info(
                await self.serving.create_session(
                    request.model,
                    request.max_len or None,
                    request.ttl_s or None,
                    owner=client_identity(context),  # whom per-client limits count against
                )
            )

        model = self._model_label(request.model)
        return await self._answer("CreateSession", model, context, handle)

    @parsed
    async def GetSession(
        self, request: pb.GetSessionRequest, context: grpc.aio.ServicerContext
    ) -> pb.SessionInfo:
        async def handle() -> pb.SessionInfo:
            caller = client_identity(context)
            return session_info(await self.serving.get_session(request.session_id, caller))

        model = await self._session_label(request.session_id)
        return await self._answer("GetSession", model, context, handle)

    @parsed
    async def ForkSession(
        self, request: pb.ForkSessionRequest, context: grpc.aio.ServicerContext
    ) -> pb.SessionInfo:
        async def handle() -> pb.SessionInfo:
            return session_info(
                await self.serving.fork_session(
                    request.session_id, request.ttl_s or None, client_identity(context)
                )
            )

        model = await self._session_label(request.session_id)
        return await self._answer("ForkSession", model, context, handle)

    @parsed
    async def TruncateSession(
        self, request: pb.TruncateSessionRequest, context: grpc.aio.ServicerContext
    ) -> pb.SessionInfo:
        async def handle() -> pb.SessionInfo:
            return session_info(
                await self.serving.truncate_session(
                    request.session_id, request.num_tokens, client_identity(context)
                )
            )

        model = await self._session_label(request.session_id)
        return await self._answer("TruncateSession", model, context, handle)

    @parsed
    async def CloseSession(
        self, request: pb.CloseSessionRequest, context: grpc.aio.ServicerContext
    ) -> pb.CloseSessionResponse:
        async def handle() -> pb.CloseSessionResponse:
            await self.serving.close_session(request.session_id, client_identity(context))
            return pb.CloseSessionResponse()

        model = await self._session_label(request.session_id)
        return await self._answer("CloseSession", model, context, handle)

    # --- models ------------------------------------------------------------------------

    @parsed
    async def ListModels(
        self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListModelsResponse:
        async def handle() -> pb.ListModelsResponse:
            return pb.ListModelsResponse(
                models=[await self._info(h) for h in self.serving.models()]
            )

        return await self._answer("ListModels", "", context, handle)

    @parsed
    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfo:
        async def handle() -> pb.ModelInfo:
            return await self._info(self.serving.model(request.name))

        return await self._answer("GetModelInfo", self._model_label(request.name), context, handle)

    # --- head analysis -----------------------------------------------------------------

    @parsed
    async def AnalyzeHeads(
        self, request: pb.AnalyzeHeadsRequest, context: grpc.aio.ServicerContext
    ) -> pb.AnalyzeHeadsResponse:
        async def handle() -> pb.AnalyzeHeadsResponse:
            call, _ = to_call(request.attend)
            report = await self.serving.analyze_heads(call, request.include_weights)
            return heads_response(call.model, report)

        return await self._answer(
            "AnalyzeHeads", self._model_label(request.attend.model), context, handle
        )

    async def _info(self, hosted: ModelView) -> pb.ModelInfo:
        serving = self.serving
        return model_info(
            hosted,
            await serving.cache_info(hosted.spec.name),
            self.max_request_bytes,
            serving.max_response_bytes,
        )

    async def _reject(
        self, method: str, request: Malformed, context: grpc.aio.ServicerContext
    ) -> None:
        """INVALID_ARGUMENT for bytes that are no valid message; the log only summarises."""
        note_malformed(method, request, context, self.malformed_log, protocol=self.PROTOCOL)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)

    async def _answer(
        self,
        method: str,
        model: str,
        context: grpc.aio.ServicerContext,
        handle: Callable[[], Awaitable[T]],
    ) -> T:
        return await answer(method, model, context, handle, protocol=self.PROTOCOL)
