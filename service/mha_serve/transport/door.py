"""mha.v1 without a server: each call's request converted, the serving layer called, the answer
converted back, its error made a status (answer.settle), its metrics counted. Every host of
the mha.v1 API runs these (the gRPC servicer, servicer.py; the Ray Serve replica,
ray_app/replica.py), so none copies a check, a message or a metric.

A call is read through `ReadOnlyContext`: the read-only half of a grpc.aio.ServicerContext (its
metadata, peer, auth and time remaining). The door never aborts or sets a code: it returns
the response or a `Refused`, and its host sends that as its transport does.
"""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from types import EllipsisType
from typing import Any, Protocol, TypeVar

import grpc

from mha_client.api import attention_pb2 as pb
from mha_serve import metrics
from mha_serve.engine.requests import ModelView
from mha_serve.serving import EngineClient, Unavailable
from mha_serve.serving.finish import offload
from mha_serve.transport import tracing
from mha_serve.transport.answer import Refused, deadline_passed, note_malformed, settle
from mha_serve.transport.auth import client_identity
from mha_serve.transport.convert import (
    Frames,
    Received,
    encode_reply,
    encode_result,
    model_info,
    session_info,
    stamp,
    to_call,
)
from mha_serve.transport.handlers import Malformed, MalformedLog
from mha_serve.transport.heads import heads_response

T = TypeVar("T")
PROTOCOL = metrics.PROTOCOL_MHA_V1
# The encoders of a call's reply, by whether its input was one 2-D sequence (made once, not
# per call): framed bytes when large for a request as gRPC parsed it (Received), else a
# message.
_ENCODE_REPLY = {s: functools.partial(encode_reply, single=s) for s in (False, True)}
_ENCODE_RESULT = {s: functools.partial(encode_result, single=s) for s in (False, True)}


class ReadOnlyContext(Protocol):
    """What a door reads of a call: grpc.aio.ServicerContext's read-only half."""

    def time_remaining(self) -> float | None: ...
    def peer(self) -> str: ...
    def auth_context(self) -> Any: ...
    def invocation_metadata(self) -> Any: ...
    def done(self) -> bool: ...


def _deadline(context: ReadOnlyContext) -> float | None:
    """The call's deadline: time.monotonic() when it ends; None: it has none."""
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


class Door:
    """What every door does with a unary call: bytes that are no message refused, the
    method's handler settled (answer.settle) under its model's label. A door names its
    PROTOCOL, the method it COMPUTES (counted in IN_FLIGHT), its handlers and labels."""

    PROTOCOL: str
    COMPUTES: str

    def __init__(self) -> None:
        self.malformed_log = MalformedLog()
        self._methods: dict[str, Callable[[Any, ReadOnlyContext], Awaitable[Any]]] = {}

    @property
    def unary_methods(self) -> frozenset[str]:
        return frozenset(self._methods)

    async def unary(
        self,
        method: str,
        request: Any,
        context: ReadOnlyContext,
        over: Callable[[], bool] = lambda: False,
    ) -> Any:
        """The response to one unary call, or Refused. over(): whether the call is over
        already (its deadline passed: the transport answers it), see answer.settle."""
        if isinstance(request, Malformed):
            return self.malformed(method, request, context)
        model = await self.label(method, request)
        computes = method == self.COMPUTES
        return await settle(
            method,
            model,
            self._methods[method],
            request,
            context,
            protocol=self.PROTOCOL,
            over=over,
            in_flight=computes,
            expired=lambda: deadline_passed(context),
            context=context,
        )

    def malformed(self, method: str, request: Malformed, context: ReadOnlyContext) -> Refused:
        """INVALID_ARGUMENT for bytes that are no valid message; the log only summarises."""
        note_malformed(method, request, context, self.malformed_log, protocol=self.PROTOCOL)
        return Refused(grpc.StatusCode.INVALID_ARGUMENT, request.message)

    async def label(self, method: str, request: Any) -> str:
        """The model label of a call's metrics."""
        raise NotImplementedError


