"""Graceful stop in-process, held with gates (no sleeps): once the server drains, every new
call of both doors is answered UNAVAILABLE by its handler, a stream ends UNAVAILABLE at its
next message, and the calls in flight finish with their right answers before the port
closes; only a call still running when the grace period ends is cut (CANCELLED)."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mha_client.api import attention_pb2 as pb
from mha_client.api import attention_pb2_grpc as pb_grpc
from mha_client.api.inference import grpc_service_pb2 as ip
from mha_client.api.inference import grpc_service_pb2_grpc as ip_grpc
from mha_serve.config import ServerConfig
from mha_serve.engine import ModelSpec
from mha_serve.model import AttentionConfig
from mha_serve.transport.drain import SHUTTING_DOWN
from mha_serve.transport.server import Server
from tests.helpers import free_port

EMBED = 32
WAIT_S = 30.0
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE


class Gate:
    """Holds the next batch of a model's fast lane on the compute thread until `release`."""

    def __init__(self, server: Server, model: str = "small") -> None:
        self.lane = server.lanes[model].fast
        self.entered, self._release = threading.Event(), threading.Event()
        run, self.armed = self.lane._run_batch, True  # noqa: SLF001

        def gated(calls):
            if self.armed:
                self.armed = False
                self.entered.set()
                assert self._release.wait(WAIT_S), "the test never released the batch"
            return run(calls)

        self.lane._run_batch = gated  # noqa: SLF001
        self.lane._inline = None  # noqa: SLF001 - held here, never run on the loop

    async def held(self) -> None:
        assert await asyncio.to_thread(self.entered.wait, WAIT_S), "no batch reached the gate"

    def release(self) -> None:
        self._release.set()

    async def queued(self, n: int) -> None:
        """Until n requests wait in the lane behind the held batch (polled, bounded)."""
        for _ in range(int(WAIT_S / 0.01)):
            if self.lane.queued_requests >= n:
                return
            await asyncio.sleep(0.01)
        raise TimeoutError(f"{n} requests never queued ({self.lane.queued_requests})")


def config(**kw) -> ServerConfig:
    models = [ModelSpec("small", AttentionConfig(EMBED, 4, 2), seed=3, max_queue_delay_ms=0)]
    return ServerConfig(host="127.0.0.1", port=free_port(), metrics_port=0, models=models, **kw)


def tensor(x: np.ndarray) -> pb.Tensor:
    return pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=x.shape, data=x.tobytes())


def inputs(n: int, tokens: int) -> list[np.ndarray]:
    rng = np.random.default_rng(11)
    return [rng.standard_normal((1, tokens, EMBED), dtype=np.float32) for _ in range(n)]


async def write_unless_ended(stream, message) -> None:
    """A stream's first message; a server that ends the call first (refusing it) makes the
    write raise that status, which the stream's read then says."""
    with contextlib.suppress(grpc.aio.AioRpcError):
        await stream.write(message)


async def status(call) -> tuple[grpc.StatusCode, str]:
    """The status a call (or a stream read) ends with."""
    try:
        await call
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details()
    return grpc.StatusCode.OK, ""


