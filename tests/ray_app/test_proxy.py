"""What runs in Ray's gRPC proxy around each call (ray_app/proxy.py), on Ray's own gRPC server
class in this process, its handlers standing in for Ray's: the session a call is routed by
(from its request, a stream's first message; never the client's), health answered there,
the replica's statuses passed on, a stream's status carrier dropped, and Ray's own INTERNAL
for a replica lost mid-call made NOT_FOUND or UNAVAILABLE. No Ray cluster needed."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mha_client.api import attention_pb2 as pb
from mha_client.api import attention_pb2_grpc as pb_grpc
from mha_serve.ray_app import proxy
from mha_serve.ray_app.grpc_services import add_attention_service, add_health_service
from mha_serve.ray_app.ids import session_prefix

SESSION = session_prefix("r1") + "a" * 32
FORGED = (("session_id", "forged"),)


class FakeRay:
    """Ray's handler factory: each call records the session_id metadata its router would
    get, then answers as `behaviour` says (a Ray-style status on the context)."""

    def __init__(self) -> None:
        self.sessions: list[str] = []
        self.messages: list[str] = []
        self.behaviour = "ok"

    def factory(self, service_method: str, streaming_type):
        kind = getattr(streaming_type, "value", streaming_type)

        def session_of(context) -> str:
            metadata = dict(context.invocation_metadata())
            return metadata.get("session_id", "")

        def answer(context) -> bytes:
            if self.behaviour == "ray-failed":  # set_grpc_code_and_details after an error
                context.set_code(grpc.StatusCode.INTERNAL)
                context.set_details("ActorDiedError: The actor died unexpectedly\nTraceback ...")
                return b""
            if self.behaviour == "replica-refused":  # _set_on_grpc_context of its answer
                context.set_code(grpc.StatusCode.INTERNAL)
                context.set_details("internal error in Attend: boom")
                context.set_trailing_metadata([("request_id", "1")])
                return b""
            context.set_trailing_metadata([("request_id", "1")])
            context.set_code(grpc.StatusCode.OK)
            return pb.AttendResponse(model="mha").SerializeToString()

        if kind == "unary_unary":

            async def unary(request, context):
                self.sessions.append(session_of(context))
                return answer(context)

            return unary

        async def stream(requests, context):
            self.sessions.append(session_of(context))
            async for request in requests:
                self.messages.append(request.session_id)
                reply = answer(context)
                yield reply
                if context.code() not in (None, grpc.StatusCode.OK):
                    return

        return stream


def serving(fake: FakeRay, run):
    grpc_util = pytest.importorskip("ray.serve._private.grpc_util")

    async def main():
        server = grpc_util.gRPCGenericServer(fake.factory)
        add_attention_service(None, server)
        add_health_service(None, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                return await run(channel)
        finally:
            await server.stop(None)

    return asyncio.run(main())


def test_a_call_is_routed_by_its_session_never_the_clients():
    fake = FakeRay()

    async def run(channel):
        stub = pb_grpc.AttentionServiceStub(channel)
        await stub.Attend(pb.AttendRequest(session_id=SESSION), metadata=FORGED, timeout=30)
        await stub.Attend(pb.AttendRequest(model="mha"), metadata=FORGED, timeout=30)
        await stub.GetSession(pb.GetSessionRequest(session_id=SESSION), timeout=30)
        await stub.CreateSession(pb.CreateSessionRequest(model="mha"), metadata=FORGED, timeout=30)
        steps = [pb.AttendRequest(session_id=SESSION), pb.AttendRequest(), pb.AttendRequest()]
        replies = [r async for r in stub.StreamSession(iter(steps), metadata=FORGED, timeout=30)]
        assert len(replies) == 3

    serving(fake, run)
    assert fake.sessions == [SESSION, "", SESSION, "", SESSION]
    assert fake.messages == [SESSION, "", ""]  # the stream whole, its first message first


def test_ray_losing_the_replica_is_not_found_or_unavailable_never_internal(monkeypatch):
    fake = FakeRay()
    fake.behaviour = "ray-failed"
    alive = {"r1": False}
    monkeypatch.setattr(proxy, "replica_alive", lambda unique_id: alive[unique_id])

    async def run(channel):
        stub = pb_grpc.AttentionServiceStub(channel)
        got = []
        for request in (pb.AttendRequest(session_id=SESSION), pb.AttendRequest(model="mha")):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Attend(request, timeout=30)
            got.append((info.value.code(), info.value.details()))
        alive["r1"] = True
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Attend(pb.AttendRequest(session_id=SESSION), timeout=30)
        got.append((info.value.code(), info.value.details()))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            steps = iter([pb.AttendRequest(session_id=SESSION)])
            _ = [r async for r in stub.StreamSession(steps, timeout=30)]
        got.append((info.value.code(), info.value.details()))
        return got

    (gone, stateless, cut_off, stream) = serving(fake, run)
    assert gone[0] == grpc.StatusCode.NOT_FOUND, gone
    assert f"session {SESSION!r} is gone" in gone[1] and "ActorDiedError" in gone[1]
    assert "Traceback" not in gone[1]
    assert stateless[0] == grpc.StatusCode.UNAVAILABLE and "retry" in stateless[1], stateless
    assert cut_off[0] == grpc.StatusCode.UNAVAILABLE and "still runs: retry" in cut_off[1]
    assert stream[0] == grpc.StatusCode.UNAVAILABLE and "still runs" in stream[1], stream


def test_the_replicas_statuses_pass_unchanged_and_a_carrier_is_not_sent():
    fake = FakeRay()
    fake.behaviour = "replica-refused"

    async def run(channel):
        stub = pb_grpc.AttentionServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as unary:
            await stub.Attend(pb.AttendRequest(session_id=SESSION), timeout=30)
        received = []
        with pytest.raises(grpc.aio.AioRpcError) as stream:
            steps = iter([pb.AttendRequest(session_id=SESSION)])
            async for reply in stub.StreamSession(steps, timeout=30):
                received.append(reply)
        return unary.value, stream.value, received

    unary, stream, received = serving(fake, run)
    for error in (unary, stream):
        assert error.code() == grpc.StatusCode.INTERNAL
        assert error.details() == "internal error in Attend: boom"
    assert received == []  # the empty message that carried the status stayed in the proxy


def test_health_is_answered_in_the_proxy():
    fake = FakeRay()
    fake.behaviour = "ray-failed"  # a call that reached Ray's handler would fail

    async def run(channel):
        health = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest
        checks = [
            (await health.Check(request(service=s), timeout=30)).status
            for s in ("", "mha.v1.AttentionService", "inference.GRPCInferenceService")
        ]
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await health.Check(request(service="nope"), timeout=30)
        watch = health.Watch(request(service=""), timeout=30)
        first = await watch.read()
        watch.cancel()
        unknown = health.Watch(request(service="nope"), timeout=30)
        other = await unknown.read()
        unknown.cancel()
        return checks, info.value.code(), first.status, other.status

    checks, code, first, other = serving(fake, run)
    status = health_pb2.HealthCheckResponse
    assert checks == [status.SERVING] * 3
    assert code == grpc.StatusCode.NOT_FOUND
    assert (first, other) == (status.SERVING, status.SERVICE_UNKNOWN)
    assert fake.sessions == []  # none reached Ray's handler
