"""moves.py without a cluster, over real engines: every session of a stopping replica's
engine moves to the receivers (a refusal or a receiver that fails tries again; a session made meanwhile moves too;
one that no receiver takes stays and is reported), each freed at home only once received,
its next step there equal to the one it would have given at home; and a stream's requests
end once the replica is stopping, between two messages, never losing one already read."""

from __future__ import annotations

import asyncio

import pytest
import torch

from mha_serve.cache import SessionNotFound
from mha_serve.cache.record import read_header
from mha_serve.engine import Engine, ModelSpec
from mha_serve.engine.threads import ComputeThreads
from mha_serve.model import AttentionConfig
from mha_serve.ray_app.moves import (
    MOVES_AT_ONCE,
    NOWHERE,
    OUT_OF_TIME,
    Sent,
    Stopping,
    UntilStopping,
    move_all,
)
from mha_serve.serving import AsyncEngine
from tests.engine_calls import attend, req, torched

E = 32
SPEC = ModelSpec("m", AttentionConfig(E, 4, 2), seed=1, kv_cache_bytes=1 << 20)


def engine(prefix: str) -> Engine:
    return Engine(
        [SPEC],
        device=torch.device("cpu"),
        dtype=torch.float32,
        max_response_bytes=1 << 24,
        session_id_prefix=prefix,
    )


def tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randn(1, n, E, generator=torch.Generator().manual_seed(seed))


async def step(serving: AsyncEngine, sid: str, x: torch.Tensor) -> torch.Tensor:
    served = await serving.attend(req("m", x, session_id=sid), torched, received=0.0, deadline=None)
    return served.reply.output


def test_every_session_moves_and_answers_there_as_it_would_have_at_home():
    async def main() -> None:
        computes = [ComputeThreads(1, 1) for _ in range(3)]
        home, b, c = (AsyncEngine(engine(p), t) for p, t in zip("abc", computes, strict=True))
        receivers = {"b": b, "c": c}
        twin = engine("a")  # the same sessions, never moved: what each next step should be
        refused_once: set[str] = set()
        received: dict[str, str] = {}
        late: list[str] = []
        try:
            sids = []
            for n in range(6):
                sid = (await home.create_session("m", None, None)).session_id
                await step(home, sid, tokens(3 + n, seed=n))
                twin.receive_session(home.engine.pack_session(sid))
                sids.append(sid)

            async def send(data: bytes) -> Sent:
                sid = read_header(data, "test").session_id
                if sid not in refused_once:  # each first try refused (a receiver stopping)
                    refused_once.add(sid)
                    if len(refused_once) % 2:
                        raise RuntimeError("ActorDiedError: the receiver died")
                    return Sent(refused="stopping too")
                if not late:  # a session made while the others move moves too
                    late.append((await home.create_session("m", None, None)).session_id)
                assert sid in await home.session_ids()  # freed at home only once received
                name = "bc"[len(received) % 2]
                await receivers[name].receive_session(data, "test")
                received[sid] = name
                return Sent(replica=name)

            assert await move_all(home, send, budget_s=60.0) == (7, {})
            assert sorted(received) == sorted(sids + late)
            assert await home.session_ids() == []
            for n, sid in enumerate(sids):
                where = received[sid]
                with pytest.raises(SessionNotFound, match=f"moved to Ray Serve replica '{where}'"):
                    await home.get_session(sid)
                x = tokens(2, seed=100 + n)
                want = attend(twin, req("m", x, session_id=sid)).output
                assert torch.equal(await step(receivers[where], sid, x), want)
        finally:
            for serving, compute in zip((home, b, c), computes, strict=True):
                await serving.close()
                compute.shutdown()

    asyncio.run(main())


