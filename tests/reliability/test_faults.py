"""Faults in the forward, injected by wrapping the real module's methods: a batch whose
forward raises, and a device out-of-memory. Policy (engine/faults.py): the batch runs again
call by call, so only the poisoned call gets an error (INTERNAL; RESOURCE_EXHAUSTED for an
out-of-memory) and the rest their exact answers; session steps that failed are not kept,
and the block accounting ends where it began. Batches are formed with a gate on the compute
thread, not with sleeps."""

from __future__ import annotations

import asyncio
import threading

import grpc
import numpy as np
import pytest
import torch

from mha_client.errors import MhaServeError
from mha_client.sdk import AsyncClient
from mha_serve.config import ServerConfig
from mha_serve.engine import ModelSpec
from mha_serve.model import AttentionConfig
from mha_serve.transport.server import Server
from tests.helpers import free_port

POISON = 1234.5  # an input holding this value makes the injected forward fail
EMBED = 64
WAIT_S = 30.0


class Faults:
    """Wraps a module's forward, project, attend_cached, attend_step, decode_one and attend_padded: a gate that holds the compute
    thread, and the fault raised for a batch that holds a poisoned row."""

    def __init__(self, module: torch.nn.Module, error: type[Exception]) -> None:
        self.error = error
        self.gate = threading.Event()
        self.held = threading.Event()  # the compute thread is waiting at the gate
        self.hold_next = False
        self.batches: list[int] = []  # rows of each stateless forward, in order
        self._poisoned = threading.local()
        forward, project = module.forward, module.project
        attend_cached, attend_padded = module.attend_cached, module.attend_padded
        attend_step, decode_one = module.attend_step, module.decode_one

        def hold() -> None:
            if self.hold_next:
                self.hold_next = False
                self.held.set()
                assert self.gate.wait(WAIT_S)

        def faulty_forward(x, *args, **kw):
            hold()
            self.batches.append(x.shape[0])
            if (x == POISON).any():
                raise self.error("injected fault in the forward")
            return forward(x, *args, **kw)

        def faulty_project(x, *args, **kw):  # (forward calls it too)
            hold()
            self._poisoned.value = bool((x == POISON).any())
            return project(x, *args, **kw)

        def after_the_write(attend):  # a session step's attention, per session or batched
            def faulty(*args, **kw):  # after the K/V were written to the cache
                if getattr(self._poisoned, "value", False):
                    raise self.error("injected fault after the cache write")
                return attend(*args, **kw)

            return faulty

        def faulty_decode_one(x, *args, **kw):  # a lone decode step: project to attention
            hold()
            y = decode_one(x, *args, **kw)
            if y is not None and bool((x == POISON).any()):
                raise self.error("injected fault after the cache write")
            return y

        module.forward = faulty_forward
        module.decode_one = faulty_decode_one
        module.project = faulty_project
        module.attend_cached = after_the_write(attend_cached)
        module.attend_step = after_the_write(attend_step)
        module.attend_padded = after_the_write(attend_padded)


@pytest.fixture
async def served():
    spec = ModelSpec(
        "small", AttentionConfig(EMBED, 4, 2), seed=5, kv_cache_bytes=1 << 20, max_queue_delay_ms=0
    )
    # The tests hold the compute thread with a request: it must cross there, never run on
    # the event loop that the test's own client shares (inline_lone_requests).
    server = Server(
        ServerConfig(
            host="127.0.0.1",
            port=free_port(),
            metrics_port=0,
            models=[spec],
            inline_lone_requests=False,
        )
    )
    await server.start()
    async with AsyncClient(f"127.0.0.1:{server.port}") as client:
        yield server, client
    await server.stop()


def inputs(n: int, tokens: int) -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [rng.standard_normal((tokens, EMBED), dtype=np.float32) for _ in range(n)]


async def wait_queued(server: Server, n: int) -> None:
    """Until n requests wait in the fast lane (a condition, polled; no timing assumed)."""
    lanes = server.lanes["small"].fast
    for _ in range(int(WAIT_S / 0.01)):
        if lanes.queued_requests >= n:
            return
        await asyncio.sleep(0.01)
    raise TimeoutError(f"{n} requests never queued ({lanes.queued_requests})")


async def outcome(coro) -> tuple[grpc.StatusCode, object]:
    try:
        return grpc.StatusCode.OK, await coro
    except MhaServeError as e:
        return e.code, e.details


