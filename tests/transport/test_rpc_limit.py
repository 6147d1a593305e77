"""max_concurrent_rpcs on a real in-process server: past it, a call is refused
RESOURCE_EXHAUSTED naming the limit and counted in mha_serve_requests_total, while health
checks still answer (gRPC's own limit, which counts neither and refuses probes too, stands
GRPC_HEADROOM above it); open streams count for as long as they are open."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mha_client.api import attention_pb2 as pb
from mha_client.api import attention_pb2_grpc as pb_grpc
from mha_serve import metrics
from tests.transport.test_sessions_server import serving, tokens


def _refused_count() -> float:
    return metrics.REQUESTS.labels(
        "GetModelInfo", "unknown", "RESOURCE_EXHAUSTED", metrics.PROTOCOL_MHA_V1
    )._value.get()  # noqa: SLF001


async def test_past_the_limit_a_call_is_refused_counted_and_health_answers():
    server = await serving(max_concurrent_rpcs=2)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.AttentionServiceStub(channel)
            sid = (await stub.CreateSession(pb.CreateSessionRequest(model="tiny"))).session_id
            streams = []
            for _ in range(2):  # two open streams: the limit's two calls
                stream = stub.StreamSession()
                await stream.write(pb.AttendRequest(session_id=sid, input=tokens(1)))
                await stream.read()  # (its handler runs: it counts from here on)
                streams.append(stream)
            before = _refused_count()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.GetModelInfo(pb.GetModelInfoRequest(name="tiny"))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "2 calls at once, its max_concurrent_rpcs" in err.value.details()
            assert _refused_count() == before + 1
            health = health_pb2_grpc.HealthStub(channel)
            reply = await health.Check(health_pb2.HealthCheckRequest(service=""))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            await streams[0].done_writing()
            await streams[0].read()  # (the end of the stream: its handler has returned)
            info = await stub.GetModelInfo(pb.GetModelInfoRequest(name="tiny"))
            assert info.name == "tiny"
            await streams[1].done_writing()
    finally:
        await server.stop()
