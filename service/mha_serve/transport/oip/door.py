"""The Open Inference Protocol without a server: each call converted, delegated to the
serving layer shared with mha.v1, its error made the status and message Triton's clients
expect (answer.settle). The gRPC servicer (servicer.py) and the Ray Serve replica both run
it; a call is read through door.ReadOnlyContext, as for mha.v1."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from importlib import metadata
from typing import Any

import grpc

from mha_client.api.inference import grpc_service_pb2 as pb
from mha_serve import metrics
from mha_serve.cache.errors import SessionBusy, SessionNotFound
from mha_serve.engine.errors import ModelNotFound, RequestError
from mha_serve.engine.requests import AttendRequest, ModelView
from mha_serve.serving import EXPECTED, EngineClient, Served, Unavailable
from mha_serve.transport import tracing
from mha_serve.transport.answer import deadline_passed
from mha_serve.transport.auth import client_identity
from mha_serve.transport.door import Door, ReadOnlyContext
from mha_serve.transport.handlers import Malformed
from mha_serve.transport.oip.convert import (
    VERSION,
    encode_response,
    model_config,
    model_metadata,
    to_call,
)
from mha_serve.transport.oip.convert import parameter as read_parameter
from mha_serve.transport.oip.sequences import Sequence, SequenceKey, sequence_of
from mha_serve.transport.oip.stream import stream_error
from mha_serve.transport.status import status_of

log = logging.getLogger(__name__)

PROTOCOL = metrics.PROTOCOL_KSERVE_V2
SERVER_NAME = "mha-serve"
# Triton's names for the protocol extensions this door implements.
EXTENSIONS = ("model_configuration", "sequence", "parameters")


def _version() -> str:
    try:
        return metadata.version("mha-serve")
    except metadata.PackageNotFoundError:
        return "0"


class InferenceDoor(Door):
    """The Open Inference Protocol over the serving layer (`serving()` returns it once warm)."""

    PROTOCOL = PROTOCOL
    COMPUTES = "ModelInfer"

    def __init__(
        self,
        serving: Callable[[], EngineClient | None],
        *,
        ready: Callable[[], bool],
        session_ttl_s: float = 0.0,
    ) -> None:
        super().__init__()
        self._serving = serving
        self._ready = ready
        self.session_ttl_s = session_ttl_s  # reported in ModelConfig (0: sessions never expire)
        self._methods = {
            "ServerLive": self._server_live,
            "ServerReady": self._server_ready,
            "ModelReady": self._model_ready,
            "ServerMetadata": self._server_metadata,
            "ModelMetadata": self._model_metadata,
            "ModelConfig": self._model_config,
            "ModelInfer": self.infer,
        }

    @property
    def serving(self) -> EngineClient:
        serving = self._serving()
        if serving is None:
            raise Unavailable(
                "the server is still loading its models; retry when ServerReady is true"
            )
        return serving

    def _model_label(self, name: str) -> str:
        serving = self._serving()
        return "unknown" if serving is None else serving.model_label(name)

    def hosted(self, name: str, version: str) -> ModelView:
        """The model a request names; Triton's message for an unknown name or version."""
        serving = self.serving
        try:
            hosted = serving.model(name)
        except ModelNotFound:
            names = ", ".join(h.spec.name for h in serving.models())
            raise ModelNotFound(
                f"Request for unknown model: '{name}' is not found (models here: {names})"
            ) from None
        if version not in ("", VERSION):
            raise ModelNotFound(
                f"Request for unknown model: '{name}' version {version} is not found "
                f"(its one version is {VERSION})"
            )
        return hosted

    # --- one call ----------------------------------------------------------------------

    async def label(self, method: str, request: Any) -> str:
        if method in ("ServerLive", "ServerReady", "ServerMetadata"):
            return ""
        return self._model_label(request.model_name if method == "ModelInfer" else request.name)

    async def stream_one(
        self, request: pb.ModelInferRequest | Malformed, context: ReadOnlyContext
    ) -> pb.ModelStreamInferResponse:
        """One ModelStreamInfer message's reply (an error is its error_message, Triton's
        behaviour); raises only when cancelled."""
        if isinstance(request, Malformed):
            self.malformed("ModelStreamInfer", request, context)
            return pb.ModelStreamInferResponse(error_message=request.message)
        model = self._model_label(request.model_name)
        code, details = grpc.StatusCode.OK, None
        spans = tracing.SPANS
        span = None if spans is None else spans.start("ModelStreamInfer", model, PROTOCOL, context)
        metrics.in_flight(1)
        try:
            return pb.ModelStreamInferResponse(infer_response=await self.infer(request, context))
        except EXPECTED as e:
            code, details = status_of(e), str(e)
            return stream_error(request, details)
        except asyncio.CancelledError:  # (at the deadline: counted as its client hears it)
            expired = deadline_passed(context)
            code = grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED
            details = "the call ended before its answer"
            raise
        except Exception as e:
            code = grpc.StatusCode.INTERNAL
            log.exception("ModelStreamInfer failed on model %s", model)
            details = f"internal error: {type(e).__name__}: {e}"
            return stream_error(request, details)
        finally:
            metrics.in_flight(-1)
            metrics.count_request("ModelStreamInfer", model, code.name, PROTOCOL)
            if span is not None:
                spans.end(span, code.value[0], code.name, details)

    # --- health and metadata -----------------------------------------------------------

    async def _server_live(self, request: Any, context: ReadOnlyContext) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def _server_ready(self, request: Any, context: ReadOnlyContext) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self._ready())

    async def _model_ready(
        self, request: pb.ModelReadyRequest, context: ReadOnlyContext
    ) -> pb.ModelReadyResponse:
        if not self._ready():
            return pb.ModelReadyResponse(ready=False)
        with contextlib.suppress(ModelNotFound):  # Triton: not ready, not an error
            self.hosted(request.name, request.version)
            return pb.ModelReadyResponse(ready=True)
        return pb.ModelReadyResponse(ready=False)

    async def _server_metadata(
        self, request: Any, context: ReadOnlyContext
    ) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(
            name=SERVER_NAME, version=_version(), extensions=EXTENSIONS
        )

    async def _model_metadata(
        self, request: pb.ModelMetadataRequest, context: ReadOnlyContext
    ) -> pb.ModelMetadataResponse:
        return model_metadata(self.hosted(request.name, request.version))

    async def _model_config(
        self, request: pb.ModelConfigRequest, context: ReadOnlyContext
    ) -> pb.ModelConfigResponse:
        hosted = self.hosted(request.name, request.version)
        sessions = await self.serving.cache_info(hosted.spec.name) is not None
        config = model_config(hosted, sessions=sessions, session_ttl_s=self.session_ttl_s)
        return pb.ModelConfigResponse(config=config)

    # --- inference ---------------------------------------------------------------------

    async def infer(
        self, request: pb.ModelInferRequest, context: ReadOnlyContext
    ) -> pb.ModelInferResponse:
        """One ModelInfer; errors raise (unary: settle makes them statuses)."""
        received = time.perf_counter()
        serving = self.serving
        hosted = self.hosted(request.model_name, request.model_version)
        model = hosted.spec.name
        sequence = sequence_of(request.parameters)
        try:
            call, outputs = to_call(request, hosted)
            deadline = _deadline(context, read_parameter(request.parameters, "timeout", model))
        except RequestError:
            if sequence is not None and sequence.end and not sequence.start:
                # end closes the sequence whatever its step's outcome: a step refused before
                # it reached the sequence's session too
                key = sequence_key_of(model, client_identity(context), sequence)
                session_id = await serving.sequence_session(key)
                if session_id is not None:
                    await asyncio.shield(serving.end_sequence(key, session_id, close=True))
            raise
        encode = functools.partial(
            encode_response, outputs=outputs, model=model, request_id=request.id
        )
        if sequence is None:
            served = await serving.attend(call, encode, received=received, deadline=deadline)
        else:
            owner = client_identity(context)  # whom a new session counts against (limits)
            served = await self._step(
                serving, sequence, call, encode, owner=owner, received=received, deadline=deadline
            )
        response, timing = served.reply, served.timing
        if tracing.SPANS is not None:
            tracing.note(timing)
        for name, value in (
            ("queue_ms", timing.queue_ms),
            ("compute_ms", timing.compute_ms),
            ("total_ms", timing.total_ms),
        ):
            response.parameters[name].double_param = value
        if timing.restore_ms:  # the sequence's session came back from the spill tier first
            response.parameters["restore_ms"].double_param = timing.restore_ms
        response.parameters["batch_size"].int64_param = timing.batch_size
        return response

    async def _step(
        self,
        serving: EngineClient,
        sequence: Sequence,
        call: AttendRequest,
        encode: Callable[..., pb.ModelInferResponse],
        *,
        owner: str,
        received: float,
        deadline: float | None,
    ) -> Served[pb.ModelInferResponse]:
        """One step of a sequence's session: start creates it (replacing a live one of the same
        id), end closes it after the step, whatever the step's outcome."""
        model = call.model
        # A sequence id names a sequence of its client only (the same identity that limits
        # count against: certificate, token or peer address): another client sending the
        # same id never reaches this one's cached keys. (Triton's ids are global per model.)
        key = sequence_key_of(model, owner, sequence)
        # The engine keeps the sequences (every frontend worker finds them); each change is
        # one engine call, so no cancellation between two leaves a session behind.
        if sequence.start:
            session_id = await serving.start_sequence(key, model, owner)
        else:
            session_id = await serving.sequence_session(key)
            if session_id is None:
                raise sequence.not_started(model)
        call = dataclasses.replace(call, session_id=session_id)
        close = sequence.end
        try:
            return await serving.attend(
                call, encode, received=received, deadline=deadline, caller=owner
            )
        except SessionNotFound as e:  # expired, evicted or closed through mha.v1
            await serving.end_sequence(key, session_id, close=False)
            close = False
            raise SessionNotFound(
                e.session_id,
                e.reason,
                f"{sequence.describe(model)} is no longer active ({e}); start it again "
                "with sequence_start",
            ) from None
        except SessionBusy:
            close = False  # the step in flight owns the session; it is not ours to close
            raise
        finally:
            if close:  # shielded: a cancelled step's sequence still ends
                await asyncio.shield(serving.end_sequence(key, session_id, close=True))

    def sequence_key(
        self, request: Any, context: ReadOnlyContext
    ) -> tuple[Sequence, SequenceKey] | None:
        """The request's sequence and its key, None for a stateless or unreadable request."""
        if isinstance(request, Malformed):
            return None
        try:
            sequence = sequence_of(request.parameters)
            if sequence is None:
                return None
            model = self.hosted(request.model_name, request.model_version).spec.name
        except RequestError:
            return None
        return sequence, sequence_key_of(model, client_identity(context), sequence)

    async def sequence_session(self, request: Any, context: ReadOnlyContext) -> str | None:
        """The session the request's sequence steps now (after the request: None once it
        ended or its session is gone), None for a stateless or unreadable request. What a
        front door that routes sequences (the Ray app) reads after each call."""
        found = self.sequence_key(request, context)
        return None if found is None else await self.serving.sequence_session(found[1])


def sequence_key_of(model: str, owner: str, sequence: Sequence) -> SequenceKey:
    """A sequence id names a sequence of one client (its identity) on one model."""
    return (model, owner, sequence.id)


def _deadline(context: ReadOnlyContext, timeout_us: Any) -> float | None:
    """The earlier of the gRPC deadline and Triton's `timeout` parameter (microseconds)."""
    now = time.monotonic()
    remaining = context.time_remaining()
    deadlines = [] if remaining is None else [now + remaining]
    if timeout_us:
        deadlines.append(now + timeout_us / 1e6)
    return min(deadlines, default=None)
