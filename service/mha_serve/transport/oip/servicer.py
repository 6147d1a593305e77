"""The inference.GRPCInferenceService servicer: each call handed to the door (door.py), its
refusal sent as the call's status; a stream's requests answered concurrently (stream.py)."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

from mha_client.api.inference import grpc_service_pb2 as pb
from mha_serve.serving import EngineClient
from mha_serve.transport.answer import answer, over, sent
from mha_serve.transport.handlers import add_service
from mha_serve.transport.oip.door import PROTOCOL, InferenceDoor, sequence_key_of
from mha_serve.transport.oip.stream import pipelined, sequence_key

T = TypeVar("T")

SERVICE = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
SERVICE_NAME = SERVICE.full_name  # "inference.GRPCInferenceService"

__all__ = [
    "SERVICE",
    "SERVICE_NAME",
    "InferenceServicer",
    "add_inference_service",
    "sequence_key_of",
]


class InferenceServicer:
    """The Open Inference Protocol over the serving layer (`serving()` returns it once warm)."""

    PROTOCOL = PROTOCOL

    def __init__(self, serving: Callable[[], EngineClient | None], **options: Any) -> None:
        self.door = InferenceDoor(serving, **options)  # ready, session_ttl_s

    async def _unary(self, method: str, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await sent(
            context, await self.door.unary(method, request, context, lambda: over(context))
        )

    async def ServerLive(self, request, context) -> pb.ServerLiveResponse:
        return await self._unary("ServerLive", request, context)

    async def ServerReady(self, request, context) -> pb.ServerReadyResponse:
        return await self._unary("ServerReady", request, context)

    async def ModelReady(self, request, context) -> pb.ModelReadyResponse:
        return await self._unary("ModelReady", request, context)

    async def ServerMetadata(self, request, context) -> pb.ServerMetadataResponse:
        return await self._unary("ServerMetadata", request, context)

    async def ModelMetadata(self, request, context) -> pb.ModelMetadataResponse:
        return await self._unary("ModelMetadata", request, context)

    async def ModelConfig(self, request, context) -> pb.ModelConfigResponse:
        return await self._unary("ModelConfig", request, context)

    async def ModelInfer(self, request, context) -> pb.ModelInferResponse:
        return await self._unary("ModelInfer", request, context)

    async def ModelStreamInfer(
        self, requests: AsyncIterator[pb.ModelInferRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """One message per request, in the requests' order; requests compute concurrently
        (so they batch together), a sequence's one after another (stream.py). An error
        answers its request with error_message and the stream goes on (Triton's behaviour)."""
        answer_one = functools.partial(self.door.stream_one, context=context)
        async for reply in pipelined(requests, answer_one, key=sequence_key):
            yield reply

    async def _answer(
        self,
        method: str,
        model: str,
        context: grpc.aio.ServicerContext,
        handle: Callable[[], Awaitable[T]],
    ) -> T:
        return await answer(method, model, context, handle, protocol=PROTOCOL)


def add_inference_service(
    server: grpc.aio.Server,
    serving: Callable[[], EngineClient | None],
    *,
    ready: Callable[[], bool],
    session_ttl_s: float = 0.0,
) -> InferenceServicer:
    """Registers inference.GRPCInferenceService on `server` (lenient parsing, as mha.v1)."""
    servicer = InferenceServicer(serving, ready=ready, session_ttl_s=session_ttl_s)
    add_service(server, servicer, SERVICE, pb)
    return servicer
