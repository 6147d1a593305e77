"""AttentionDoor.stream (door.py) over the real engine: a refusal handed to `refuse` (the gRPC
servicer's abort) or yielded ends the stream alike, and what a stream's messages share (its
deadline, its client) is read once from its call and is what every step gets."""

from __future__ import annotations

import asyncio
import time

import grpc
import numpy as np
import pytest
import torch

from mha_client.api import attention_pb2 as pb
from mha_serve.config import default_models
from mha_serve.engine import Engine
from mha_serve.engine.threads import ComputeThreads
from mha_serve.serving import AsyncEngine
from mha_serve.transport.answer import Refused
from mha_serve.transport.door import AttentionDoor
from tests.helpers import suite_torch_device

MODEL = "gqa"
PEER = "ipv4:127.0.0.1:4242"  # client_identity: "peer:ipv4:127.0.0.1"


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(
        default_models(), device=suite_torch_device(), dtype=torch.float32, max_response_bytes=2**28
    )


class Context:
    """The read-only half of a grpc.aio.ServicerContext that a door reads; counts the reads
    of the time remaining."""

    def __init__(self, remaining: float | None) -> None:
        self.remaining = remaining
        self.reads = 0

    def time_remaining(self) -> float | None:
        self.reads += 1
        return self.remaining

    def peer(self) -> str:
        return PEER

    def auth_context(self) -> dict:
        return {}

    def invocation_metadata(self) -> tuple:
        return ()

    def done(self) -> bool:
        return False


class Recording:
    """The real AsyncEngine, the deadline and caller of each of its attend calls recorded."""

    def __init__(self, serving: AsyncEngine) -> None:
        self.serving = serving
        self.calls: list[tuple[float | None, str | None]] = []

    def __getattr__(self, name: str):
        return getattr(self.serving, name)

    async def attend(self, request, encode, *, received, deadline, caller=None):
        self.calls.append((deadline, caller))
        return await self.serving.attend(
            request, encode, received=received, deadline=deadline, caller=caller
        )


class Refusals(list):
    """The refusals a host was handed (`refuse`), in order."""

    async def refuse(self, refused: Refused) -> None:
        self.append(refused)


def _run(engine: Engine, body) -> None:
    async def main() -> None:
        compute = ComputeThreads(1, 1)
        serving = AsyncEngine(engine, compute)
        recording = Recording(serving)
        door = AttentionDoor(max_request_bytes=1 << 26)
        door.attach(recording)
        try:
            await asyncio.wait_for(body(door, serving, recording), 120)
        finally:
            await serving.close()
            compute.shutdown()

    asyncio.run(main())


def _step(session_id: str, embed: int, seed: int, **fields) -> pb.AttendRequest:
    x = np.random.default_rng(seed).standard_normal((1, embed), dtype=np.float32)
    tensor = pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=x.shape, data=x.tobytes())
    return pb.AttendRequest(session_id=session_id, input=tensor, **fields)


async def _messages(*messages):
    for m in messages:
        yield m


async def _session(serving: AsyncEngine) -> tuple[str, int]:
    info = await serving.create_session(MODEL, None, None, "peer:ipv4:127.0.0.1")
    return info.session_id, serving.model(MODEL).spec.attention.embed_dim


@pytest.mark.parametrize("remaining", [None, 30.0])
def test_every_step_of_a_stream_gets_its_calls_deadline_and_client(engine, remaining):
    async def body(door, serving, recording):
        sid, embed = await _session(serving)
        context = Context(remaining)
        before = time.monotonic()
        steps = [_step(sid, embed, i) for i in range(3)]
        replies = [r async for r in door.stream(_messages(*steps), context)]
        after = time.monotonic()
        assert [r.session.num_tokens for r in replies] == [1, 2, 3]
        deadlines = {deadline for deadline, _ in recording.calls}
        assert {caller for _, caller in recording.calls} == {"peer:ipv4:127.0.0.1"}
        assert len(recording.calls) == 3 and len(deadlines) == 1  # the call's, one for all
        (deadline,) = deadlines
        if remaining is None:
            assert deadline is None
        else:
            assert before + remaining <= deadline <= after + remaining
        assert context.reads == 1

    _run(engine, body)


@pytest.mark.parametrize("given", [True, False])
def test_a_streams_first_refusal_ends_it_handed_to_refuse_or_yielded(engine, given):
    """The refusals of the door itself (another session named) and of the engine (a bad
    input): the same status and details either way, nothing answered after it."""

    async def body(door, serving, recording):
        sid, embed = await _session(serving)
        other, _ = await _session(serving)
        bad = _step(sid, embed, 1)
        bad.input.shape[:] = [1, embed + 1]  # the bytes no longer fill the shape
        for second, code in (
            (_step(other, embed, 1), grpc.StatusCode.INVALID_ARGUMENT),
            (bad, grpc.StatusCode.INVALID_ARGUMENT),
        ):
            refused = Refusals()
            stream = door.stream(
                _messages(_step(sid, embed, 0), second, _step(sid, embed, 2)),
                Context(None),
                refuse=refused.refuse if given else None,
            )
            answers = [r async for r in stream]
            if given:
                assert len(answers) == 1 and len(refused) == 1
            else:
                assert len(answers) == 2 and not refused
                refused = answers[1:]
            assert isinstance(answers[0], pb.AttendResponse)
            (refusal,) = refused
            assert isinstance(refusal, Refused) and refusal.code == code
            if second.session_id == other:
                assert f"names {other!r}" in refusal.details
            else:
                assert "input.data has" in refusal.details
        # the refused steps were never kept: each stream kept its first step only
        assert (await serving.get_session(sid)).num_tokens == 2

    _run(engine, body)
