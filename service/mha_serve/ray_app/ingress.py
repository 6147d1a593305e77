"""Ingress: the deployment Ray's gRPC proxy calls for every mha.v1 and health RPC.

Stateless. It forwards each unary call, and each message of a StreamSession, to
AttentionReplica through a handle carrying the session id, so that SessionRouter can pin
it: the proxy routes a stream before its first message arrives, so only this hop can read
a stream's session id. Statuses come back as data (Reply) and are set on Ray's gRPC
context, which the proxy sends to the client with the servicer's own message.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
from grpc_health.v1 import health_pb2
from ray.serve.grpc_util import RayServegRPCContext

from mha_client.api import attention_pb2 as pb
from mha_serve.ray_app.context import Caller, Reply
from mha_serve.ray_app.forward import calls, end_stream, forward, message, unary_answer
from mha_serve.ray_app.oip_ingress import InferenceIngress
from mha_serve.transport.handlers import Malformed

SERVICE = pb.DESCRIPTOR.services_by_name["AttentionService"]
# grpc.health.v1 answers SERVING for these; the Ingress runs only once the app is up.
HEALTH_SERVICES = frozenset({"", SERVICE.full_name})


class Ingress(InferenceIngress):
    """mha.v1, the Open Inference Protocol (InferenceIngress) and grpc.health.v1 over Ray
    Serve's gRPC proxy; forwards to AttentionReplica."""

    def __init__(self, replicas: Any, directory: Any) -> None:
        super().__init__(replicas, directory)
        self._call = calls(replicas, "call")
        self._step = calls(replicas, "stream_step")

    # --- unary mha.v1 ------------------------------------------------------------------

    async def Attend(self, request: Any, grpc_context: RayServegRPCContext) -> Any:
        return await self._unary("Attend", request, grpc_context)

    async def CreateSession(self, request: Any, grpc_context: RayServegRPCContext) -> Any:
        return await self._unary("CreateSession", request, grpc_context)

    async def GetSession(self, request: Any, grpc_context: RayServegRPCContext) -> Any:
        return await self._unary("GetSession", request, grpc_context)

    async def ForkSession(self, request: Any, grpc_context: RayServegRPCContext) -> Any:
        return await self._unary("ForkSession", request, grpc_context)

    async def TruncateSession(self, request: Any, grpc_context: RayServegRPCContext) -> Any:
        return await self._unary("TruncateSession", request, grpc_context)

    async def CloseSession(self, request: Any, grpc_context: RayServegRPCContext) -> Any:
        return await self._unary("CloseSession", request, grpc_context)

    async def ListModels(self, request: Any, grpc_context: RayServegRPCContext) -> Any:
        return await self._unary("ListModels", request, grpc_context)

    async def GetModelInfo(self, request: Any, grpc_context: RayServegRPCContext) -> Any:
        return await self._unary("GetModelInfo", request, grpc_context)

    async def _unary(self, method: str, request: Any, grpc_context: RayServegRPCContext) -> Any:
        session_id = getattr(request, "session_id", "")
        handle = self._call.options(session_id=session_id) if session_id else self._call
        caller = Caller.of(grpc_context)
        reply = await forward(
            handle, method, request, caller, session_id=session_id, alive=self._alive
        )
        return unary_answer(grpc_context, reply, _empty_response(method))

    # --- streamed session steps --------------------------------------------------------

    async def StreamSession(
        self, requests: AsyncIterator[Any], grpc_context: RayServegRPCContext
    ) -> AsyncIterator[Any]:
        """Each message goes to its session's replica as one stream_step, answered in order;
        the first error ends the stream with its status (AttentionServicer.StreamSession's
        rules, which the replica applies to each message)."""
        session_id, caller = "", Caller.of(grpc_context)
        async for request in requests:
            named = getattr(request, "session_id", "")
            if not session_id:
                session_id = named  # empty: the replica answers INVALID_ARGUMENT
            elif not named and not isinstance(request, Malformed):
                request.session_id = session_id
            elif named != session_id:  # the servicer's rule; the replica sees one message
                end_stream(
                    grpc_context,
                    Reply(
                        code=grpc.StatusCode.INVALID_ARGUMENT,
                        details=f"this stream steps session {session_id!r}, but a message "
                        f"names {named!r}: open one stream per session",
                    ),
                )
            handle = self._step.options(session_id=session_id) if session_id else self._step
            reply = await forward(handle, request, caller, session_id=session_id, alive=self._alive)
            if reply.code is not None:
                end_stream(grpc_context, reply)
            yield message(reply.response)

    # --- grpc.health.v1 ----------------------------------------------------------------

    async def Check(self, request: Any, grpc_context: RayServegRPCContext) -> Any:
        if request.service not in HEALTH_SERVICES:
            grpc_context.set_code(grpc.StatusCode.NOT_FOUND)
            grpc_context.set_details(f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)

    async def Watch(self, request: Any, grpc_context: RayServegRPCContext) -> AsyncIterator[Any]:
        serving = request.service in HEALTH_SERVICES
        status = health_pb2.HealthCheckResponse
        yield status(status=status.SERVING if serving else status.SERVICE_UNKNOWN)
        await asyncio.Event().wait()  # no change to report until the client leaves


def _empty_response(method: str) -> type:
    return getattr(pb, SERVICE.methods_by_name[method].output_type.name)