async def one_batch(server, faults, calls) -> list[tuple[grpc.StatusCode, object]]:
    """Holds the compute thread, queues `calls`, then lets them run as one batch."""
    faults.hold_next = True
    gate = asyncio.ensure_future(calls[0])
    await asyncio.get_running_loop().run_in_executor(None, faults.held.wait, WAIT_S)
    rest = [asyncio.ensure_future(c) for c in calls[1:]]
    await wait_queued(server, len(rest))
    faults.gate.set()
    return [await outcome(gate)] + [await outcome(r) for r in rest]


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (RuntimeError, grpc.StatusCode.INTERNAL),
        (torch.OutOfMemoryError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    ],
)
async def test_a_failing_batch_fails_only_its_poisoned_call(served, error, code):
    server, client = served
    xs = inputs(5, 4)
    expected = [(await client.attend("small", x)).output for x in xs]  # before any fault
    faults = Faults(server.serving.engine.models["small"].module, error)
    poisoned = xs[3].copy()
    poisoned[0, 0] = POISON
    calls = [client.attend("small", x) for x in xs[:3]] + [client.attend("small", poisoned)]
    calls.append(client.attend("small", xs[4]))
    results = await one_batch(server, faults, calls)
    assert faults.batches == [1, 4, 1, 1, 1, 1], faults.batches  # gate, batch, each alone
    codes = [c for c, _ in results]
    assert codes == [grpc.StatusCode.OK] * 3 + [code, grpc.StatusCode.OK]
    assert "injected fault" in results[3][1]
    for i in (0, 1, 2, 4):
        np.testing.assert_array_equal(results[i][1].output, expected[i])
    again = await client.attend("small", xs[0])  # the server goes on
    np.testing.assert_array_equal(again.output, expected[0])


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (RuntimeError, grpc.StatusCode.INTERNAL),
        (torch.OutOfMemoryError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    ],
)
async def test_a_failing_step_batch_keeps_the_others_and_leaks_no_block(served, error, code):
    server, client = served
    engine = server.serving.engine
    sessions = [await client.create_session("small") for _ in range(4)]
    for s in sessions:  # a first step each, so that the failing batch appends to a cache
        await s.step(inputs(1, 3)[0])
    used_before = engine.cache_info("small").num_blocks_used
    faults = Faults(engine.models["small"].module, error)
    xs = inputs(4, 20)  # 3 + 20 tokens: each step takes a new block
    xs[2][5, 1] = POISON
    # The gate: a stateless call holds the compute thread while the steps queue.
    gate = client.attend("small", inputs(1, 2)[0])
    calls = [gate] + [s.step(x) for s, x in zip(sessions, xs, strict=True)]
    results = await one_batch(server, faults, calls)
    codes = [c for c, _ in results[1:]]
    assert codes == [grpc.StatusCode.OK, grpc.StatusCode.OK, code, grpc.StatusCode.OK]
    tokens = [(await s.refresh()).num_tokens for s in sessions]
    assert tokens == [23, 23, 3, 23]  # the failed step was not kept
    info = engine.cache_info("small")
    held = sum([(await s.refresh()).num_blocks for s in sessions])
    assert info.num_blocks_used == held == used_before + 3  # one new block per kept step
    # The failed session steps again, alone, and is answered.
    xs[2][5, 1] = 0.0
    assert (await sessions[2].step(xs[2])).session.num_tokens == 23
    for s in sessions:
        await s.close()
    assert engine.cache_info("small").num_blocks_used == 0


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (RuntimeError, grpc.StatusCode.INTERNAL),
        (torch.OutOfMemoryError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    ],
)
async def test_a_lone_request_failing_on_the_event_loop_keeps_the_policy(error, code):
    """A lone small request runs on the event loop's thread (no crossing): a fault there is
    answered as on the compute thread (its status), a failed step is not kept, and the
    server goes on."""
    spec = ModelSpec("small", AttentionConfig(EMBED, 4, 2), seed=5, kv_cache_bytes=1 << 20)
    server = Server(ServerConfig(host="127.0.0.1", port=free_port(), metrics_port=0, models=[spec]))
    await server.start()
    try:
        async with AsyncClient(f"127.0.0.1:{server.port}") as client:
            x, session = inputs(1, 4)[0], await client.create_session("small")
            expected = (await client.attend("small", x)).output
            await session.step(x)
            Faults(server.serving.engine.models["small"].module, error)
            poisoned = x.copy()
            poisoned[1, 2] = POISON
            lane = server.lanes["small"].fast
            for call in (client.attend("small", poisoned), session.step(poisoned)):
                before = lane.num_inline
                got, details = await outcome(call)
                assert got == code and "injected fault" in details
                assert lane.num_inline == before + 1  # it ran on the loop, alone
            assert (await session.refresh()).num_tokens == 4  # the failed step not kept
            np.testing.assert_array_equal((await client.attend("small", x)).output, expected)
            assert (await session.step(x)).session.num_tokens == 8
    finally:
        await server.stop()
