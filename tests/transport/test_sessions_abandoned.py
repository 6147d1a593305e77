"""Session steps whose caller goes away while they compute, on a real in-process server.

The lane's batches are held at a gate, so each cancel or deadline lands while its step is
computing, whatever the machine's speed (a GPU computes these steps in a millisecond)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import grpc
import numpy as np
import pytest

from mha_client.api import attention_pb2 as pb
from mha_client.api import attention_pb2_grpc as pb_grpc
from mha_client.errors import MhaServeError
from mha_client.sdk import AsyncClient
from mha_serve import metrics
from tests.transport.test_sessions_server import EMBED, serving, tokens


class Gate:
    """Holds every batch of the model's fast lane until released; records its calls."""

    def __init__(self, server) -> None:
        self.lane = server.lanes["tiny"].fast
        self.run = self.lane._run_batch  # noqa: SLF001
        self.entered, self.release = threading.Event(), threading.Event()
        self.calls: list = []
        self.batches: list[int] = []  # calls per batch, in order
        self.lane._run_batch = self._gated  # noqa: SLF001
        self.lane._inline = None  # noqa: SLF001 - held here, never run on the loop

    def _gated(self, calls):
        self.calls += calls
        self.batches.append(len(calls))
        self.entered.set()
        assert self.release.wait(10)
        return self.run(calls)

    async def computing(self) -> None:
        assert await asyncio.to_thread(self.entered.wait, 10)

    def open(self) -> None:
        self.release.set()

    async def queued(self, n: int) -> None:
        """Until n calls wait in the lane's queue behind the gate (10 s at most)."""
        deadline = time.monotonic() + 10
        while len(self.lane._pending) < n:  # noqa: SLF001
            assert time.monotonic() < deadline, f"{len(self.lane._pending)} queued, not {n}"  # noqa: SLF001
            await asyncio.sleep(0.01)


@pytest.fixture
async def gated():
    server = await serving()
    gate = Gate(server)
    try:
        yield server, gate
    finally:
        gate.open()
        await server.stop()


async def num_tokens(stub, sid: str) -> int:
    return (await stub.GetSession(pb.GetSessionRequest(session_id=sid))).num_tokens


async def test_a_step_cancelled_while_computing_is_not_kept(gated):
    server, gate = gated
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.AttentionServiceStub(channel)
        sid = (await stub.CreateSession(pb.CreateSessionRequest(model="tiny"))).session_id
        call = stub.Attend(pb.AttendRequest(session_id=sid, input=tokens(5)))
        step = asyncio.ensure_future(call)
        await gate.computing()
        step.cancel()
        with pytest.raises(asyncio.CancelledError):
            await step
        deadline = time.monotonic() + 10
        while not gate.calls[0].state.cancelled:  # the server has seen the cancel
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        gate.open()
        # The next step queues behind the abandoned one, and sees the session as it was.
        reply = await stub.Attend(pb.AttendRequest(session_id=sid, input=tokens(1)))
        assert reply.session.num_tokens == 1


async def test_a_step_past_its_deadline_while_computing_is_not_kept(gated, caplog):
    """...and the server logs no error for it: the call was over before its answer."""
    server, gate = gated
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.AttentionServiceStub(channel)
        sid = (await stub.CreateSession(pb.CreateSessionRequest(model="tiny"))).session_id
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Attend(pb.AttendRequest(session_id=sid, input=tokens(5)), timeout=0.3)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert gate.entered.is_set()  # it was computing when the deadline passed
        caplog.set_level(logging.WARNING)
        gate.open()
        reply = await stub.Attend(pb.AttendRequest(session_id=sid, input=tokens(1)))
        assert reply.session.num_tokens == 1
        await asyncio.sleep(0.2)  # the abandoned step's handler has ended by now
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert not errors, [r.getMessage() for r in errors]


async def test_after_a_cancelled_step_the_sdk_stream_says_it_was_cancelled(gated):
    """The cancelled step's reply could be read as the next step's: the stream ends."""
    server, gate = gated
    x = np.ones((1, EMBED), np.float32)
    async with (
        AsyncClient(f"127.0.0.1:{server.port}") as c,
        await c.create_session("tiny") as s,
        s.stream() as stream,
    ):
        in_flight = metrics.IN_FLIGHT._value.get()  # noqa: SLF001
        step = asyncio.create_task(stream.step(x))
        await gate.computing()
        assert metrics.IN_FLIGHT._value.get() == in_flight + 1  # noqa: SLF001 (a stream step)
        step.cancel()
        with pytest.raises(asyncio.CancelledError):
            await step
        gate.open()
        for _ in range(2):  # every later step, saying why (whether the step was kept: refresh)
            with pytest.raises(MhaServeError) as err:
                await stream.step(x)
            assert err.value.code.name == "CANCELLED"
            assert "a step of this stream was cancelled" in err.value.details
            assert "session.refresh()" in err.value.details
        async with s.stream() as again:  # another stream goes on
            assert (await again.step(x)).session.num_tokens == (await s.refresh()).num_tokens


