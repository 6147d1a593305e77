"""Batching behaviours over a real channel: backpressure, deadlines, cancellation, health.

The compute thread of a lane is held by a gate wrapped around the real run_batch, so the
queue states are deterministic; everything else (server, engine, channel) is real.
"""

from __future__ import annotations

import asyncio
import threading

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mha_client.api import attention_pb2 as pb
from mha_client.api import attention_pb2_grpc as pb_grpc
from mha_serve import metrics
from mha_serve.config import ServerConfig
from mha_serve.engine import ModelSpec
from mha_serve.model import AttentionConfig
from mha_serve.transport.server import Server
from tests.helpers import free_port

WAIT_S = 10.0
# A call's deadline: long enough to reach the gate on a loaded machine (it is then held).
DEADLINE_S = 2.0


class Gate:
    """Wraps a lane's run_batch: holds it until opened and records what it computed."""

    def __init__(self, run_batch) -> None:
        self.run_batch = run_batch
        self.open = threading.Event()
        self.entered = threading.Event()
        self.seen: list[int] = []  # seq_len of each computed call: our requests' ids

    def __call__(self, calls):
        self.entered.set()
        assert self.open.wait(WAIT_S)
        self.seen += [c.inputs.shape[1] for c in calls]
        return self.run_batch(calls)


@pytest.fixture
async def gated():
    spec = ModelSpec("small", AttentionConfig(32, 4, 2), max_queue_requests=2, max_queue_delay_ms=0)
    server = Server(ServerConfig(host="127.0.0.1", port=free_port(), metrics_port=0, models=[spec]))
    await server.start()
    lane = server.lanes["small"].fast
    gate = Gate(lane._run_batch)  # noqa: SLF001 - the test's hold on the compute thread
    lane._run_batch = gate
    lane._inline = None  # noqa: SLF001 - held here, never run on the loop
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield server, gate, pb_grpc.AttentionServiceStub(channel), channel
    gate.open.set()
    await server.stop()


def request(seq_len: int) -> pb.AttendRequest:
    """seq_len doubles as the request's id in Gate.seen."""
    x = np.ones((1, seq_len, 32), np.float32)
    return pb.AttendRequest(
        model="small", input=pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=x.shape, data=x.tobytes())
    )


async def hold(gate: Gate, stub) -> asyncio.Future:
    """One call that occupies the compute thread until the gate opens."""
    first = asyncio.ensure_future(stub.Attend(request(1), timeout=WAIT_S))
    assert await asyncio.to_thread(gate.entered.wait, WAIT_S)
    return first


async def test_full_queue_is_resource_exhausted_at_once(gated):
    server, gate, stub, _ = gated
    first = await hold(gate, stub)
    queued = [asyncio.ensure_future(stub.Attend(request(n), timeout=WAIT_S)) for n in (2, 3)]
    lane = server.lanes["small"].fast
    for _ in range(100):
        if lane.queued_requests == 2:
            break
        await asyncio.sleep(0.01)
    with pytest.raises(grpc.aio.AioRpcError) as err:  # while the gate holds the lane: had it
        await stub.Attend(request(4), timeout=WAIT_S)  # queued, DEADLINE_EXCEEDED would come
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "2 requests are queued (limit 2)" in err.value.details()
    gate.open.set()
    for call in (first, *queued):
        assert (await call).output.shape[1] in (1, 2, 3)
    assert sorted(gate.seen) == [1, 2, 3]  # the refused request was never computed


async def test_expired_request_is_never_computed(gated):
    server, gate, stub, _ = gated
    first = await hold(gate, stub)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Attend(request(5), timeout=0.2)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    gate.open.set()
    await first
    assert await stub.Attend(request(6), timeout=WAIT_S)
    assert gate.seen == [1, 6]
    assert server.lanes["small"].fast.queued_requests == 0


async def test_cancelled_call_leaves_the_queue(gated):
    server, gate, stub, _ = gated
    first = await hold(gate, stub)
    call = stub.Attend(request(7), timeout=WAIT_S)
    lane = server.lanes["small"].fast
    for _ in range(100):
        if lane.queued_requests == 1:
            break
        await asyncio.sleep(0.01)
    assert lane.queued_requests == 1
    call.cancel()
    for _ in range(100):
        if lane.queued_requests == 0:
            break
        await asyncio.sleep(0.01)
    assert lane.queued_requests == 0 and lane.queued_tokens == 0
    gate.open.set()
    await first
    assert gate.seen == [1]


async def test_health_answers_during_a_long_batch(gated):
    _, gate, stub, channel = gated
    first = await hold(gate, stub)  # the batch is held at the gate until health answers
    reply = await health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(), timeout=WAIT_S
    )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    gate.open.set()
    await first


def attend_counted(code: str) -> float:
    """mha_serve_requests_total of model small's Attend calls answered `code`."""
    counter = metrics.REQUESTS.labels("Attend", "small", code, metrics.PROTOCOL_MHA_V1)
    return counter._value.get()  # noqa: SLF001


async def until_counted(before: dict[str, float]) -> None:
    """Until a call is counted under one of before's codes (its handler ends as its client
    is answered, not before it)."""
    for _ in range(int(WAIT_S / 0.01)):
        if sum(attend_counted(code) for code in before) > sum(before.values()):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the call was never counted")


async def test_a_deadline_that_passes_while_the_call_computes_is_counted_deadline_exceeded(gated):
    """gRPC cancels the handler at the deadline: the call was counted CANCELLED, though its
    client was answered DEADLINE_EXCEEDED (with frontend workers too: test_frontend_server)."""
    _, gate, stub, _ = gated
    before = {code: attend_counted(code) for code in ("DEADLINE_EXCEEDED", "CANCELLED")}
    call = asyncio.ensure_future(stub.Attend(request(1), timeout=DEADLINE_S))
    assert await asyncio.to_thread(gate.entered.wait, WAIT_S)  # computing, held
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await until_counted(before)
    assert attend_counted("DEADLINE_EXCEEDED") == before["DEADLINE_EXCEEDED"] + 1
    assert attend_counted("CANCELLED") == before["CANCELLED"]