async def until(predicate, what: str) -> None:
    for _ in range(int(WAIT_S / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise TimeoutError(f"never: {what}")


def infer(x: np.ndarray) -> ip.ModelInferRequest:
    tensor = ip.ModelInferRequest.InferInputTensor(name="INPUT", datatype="FP32", shape=x.shape)
    return ip.ModelInferRequest(
        model_name="small", inputs=[tensor], raw_input_contents=[x.tobytes()]
    )


async def test_draining_refuses_new_calls_unavailable_and_lets_in_flight_ones_finish():
    server = Server(config(grace_period_s=WAIT_S))
    await server.start()
    x, step1, step2 = inputs(3, 4)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        v1 = pb_grpc.AttentionServiceStub(channel)
        oip = ip_grpc.GRPCInferenceServiceStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        # The right answers, computed before any of this.
        expected = (await v1.Attend(pb.AttendRequest(model="small", input=tensor(x)))).output.data
        probe = (await v1.CreateSession(pb.CreateSessionRequest(model="small"))).session_id
        first_step = (
            await v1.Attend(pb.AttendRequest(session_id=probe, input=tensor(step1)))
        ).output.data

        # An idle stream of each door, open and waiting for its next message.
        idle = v1.StreamSession()
        idle_sid = (await v1.CreateSession(pb.CreateSessionRequest(model="small"))).session_id
        await idle.write(pb.AttendRequest(session_id=idle_sid, input=tensor(step1)))
        assert (await idle.read()).output.data == first_step
        idle_oip = oip.ModelStreamInfer()
        await idle_oip.write(infer(x))
        assert not (await idle_oip.read()).error_message

        # In flight: a stream's step held in its forward, with its next step already sent,
        # and an Attend and an Open Inference Protocol stream's request queued behind it.
        gate = Gate(server)
        held = v1.StreamSession()
        held_sid = (await v1.CreateSession(pb.CreateSessionRequest(model="small"))).session_id
        await held.write(pb.AttendRequest(session_id=held_sid, input=tensor(step1)))
        await gate.held()
        await held.write(pb.AttendRequest(input=tensor(step2)))
        queued = asyncio.ensure_future(v1.Attend(pb.AttendRequest(model="small", input=tensor(x))))
        queued_oip = oip.ModelStreamInfer()
        await queued_oip.write(infer(x))
        await gate.queued(2)

        stopping = asyncio.ensure_future(server.stop())
        await until(lambda: server.drain.closed, "draining began")
        assert server.drain.in_flight == 3  # the held stream, the queued Attend and stream

        # New calls, unary and streaming, of both doors: UNAVAILABLE, saying why.
        new_stream = v1.StreamSession()
        await write_unless_ended(
            new_stream, pb.AttendRequest(session_id=idle_sid, input=tensor(step2))
        )
        new_oip_stream = oip.ModelStreamInfer()
        await write_unless_ended(new_oip_stream, infer(x))
        refused = {
            "Attend": v1.Attend(pb.AttendRequest(model="small", input=tensor(x))),
            "CreateSession": v1.CreateSession(pb.CreateSessionRequest(model="small")),
            "GetSession": v1.GetSession(pb.GetSessionRequest(session_id=held_sid)),
            "ListModels": v1.ListModels(pb.ListModelsRequest()),
            "StreamSession": new_stream.read(),
            "ModelInfer": oip.ModelInfer(infer(x)),
            "ModelMetadata": oip.ModelMetadata(ip.ModelMetadataRequest(name="small")),
            "ModelStreamInfer": new_oip_stream.read(),
            # Open streams waiting for a message end at once: nothing of theirs is running.
            "idle StreamSession": idle.read(),
            "idle ModelStreamInfer": idle_oip.read(),
        }
        for name, call in refused.items():
            assert await status(call) == (UNAVAILABLE, SHUTTING_DOWN), name
        # Health keeps answering (NOT_SERVING), and so does the Open Inference Protocol's.
        check = await health.Check(health_pb2.HealthCheckRequest())
        assert check.status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert (await oip.ServerLive(ip.ServerLiveRequest())).live
        assert not (await oip.ServerReady(ip.ServerReadyRequest())).ready
        assert not (await oip.ModelReady(ip.ModelReadyRequest(name="small"))).ready
        assert not stopping.done()  # still waiting for the calls in flight

        gate.release()
        # The held step finishes with its right answer; the step sent after it is refused
        # and never runs (the session keeps the first step's tokens only).
        assert (await held.read()).output.data == first_step
        assert await status(held.read()) == (UNAVAILABLE, SHUTTING_DOWN)
        assert server.serving.engine.get_session(held_sid).num_tokens == 4
        assert (await queued).output.data == expected
        # The stream's request read before draining is answered, then the stream ends.
        reply = await queued_oip.read()
        assert not reply.error_message and reply.infer_response.raw_output_contents[0] == expected
        assert await status(queued_oip.read()) == (UNAVAILABLE, SHUTTING_DOWN)
        await asyncio.wait_for(stopping, WAIT_S)
    assert server.drain.in_flight == 0


async def test_a_call_still_running_when_the_grace_period_ends_is_cancelled():
    server = Server(config(grace_period_s=0.0))
    await server.start()
    (x,) = inputs(1, 4)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        v1 = pb_grpc.AttentionServiceStub(channel)
        gate = Gate(server)
        held = asyncio.ensure_future(v1.Attend(pb.AttendRequest(model="small", input=tensor(x))))
        await gate.held()
        stopping = asyncio.ensure_future(server.stop())
        # No grace: gRPC cuts the call at once (grpcio 1.85 says UNAVAILABLE "Cancelling all
        # calls"); the forward it started finishes unseen.
        code, details = await status(held)
        assert code in (UNAVAILABLE, grpc.StatusCode.CANCELLED) and details != SHUTTING_DOWN
        gate.release()
        await asyncio.wait_for(stopping, WAIT_S)