async def test_a_second_step_on_an_sdk_stream_with_one_unanswered_is_aborted(gated):
    """Two tasks stepping one AsyncSessionStream at once: the second is refused ABORTED at
    once, nothing of it sent, as the server refuses a second step of a session; the stream
    goes on. Both were written to the call and both tasks read its replies: a reply could
    reach the other task's step (a wrong output answered as OK), or the reads failed INTERNAL
    or waited for the deadline, the second step kept all the same."""
    server, gate = gated
    first, second = np.full((1, EMBED), 0.5, np.float32), np.full((1, EMBED), -2.0, np.float32)
    async with (
        AsyncClient(f"127.0.0.1:{server.port}") as c,
        await c.create_session("tiny") as s,
        s.stream(timeout=30) as stream,
    ):
        step = asyncio.create_task(stream.step(first))
        await gate.computing()
        with pytest.raises(MhaServeError) as err:
            await asyncio.wait_for(stream.step(second), 10)
        assert err.value.code.name == "ABORTED"
        assert "already has a step in flight" in err.value.details
        gate.open()
        reply = await asyncio.wait_for(step, 10)
        assert reply.session.num_tokens == 1
        again = await asyncio.wait_for(stream.step(second), 10)  # the stream goes on
        assert again.session.num_tokens == 2 and (await s.refresh()).num_tokens == 2
        async with await c.create_session("tiny") as fresh, fresh.stream() as check:
            # each reply its own step's: the same steps on another session answer the same
            assert np.array_equal((await check.step(first)).output, reply.output)
            assert np.array_equal((await check.step(second)).output, again.output)


async def test_cancelling_an_sdk_stream_close_cancels_the_task(gated):
    """close() waits for the server to end the stream (here, behind a step held at the
    gate); cancelling that wait cancels the task: it used to be swallowed."""
    server, gate = gated
    async with AsyncClient(f"127.0.0.1:{server.port}") as c, await c.create_session("tiny") as s:
        stream = s.stream()
        step = asyncio.create_task(stream.step(np.ones((1, EMBED), np.float32)))
        await gate.computing()
        closing = asyncio.create_task(stream.close())
        await asyncio.sleep(0.05)  # half-closed; the server holds the stream open
        assert not closing.done()
        closing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closing
        assert closing.cancelled()
        gate.open()
        with pytest.raises(MhaServeError):  # the call was cancelled under the step
            await step


async def test_a_second_step_of_a_session_with_one_unanswered_is_aborted_at_once(gated):
    """Whether on another unary call or a stream, while the first queues or computes: the
    answer does not depend on timing, and nothing of the refused step is kept."""
    server, gate = gated
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.AttentionServiceStub(channel)
        sid = (await stub.CreateSession(pb.CreateSessionRequest(model="tiny"))).session_id
        first = asyncio.ensure_future(
            stub.Attend(pb.AttendRequest(session_id=sid, input=tokens(3)))
        )
        await gate.computing()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Attend(pb.AttendRequest(session_id=sid, input=tokens(2)), timeout=10)
        assert err.value.code() == grpc.StatusCode.ABORTED
        assert "already has a step in flight" in err.value.details()
        stream = stub.StreamSession(timeout=10)
        await stream.write(pb.AttendRequest(session_id=sid, input=tokens(4)))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stream.read()
        assert err.value.code() == grpc.StatusCode.ABORTED
        other = (await stub.CreateSession(pb.CreateSessionRequest(model="tiny"))).session_id
        queued = asyncio.ensure_future(
            stub.Attend(pb.AttendRequest(session_id=other, input=tokens(2)))
        )
        await gate.queued(1)
        for sid_ in (sid, other):  # a step computing, or queued: not reserved yet
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.TruncateSession(pb.TruncateSessionRequest(session_id=sid_))
            assert err.value.code() == grpc.StatusCode.ABORTED
        gate.open()
        assert (await queued).session.num_tokens == 2
        assert (await first).session.num_tokens == 3
        reply = await stub.Attend(pb.AttendRequest(session_id=sid, input=tokens(1)))
        assert reply.session.num_tokens == 4  # the first step and this one, nothing else


async def test_timing_batch_size_counts_the_steps_computed_not_those_refused():
    server = await serving()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.AttentionServiceStub(channel)
            ids = [
                (
                    await stub.CreateSession(pb.CreateSessionRequest(model="tiny", max_len=4))
                ).session_id
                for _ in range(3)
            ]
            await stub.Attend(pb.AttendRequest(session_id=ids[2], input=tokens(4)))  # full
            gate = Gate(server)
            held = asyncio.ensure_future(
                stub.Attend(pb.AttendRequest(session_id=ids[0], input=tokens(1)))
            )
            await gate.computing()
            ok, refused = (
                asyncio.ensure_future(stub.Attend(pb.AttendRequest(session_id=i, input=tokens(1))))
                for i in ids[1:]
            )
            await gate.queued(2)
            gate.open()
            await held
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await refused  # past its max_len: refused when the batch reserves
            assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE
            assert gate.batches == [1, 2]  # ok and refused went to the lane together
            assert (await ok).timing.batch_size == 1
    finally:
        await server.stop()
