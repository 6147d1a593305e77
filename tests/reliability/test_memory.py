"""Memory growth: tens of thousands of mixed calls (Attend with and without weights, bad
requests, sessions created, stepped unary and streamed, forked, truncated and closed);
resident memory from mid-run to the end stays under a bound. The negative control runs
the same check on a server with an injected leak (tests/reliability/leak) and sees it fail."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import grpc
import numpy as np
import pytest

from mha_client.api import attention_pb2 as pb
from mha_client.api import attention_pb2_grpc as pb_grpc
from tests.helpers import ServerProcess
from tests.reliability.conftest import rss_bytes

pytestmark = pytest.mark.slow

CALLS = 20_000
CONTROL_CALLS = 2_500
CLIENTS = 16
GROWTH_BOUND = 24 * 2**20  # resident growth allowed from mid-run to the end
LEAK_BYTES = 64 * 1024  # per Attend, in the negative control
LEAK_DIR = Path(__file__).parent / "leak"


def tensor(x: np.ndarray) -> pb.Tensor:
    return pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=x.shape, data=x.tobytes())


async def mixed(target: str, calls: int, pid: int) -> tuple[dict[str, int], list[int]]:
    """`calls` RPCs in rounds of 15 by CLIENTS clients; returns the statuses counted and
    the server's resident bytes at the start, mid-run and the end."""
    rng = np.random.default_rng(0)
    x = tensor(rng.standard_normal((1, 4, 512), dtype=np.float32))
    step = tensor(rng.standard_normal((1, 4, 512), dtype=np.float32))
    bad = pb.AttendRequest(model="mha", input=tensor(np.zeros((1, 4, 100), np.float32)))
    weights = pb.AttendRequest(model="gqa", input=x, weights=pb.WeightsRequest(enabled=True))
    counts: dict[str, int] = {}
    done = [0]
    rss = [rss_bytes(pid)]

    def note(code: grpc.StatusCode) -> None:
        counts[code.name] = counts.get(code.name, 0) + 1
        done[0] += 1
        if len(rss) == 1 and done[0] >= calls // 2:
            rss.append(rss_bytes(pid))

    async def run(coro) -> object:
        try:
            reply = await coro
            note(grpc.StatusCode.OK)
            return reply
        except grpc.aio.AioRpcError as e:
            note(e.code())
            return None

    async def client(stub: pb_grpc.AttentionServiceStub) -> None:
        while done[0] < calls:
            for model in ("mha", "gqa", "mqa", "mha", "gqa", "mqa"):
                await run(stub.Attend(pb.AttendRequest(model=model, input=x)))
            await run(stub.Attend(bad))  # INVALID_ARGUMENT
            await run(stub.Attend(weights))
            session = await run(stub.CreateSession(pb.CreateSessionRequest(model="mqa")))
            if session is None:
                continue
            sid = session.session_id
            await run(stub.Attend(pb.AttendRequest(session_id=sid, input=step)))
            stream = stub.StreamSession()
            await stream.write(pb.AttendRequest(session_id=sid, input=step))
            await stream.read()
            await stream.done_writing()
            await run(stream.wait_for_connection())  # the stream counts as one call
            fork = await run(stub.ForkSession(pb.ForkSessionRequest(session_id=sid)))
            await run(stub.TruncateSession(pb.TruncateSessionRequest(session_id=sid, num_tokens=4)))
            for s in (sid, fork.session_id if fork else None):
                if s:
                    await run(stub.CloseSession(pb.CloseSessionRequest(session_id=s)))

    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.AttentionServiceStub(channel)
        await asyncio.gather(*(client(stub) for _ in range(CLIENTS)))
    rss.append(rss_bytes(pid))
    return counts, rss


def measure(tmp_path: Path, calls: int, env: dict[str, str] | None = None):
    proc = ServerProcess(env=env, log_path=tmp_path / "mha-serve.log")
    try:
        proc.wait_serving()
        counts, rss = asyncio.run(mixed(proc.target, calls, proc.proc.pid))
    finally:
        assert proc.stop() == 0, proc.log()
    return counts, rss


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def test_resident_memory_stops_growing(tmp_path):
    counts, (start, mid, end) = measure(tmp_path, CALLS)
    print(
        f"\nmemory: {sum(counts.values())} calls {counts}; RSS start {mib(start)}, mid-run "
        f"{mib(mid)}, end {mib(end)}: growth mid->end {mib(end - mid)} (bound {mib(GROWTH_BOUND)})"
    )
    assert set(counts) == {"OK", "INVALID_ARGUMENT"}, counts
    assert sum(counts.values()) >= CALLS
    assert end - mid < GROWTH_BOUND


def test_negative_control_an_injected_leak_fails_the_check(tmp_path):
    env = {
        "MHA_TEST_LEAK_BYTES": str(LEAK_BYTES),
        "PYTHONPATH": os.pathsep.join([str(LEAK_DIR), os.environ.get("PYTHONPATH", "")]),
    }
    counts, (start, mid, end) = measure(tmp_path, CONTROL_CALLS, env)
    print(
        f"\nmemory, leak of {LEAK_BYTES // 1024} KiB per Attend injected: "
        f"{sum(counts.values())} calls; RSS mid-run {mib(mid)}, end {mib(end)}: growth "
        f"{mib(end - mid)}"
    )
    assert end - mid >= GROWTH_BOUND  # the check above would have failed
