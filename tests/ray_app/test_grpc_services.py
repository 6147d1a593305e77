"""The proxy-side hook (grpc_services.forward_deadlines) on Ray's own gRPC server class, in
this process: every call's context shows the client's deadline as metadata, the Ingress
reads it (context.Caller), and a client cannot set it itself. No Ray cluster needed."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from mha_client.api import attention_pb2 as pb
from mha_client.api.inference import grpc_service_pb2 as oip_pb
from mha_serve.ray_app.context import DEADLINE_KEY, CallContext, Caller
from mha_serve.ray_app.grpc_services import add_attention_service, add_inference_service


def recording_server(seen: list[Caller]):
    grpc_util = pytest.importorskip("ray.serve._private.grpc_util")
    from ray.serve._private.proxy_request_response import gRPCStreamingType

    def factory(service_method: str, streaming_type):
        """Stands in for Ray's proxy: records what its deployments would see."""
        if streaming_type in (gRPCStreamingType.UNARY_UNARY, gRPCStreamingType.STREAM_UNARY):

            async def unary(request, context):
                seen.append(Caller.of(context))
                return b""

            return unary

        async def stream(request, context):
            seen.append(Caller.of(context))
            for _ in ():
                yield b""

        return stream

    return grpc_util.gRPCGenericServer(factory)


def test_calls_carry_their_deadline_and_only_the_proxy_sets_it():
    seen: list[Caller] = []

    async def run() -> None:
        server = recording_server(seen)
        add_attention_service(None, server)
        add_inference_service(None, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                attend = channel.unary_unary("/mha.v1.AttentionService/Attend")
                before = time.time()
                await attend(pb.AttendRequest().SerializeToString(), timeout=30)
                after = time.time()
                assert before + 29 < seen[-1].deadline <= after + 31  # gRPC rounds deadlines up
                remaining = CallContext(seen[-1]).time_remaining()
                assert remaining is not None and 0 < remaining <= 31  # (rounded up, as above)
                # no deadline: none, whatever the client claims
                forged = ((DEADLINE_KEY, str(after + 1e6)),)
                await attend(pb.AttendRequest().SerializeToString(), metadata=forged)
                assert seen[-1].deadline is None
                assert DEADLINE_KEY not in dict(seen[-1].metadata)
                assert CallContext(seen[-1]).time_remaining() is None
                # streams too, on both protocols
                infer = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer")
                request = oip_pb.ModelInferRequest(model_name="mha").SerializeToString()
                replies = [r async for r in infer(iter([request]), timeout=20, metadata=forged)]
                assert replies == [] and 0 < seen[-1].deadline - time.time() <= 21
        finally:
            await server.stop(None)

    asyncio.run(run())
    assert len(seen) == 3