def test_a_session_no_replica_takes_stays_and_is_reported_with_why():
    """Refused by every receiver tried, or out of time: it stays, reported with why (what
    SequenceDirectory records for its NOT_FOUND: lost.py)."""

    async def main() -> None:
        compute = ComputeThreads(1, 1)
        home = AsyncEngine(engine("a"), compute)
        try:
            sid = (await home.create_session("m", None, None)).session_id

            async def send(data: bytes) -> Sent:
                return Sent(refused="no room")

            moved, failed = await move_all(home, send, budget_s=60.0)
            assert (moved, list(failed)) == (0, [sid])
            assert failed[sid].startswith("no replica took it: no room; no room")  # each try
            assert await home.session_ids() == [sid]  # not freed: nobody holds it elsewhere
            assert await move_all(home, send, budget_s=0.0) == (0, {sid: OUT_OF_TIME})
        finally:
            await home.close()
            compute.shutdown()

    asyncio.run(main())


def test_moves_give_up_when_no_replica_stays_or_is_coming():
    """nowhere() (leaving.none_stays): a move waiting on a send that no replica will answer
    gives up, and none is tried once it says so; the sessions stay and are reported."""

    async def main() -> None:
        compute = ComputeThreads(1, 1)
        home = AsyncEngine(engine("a"), compute)
        try:
            sids = [(await home.create_session("m", None, None)).session_id for _ in range(2)]
            entered, gone, sent = asyncio.Event(), False, []

            async def send(data: bytes) -> Sent:  # a handle call with no replica behind it
                sent.append(read_header(data, "sent").session_id)
                entered.set()
                await asyncio.Event().wait()  # never answered
                raise AssertionError("unreachable")

            moving = asyncio.create_task(move_all(home, send, 600.0, lambda: gone))
            await entered.wait()
            gone = True
            moved, failed = await asyncio.wait_for(moving, 60)  # (the budget is 600 s)
            assert (moved, failed) == (0, dict.fromkeys(sids, NOWHERE))
            assert len(sent) <= MOVES_AT_ONCE and sorted(await home.session_ids()) == sorted(sids)
            sent.clear()
            moved, failed = await move_all(home, send, 600.0, lambda: True)
            assert (moved, failed) == (0, dict.fromkeys(sids, NOWHERE))
            assert sent == []  # none tried
        finally:
            await home.close()
            compute.shutdown()

    asyncio.run(main())


def test_none_stays_after_a_grace_without_another_replica():
    from mha_serve.ray_app import leaving

    kept = leaving._running, leaving._since
    try:
        leaving._running = None
        assert not leaving.none_stays("a", 0.0)  # no news: a move is tried
        leaving.running({"a", "b"})
        assert not leaving.none_stays("a", 0.0)
        leaving.running({"b"})  # a itself is stopping: b stays
        assert not leaving.none_stays("a", 0.0)
        leaving.running(set())
        assert leaving.none_stays("a", 0.0) and not leaving.none_stays("a", 3600.0)
        leaving.running({"a"})
        assert leaving.none_stays("a", 0.0)
        leaving.running({"c"})  # a replacement runs: sessions can move there
        assert not leaving.none_stays("a", 0.0)
    finally:
        leaving._running, leaving._since = kept


def test_a_stream_ends_between_messages_once_the_replica_is_stopping():
    """Messages read are all handed on; the stop lands while the stream waits for the next
    one (held by a gate), and the stream ends, cut, without reading further."""

    async def main() -> None:
        stopping = Stopping()
        gate = asyncio.Event()
        read: list[int] = []

        async def requests():
            for i in range(5):
                if i == 2:
                    await gate.wait()  # the client is slow to send the third
                read.append(i)
                yield i

        until = UntilStopping(requests(), stopping)
        got = [await until.__anext__(), await until.__anext__()]
        waiting = asyncio.ensure_future(until.__anext__())
        await asyncio.sleep(0)  # (it waits on the gate)
        stopping.set()
        with pytest.raises(StopAsyncIteration):
            await waiting
        assert (got, read, until.cut) == ([0, 1], [0, 1], True)
        gate.set()  # the read left pending ends; what it reads is never handed on
        await asyncio.sleep(0)
        with pytest.raises(StopAsyncIteration):
            await until.__anext__()

        whole = UntilStopping(requests(), Stopping())  # not stopping: every message, uncut
        gate.set()
        assert ([i async for i in whole], whole.cut) == ([0, 1, 2, 3, 4], False)

    asyncio.run(main())
