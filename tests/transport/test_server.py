"""The server in-process on loopback: health before/after warm-up and while draining, reflection."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from mha_client.api import attention_pb2 as pb
from mha_client.api import attention_pb2_grpc as pb_grpc
from mha_serve.cache import SessionNotFound
from mha_serve.config import ServerConfig
from mha_serve.engine import ModelSpec
from mha_serve.model import AttentionConfig
from mha_serve.transport.server import SERVICE_NAME, Server, load_engine, spill_on_stop
from tests.engine_calls import attend, req
from tests.helpers import free_port

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def config(**kw) -> ServerConfig:
    kw.setdefault(
        "models", [ModelSpec("small", AttentionConfig(64, 4, 1), seed=5, max_seq_len=2048)]
    )
    return ServerConfig(host="127.0.0.1", port=free_port(), metrics_port=0, **kw)


def request(batch: int, seq_len: int) -> pb.AttendRequest:
    x = np.ones((batch, seq_len, 64), np.float16)
    return pb.AttendRequest(
        model="small", input=pb.Tensor(dtype=pb.DTYPE_FLOAT16, shape=x.shape, data=x.tobytes())
    )


async def test_not_serving_until_warm_then_serving_then_draining():
    server = Server(config(grace_period_s=30))
    await server.listen()
    target = f"127.0.0.1:{server.port}"
    async with grpc.aio.insecure_channel(target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        attention = pb_grpc.AttentionServiceStub(channel)
        for name in ("", SERVICE_NAME):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=name))
            assert reply.status == NOT_SERVING
        try:
            await attention.Attend(request(1, 4))
            raise AssertionError("Attend answered before the models were loaded")
        except grpc.aio.AioRpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE
            assert "still loading its models" in e.details()

        await server.load()
        for name in ("", SERVICE_NAME):
            assert (
                await health.Check(health_pb2.HealthCheckRequest(service=name))
            ).status == SERVING

        watch = health.Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
        assert (await watch.read()).status == SERVING
        # A call in flight (held in its forward by a gate) while the server drains completes.
        lane = server.lanes["small"].fast
        run, entered, release = lane._run_batch, threading.Event(), threading.Event()  # noqa: SLF001

        def gated(calls):
            entered.set()
            assert release.wait(30), "the test never released the forward"
            return run(calls)

        lane._run_batch = gated  # noqa: SLF001
        lane._inline = None  # noqa: SLF001 - held here, never run on the loop
        slow = asyncio.ensure_future(attention.Attend(request(6, 2048), timeout=60))  # 1.5 MiB
        assert await asyncio.to_thread(entered.wait, 30), "the call never reached its forward"
        stopping = asyncio.ensure_future(server.stop())
        assert (await watch.read()).status == NOT_SERVING
        watch.cancel()  # an open stream would hold the drain for the whole grace period
        release.set()
        reply = await slow
        assert list(reply.output.shape) == [6, 2048, 64]
        await asyncio.wait_for(stopping, 20)


async def test_drain_delay_keeps_answering_with_not_serving():
    server = Server(config(drain_delay_s=2.0))
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        check = health_pb2.HealthCheckRequest(service=SERVICE_NAME)
        stopping = asyncio.ensure_future(server.stop())
        # Still answering during the delay, so load balancers see NOT_SERVING...
        for _ in range(200):  # (bounded: the stop task flips it at its first step)
            if (reply := await health.Check(check, timeout=2)).status == NOT_SERVING:
                break
            await asyncio.sleep(0.01)
        assert reply.status == NOT_SERVING
        # ...and calls already routed here are still served.
        attention = pb_grpc.AttentionServiceStub(channel)
        assert list((await attention.Attend(request(1, 4), timeout=5)).output.shape) == [1, 4, 64]
        await asyncio.wait_for(stopping, 10)


async def test_reflection_lists_the_services():
    server = Server(config())
    await server.start()
    try:

        def services() -> list[str]:
            with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                db = ProtoReflectionDescriptorDatabase(channel)
                names = db.get_services()
                # The full API is discoverable: the Attend method and its message types.
                method = db.FindFileContainingSymbol("mha.v1.AttentionService")
                assert method.name == "mha/v1/attention.proto"
                return list(names)

        names = await asyncio.to_thread(services)
        assert {"mha.v1.AttentionService", "grpc.health.v1.Health"} <= set(names)
    finally:
        await server.stop()


async def test_port_in_use_is_a_clear_error():
    first = Server(config())
    await first.listen()
    try:
        second = Server(ServerConfig(host="127.0.0.1", port=first.port, metrics_port=0))
        try:
            await second.listen()
            raise AssertionError("a second server bound the same port")
        except OSError as e:
            assert f"127.0.0.1:{first.port}" in str(e)
            await second.stop()
    finally:
        await first.stop()


class _CallOver:
    """The part of a grpc.aio ServicerContext that _answer reads, as grpcio 1.85 shows it for
    a call whose deadline passed just before its error was answered (a race the real server
    hits only now and then: a deadline checked as gRPC's fires): no time remaining, and
    done() still false (it turns true only once a status was sent)."""

    def __init__(self) -> None:
        self.aborted: list = []

    def done(self) -> bool:
        return False

    def time_remaining(self) -> float:
        return 0.0

    async def abort(self, code, details):
        self.aborted.append(code)  # grpcio would log an ERROR (ExecuteBatchError) here
        raise grpc.aio.AbortError()


async def test_an_error_for_a_call_already_over_is_counted_not_sent():
    from mha_serve import metrics
    from mha_serve.batching import DeadlineExceeded
    from mha_serve.transport.servicer import AttentionServicer

    async def late():
        raise DeadlineExceeded("m: the deadline passed after 1 ms in the queue")

    counter = metrics.REQUESTS.labels("Attend", "m", "DEADLINE_EXCEEDED", "mha.v1")
    before = counter._value.get()  # noqa: SLF001
    context = _CallOver()
    with pytest.raises(asyncio.CancelledError):
        await AttentionServicer(max_request_bytes=1)._answer("Attend", "m", context, late)  # noqa: SLF001
    assert context.aborted == []
    assert counter._value.get() == before + 1  # noqa: SLF001


def test_a_restart_starts_when_a_spilled_session_s_ttl_ran_out_meanwhile(tmp_path):
    """A session whose TTL passes while the server is down (a restart that takes a while) is
    expired at start, saying so to its next call; the server starts and adopts the rest
    (it failed to start: counting the adopted sessions by model looked the expired one up)."""
    cache = ModelSpec("kv", AttentionConfig(64, 4, 1), seed=5, kv_cache_bytes=1 << 16)
    spill = {"session_spill_dir": str(tmp_path / "spill"), "session_spill_bytes": 1 << 20}
    first = load_engine(config(**spill, models=[cache]))
    short = first.create_session("kv", ttl_s=0.1).session_id
    kept = first.create_session("kv", ttl_s=300.0).session_id
    for sid in (short, kept):
        attend(first, req("kv", torch.ones(1, 3, 64), session_id=sid))
    spill_on_stop(first)
    time.sleep(0.3)  # the server is down longer than the short session's TTL
    second = load_engine(config(**spill, models=[cache]))
    with pytest.raises(SessionNotFound, match="expired"):
        second.get_session(short)
    assert second.get_session(kept).num_tokens == 3
    assert not list((tmp_path / "spill").glob("*.session"))  # (short's file went too)
