"""The Open Inference Protocol's methods of the Ingress (inference.GRPCInferenceService).

Each call, and each ModelStreamInfer message, goes to AttentionReplica, whose
InferenceServicer (the standalone server's) answers it. A Triton sequence's steps go to the
replica holding its session: the session each sequence steps is kept in SequenceDirectory
(one for the application, asked by every Ingress replica), written after its first step and
removed after its last or when its session is gone.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator
from typing import Any

import grpc
from ray.serve.grpc_util import RayServegRPCContext

from mha_client.api import attention_pb2 as mha_pb
from mha_client.api.inference import grpc_service_pb2 as pb
from mha_serve.engine import RequestError
from mha_serve.ray_app.context import CallContext, Caller, Reply
from mha_serve.ray_app.forward import calls, forward, message, own_request_id, unary_answer
from mha_serve.ray_app.router import liveness
from mha_serve.transport.auth import client_identity
from mha_serve.transport.handlers import Malformed
from mha_serve.transport.oip.sequences import Sequence, sequence_of
from mha_serve.transport.oip.servicer import sequence_key_of
from mha_serve.transport.oip.stream import pipelined, sequence_key, stream_error


class InferenceIngress:
    """inference.GRPCInferenceService through Ray's gRPC proxy (a base of Ingress)."""

    def __init__(self, replicas: Any, directory: Any) -> None:
        self._infer = calls(replicas, "infer")
        self._alive = liveness(replicas)
        self._close = calls(replicas, "call")
        self._directory_get = calls(directory, "get")
        self._directory_start = calls(directory, "start")
        self._directory_end = calls(directory, "end")

    async def ServerLive(self, request: Any, grpc_context: RayServegRPCContext) -> Any:
        return await self._oip_unary("ServerLive", request, grpc_context)

    async def ServerReady(self, request: Any, grpc_context: RayServegRPCContext) -> Any:
        return await self._oip_unary("ServerReady", request, grpc_context)

    async def ModelReady(self, request: Any, grpc_context: RayServegRPCContext) -> Any:
        return await self._oip_unary("ModelReady", request, grpc_context)

    async def ServerMetadata(self, request: Any, grpc_context: RayServegRPCContext) -> Any:
        return await self._oip_unary("ServerMetadata", request, grpc_context)

    async def ModelMetadata(self, request: Any, grpc_context: RayServegRPCContext) -> Any:
        return await self._oip_unary("ModelMetadata", request, grpc_context)

    async def ModelConfig(self, request: Any, grpc_context: RayServegRPCContext) -> Any:
        return await self._oip_unary("ModelConfig", request, grpc_context)

    async def ModelInfer(self, request: Any, grpc_context: RayServegRPCContext) -> Any:
        return await self._oip_unary("ModelInfer", request, grpc_context)

    async def ModelStreamInfer(
        self, requests: AsyncIterator[Any], grpc_context: RayServegRPCContext
    ) -> AsyncIterator[Any]:
        """One reply per request, in order; requests compute concurrently, a sequence's one
        after another (stream.py, as the standalone server); an error answers its request
        with error_message and the stream goes on."""
        answer = functools.partial(self._stream_one, caller=Caller.of(grpc_context))
        async for reply in pipelined(requests, answer, key=sequence_key):
            yield message(reply)

    async def _stream_one(self, request: Any, caller: Caller) -> Any:
        own_request_id()  # this message's calls run beside the others' (pipelined)
        reply = await self._oip_call("ModelStreamInfer", request, caller)
        if reply.code is None:
            return reply.response
        return stream_error(request, reply.details)

    async def _oip_unary(self, method: str, request: Any, grpc_context: RayServegRPCContext) -> Any:
        reply = await self._oip_call(method, request, Caller.of(grpc_context))
        return unary_answer(grpc_context, reply, getattr(pb, f"{method}Response"))

    async def _oip_call(self, method: str, request: Any, caller: Caller) -> Reply:
        """One call to a replica; a sequence's step to its session's replica."""
        sequence = _sequence(request) if method in ("ModelInfer", "ModelStreamInfer") else None
        if sequence is None:  # stateless, or answered by the replica's servicer
            return await forward(self._infer, method, request, caller)
        owner = client_identity(CallContext(caller))
        key = sequence_key_of(request.model_name, owner, sequence)
        if sequence.start:
            reply = await forward(self._infer, method, request, caller)
            session_id = reply.sequence_session
            # Refused before it began (bad input): the sequence before it, if any, goes on,
            # as on the standalone server; begun (and maybe ended): it replaces that one.
            if session_id is not None or not _failed(reply):
                previous = await self._directory_start.remote(key, session_id)
                if previous is not None and previous != session_id:
                    await self._close_quietly(previous, caller)
            return reply
        session_id = await self._directory_get.remote(key)
        if session_id is None:
            return Reply(
                code=grpc.StatusCode.INVALID_ARGUMENT,
                details=str(sequence.not_started(request.model_name)),
            )
        what = sequence.describe(request.model_name)
        reply = await forward(
            self._infer.options(session_id=session_id),
            method,
            request,
            caller,
            session_id,
            session_id=session_id,
            what=what,
            alive=self._alive,
        )
        if reply.sequence_session != session_id:  # ended, or its session is gone
            await self._directory_end.remote(key, session_id)
        return reply

    async def _close_quietly(self, session_id: str, caller: Caller) -> None:
        """Closes a session a new start replaced (gone already: fine)."""
        request = mha_pb.CloseSessionRequest(session_id=session_id)
        with contextlib.suppress(Exception):
            await forward(
                self._close.options(session_id=session_id), "CloseSession", request, caller
            )


def _failed(reply: Reply) -> bool:
    return reply.code is not None or bool(getattr(reply.response, "error_message", ""))


def _sequence(request: Any) -> Sequence | None:
    if isinstance(request, Malformed):
        return None
    try:
        return sequence_of(request.parameters)
    except RequestError:  # the replica's servicer answers it
        return None