class AttentionDoor(Door):
    """mha.v1 over the serving layer: `unary` answers one call, `stream` a StreamSession."""

    PROTOCOL = PROTOCOL
    COMPUTES = "Attend"

    def __init__(self, *, max_request_bytes: int) -> None:
        super().__init__()
        self._serving: EngineClient | None = None  # set once models are loaded and warm
        self.max_request_bytes = max_request_bytes
        self._methods = {
            "Attend": self.attend,
            "CreateSession": self._create_session,
            "GetSession": self._get_session,
            "ForkSession": self._fork_session,
            "TruncateSession": self._truncate_session,
            "CloseSession": self._close_session,
            "ListModels": self._list_models,
            "GetModelInfo": self._get_model_info,
            "AnalyzeHeads": self._analyze_heads,
        }

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

    # --- one call ----------------------------------------------------------------------

    async def stream(
        self,
        requests: AsyncIterator[Any],
        context: ReadOnlyContext,
        over: Callable[[], bool] = lambda: False,
        refuse: Callable[[Refused], Awaitable[Any]] | None = None,
    ) -> AsyncIterator[Any]:
        """A StreamSession: one session's steps, one per message, answered in order; the
        first error is yielded as Refused and ends it, or with `refuse`, awaited as
        refuse(refused) (a host that ends the call by raising: gRPC's abort). Later messages
        may leave session_id empty; naming another session is an error."""
        # What every message of the stream shares, read at its first: its session, model
        # label, client, request counter and deadline (a call's, fixed when it began).
        session_id, model, caller, count, deadline = "", "", None, None, None
        async for request in requests:
            if isinstance(request, Malformed):
                answer = self.malformed("StreamSession", request, context)
            else:
                message = request.message if isinstance(request, Received) else request
                refusal = None
                if not session_id:
                    session_id = message.session_id
                    if not session_id:
                        refusal = (
                            "the first message of a StreamSession needs session_id "
                            "(CreateSession makes one)"
                        )
                        model = "unknown"
                    else:
                        model = await self.label("Attend", message)
                        caller = client_identity(context)  # the stream's, once
                        count = metrics.request_counts("StreamSession", model, PROTOCOL)
                        deadline = _deadline(context)
                elif not (named := message.session_id):
                    message.session_id = session_id
                elif named != session_id:
                    refusal = (
                        f"this stream steps session {session_id!r}, but a message names "
                        f"{named!r}: open one stream per session"
                    )
                if refusal is None:
                    answer = await settle(
                        "StreamSession",
                        model,
                        self.attend,
                        request,
                        context,
                        caller,
                        deadline,
                        protocol=PROTOCOL,
                        over=over,
                        in_flight=True,
                        count=count,
                        expired=lambda: deadline_passed(context),
                        context=context,
                    )
                    if not isinstance(answer, Refused):
                        yield answer
                        continue
                else:
                    metrics.count_request("StreamSession", model, "INVALID_ARGUMENT")
                    answer = Refused(grpc.StatusCode.INVALID_ARGUMENT, refusal)
            if refuse is None:  # the first refusal ends the stream
                yield answer
            else:
                await refuse(answer)
            return

    # --- labels ------------------------------------------------------------------------

    def model_label(self, name: str) -> str:
        return "unknown" if self._serving is None else self._serving.model_label(name)

    async def session_label(self, session_id: str) -> str:
        """A metric label never fails a call: with frontend workers it is a round trip that
        can fail (the engine gone), and the call itself then answers why."""
        if self._serving is None:
            return "unknown"
        try:
            return await self._serving.session_label(session_id)
        except Exception:
            return "unknown"

    async def label(self, method: str, request: Any) -> str:
        if method == "Attend":  # a session step may leave the model to its session
            message = request.message if isinstance(request, Received) else request
            if message.model or not message.session_id:
                return self.model_label(message.model)
            return await self.session_label(message.session_id)
        if method == "CreateSession":
            return self.model_label(request.model)
        if method == "GetModelInfo":
            return self.model_label(request.name)
        if method == "AnalyzeHeads":
            return self.model_label(request.attend.model)
        if method == "ListModels":
            return ""
        return await self.session_label(request.session_id)

    # --- attention ---------------------------------------------------------------------

    async def attend(
        self,
        request: pb.AttendRequest | Received,
        context: ReadOnlyContext,
        caller: str | None = None,
        deadline: float | None | EllipsisType = ...,
    ) -> Any:
        """One Attend or session step. A request as the gRPC handlers parse it (Received)
        answers framed bytes when large; a message answers a message. caller: the client's
        identity, and deadline the call's (time.monotonic(), None: none), when already known
        (a stream's); `...`: read from the context."""
        received = time.perf_counter()
        serving = self._serving
        if serving is None:
            serving = self.serving  # raises Unavailable
        if isinstance(request, Received):
            call, single = to_call(request.message, request.input_data)
            encode = _ENCODE_REPLY[single]
        else:
            call, single = to_call(request)
            encode = _ENCODE_RESULT[single]
        if deadline is ...:
            deadline = _deadline(context)
        served = await serving.attend(
            call,
            encode,
            received=received,
            deadline=deadline,
            caller=(caller or client_identity(context)) if call.session_id else None,
        )
        response = served.reply
        if tracing.SPANS is not None:
            tracing.note(served.timing, call.session_id)
        if isinstance(response, Frames):  # the model and timing fields go after the tensors
            tail = pb.AttendResponse()
            stamp(tail, served.model, served.timing)
            return await offload(response.join, tail.SerializeToString(), nbytes=response.nbytes)
        stamp(response, served.model, served.timing)
        return response

    async def _analyze_heads(
        self, request: pb.AnalyzeHeadsRequest, context: ReadOnlyContext
    ) -> Any:
        call, _ = to_call(request.attend)
        report = await self.serving.analyze_heads(call, request.include_weights)
        return heads_response(call.model, report)

    # --- sessions ----------------------------------------------------------------------

    async def _create_session(
        self, request: pb.CreateSessionRequest, context: ReadOnlyContext
    ) -> Any:
        return session_info(
            await self.serving.create_session(
                request.model,
                request.max_len or None,
                request.ttl_s or None,
                owner=client_identity(context),  # whom per-client limits count against
            )
        )

    async def _get_session(self, request: pb.GetSessionRequest, context: ReadOnlyContext) -> Any:
        caller = client_identity(context)
        return session_info(await self.serving.get_session(request.session_id, caller))

    async def _fork_session(self, request: pb.ForkSessionRequest, context: ReadOnlyContext) -> Any:
        return session_info(
            await self.serving.fork_session(
                request.session_id, request.ttl_s or None, client_identity(context)
            )
        )

    async def _truncate_session(
        self, request: pb.TruncateSessionRequest, context: ReadOnlyContext
    ) -> Any:
        return session_info(
            await self.serving.truncate_session(
                request.session_id, request.num_tokens, client_identity(context)
            )
        )

    async def _close_session(
        self, request: pb.CloseSessionRequest, context: ReadOnlyContext
    ) -> Any:
        await self.serving.close_session(request.session_id, client_identity(context))
        return pb.CloseSessionResponse()

    # --- models ------------------------------------------------------------------------

    async def _list_models(self, request: pb.ListModelsRequest, context: ReadOnlyContext) -> Any:
        return pb.ListModelsResponse(models=[await self._info(h) for h in self.serving.models()])

    async def _get_model_info(
        self, request: pb.GetModelInfoRequest, context: ReadOnlyContext
    ) -> Any:
        return await self._info(self.serving.model(request.name))

    async def _info(self, hosted: ModelView) -> pb.ModelInfo:
        serving = self.serving
        return model_info(
            hosted,
            await serving.cache_info(hosted.spec.name),
            self.max_request_bytes,
            serving.max_response_bytes,
        )
