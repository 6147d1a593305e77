"""The mha.v1.AttentionService servicer: each call handed to the door (door.py), its refusal
sent as the call's status."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

from mha_client.api import attention_pb2 as pb
from mha_client.api import attention_pb2_grpc as pb_grpc
from mha_serve import metrics
from mha_serve.serving import EngineClient, Unavailable
from mha_serve.transport.answer import answer, over, sent
from mha_serve.transport.convert import Received, parse_attend_request
from mha_serve.transport.door import AttentionDoor
from mha_serve.transport.status import STATUS_OF, status_of

T = TypeVar("T")

__all__ = ["STATUS_OF", "AttentionServicer", "Unavailable", "status_of"]


class AttentionServicer(pb_grpc.AttentionServiceServicer):
    """mha.v1 over the serving layer, through the door every host of mha.v1 shares."""

    PROTOCOL = metrics.PROTOCOL_MHA_V1

    # On a gRPC server (handlers.add_service), Attend and StreamSession requests arrive parsed
    # with a large input's bytes left in place, and large replies leave as framed bytes: one
    # copy of a tensor each way instead of protobuf's five to eight (convert.FRAME_BYTES).
    # Called with a message, they answer a message.
    request_parsers = {"Attend": parse_attend_request, "StreamSession": parse_attend_request}

    def __init__(self, *, max_request_bytes: int) -> None:
        self.door = AttentionDoor(max_request_bytes=max_request_bytes)

    @property
    def serving(self) -> EngineClient:
        return self.door.serving

    def attach(self, serving: EngineClient) -> None:
        """Starts serving: the warm engine behind its lanes."""
        self.door.attach(serving)

    async def _unary(self, method: str, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await sent(
            context, await self.door.unary(method, request, context, lambda: over(context))
        )

    async def Attend(
        self, request: pb.AttendRequest | Received, context: grpc.aio.ServicerContext
    ) -> pb.AttendResponse | bytes:
        return await self._unary("Attend", request, context)

    def StreamSession(
        self,
        requests: AsyncIterator[pb.AttendRequest | Received],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.AttendResponse | bytes]:
        """One session's steps, one per message, answered in order; the first error ends the
        stream (AttentionDoor.stream), its status sent by aborting the call. (The door's
        generator itself, not one around it: every message passes one generator less.)"""
        return self.door.stream(
            requests, context, lambda: over(context), refuse=lambda r: sent(context, r)
        )

    async def CreateSession(self, request, context) -> pb.SessionInfo:
        return await self._unary("CreateSession", request, context)

    async def GetSession(self, request, context) -> pb.SessionInfo:
        return await self._unary("GetSession", request, context)

    async def ForkSession(self, request, context) -> pb.SessionInfo:
        return await self._unary("ForkSession", request, context)

    async def TruncateSession(self, request, context) -> pb.SessionInfo:
        return await self._unary("TruncateSession", request, context)

    async def CloseSession(self, request, context) -> pb.CloseSessionResponse:
        return await self._unary("CloseSession", request, context)

    async def ListModels(self, request, context) -> pb.ListModelsResponse:
        return await self._unary("ListModels", request, context)

    async def GetModelInfo(self, request, context) -> pb.ModelInfo:
        return await self._unary("GetModelInfo", request, context)

    async def AnalyzeHeads(self, request, context) -> pb.AnalyzeHeadsResponse:
        return await self._unary("AnalyzeHeads", request, context)

    async def _answer(
        self,
        method: str,
        model: str,
        context: grpc.aio.ServicerContext,
        handle: Callable[[], Awaitable[T]],
    ) -> T:
        return await answer(method, model, context, handle, protocol=self.PROTOCOL)
