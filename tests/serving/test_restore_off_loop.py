"""A spilled session comes back off the event loop (on the compute thread, where torch
runs), for a step and for the session calls alike, and the step's timing says how long it
took (serving/async_engine.py)."""

from __future__ import annotations

import asyncio
import threading

import torch

from mha_serve.engine import Engine, ModelSpec
from mha_serve.engine.threads import ComputeThreads
from mha_serve.model import AttentionConfig
from mha_serve.serving import AsyncEngine
from mha_serve.serving.sequences import SequenceMap
from tests.engine_calls import req, torched


def spilling_engine(tmp_path) -> Engine:
    spec = ModelSpec("m", AttentionConfig(32, 4, 2), seed=1, kv_cache_bytes=1 << 20)
    return Engine(
        [spec],
        device=torch.device("cpu"),
        dtype=torch.float32,
        max_response_bytes=1 << 24,
        spill_dir=str(tmp_path),
        spill_bytes=1 << 24,
    )


def test_a_spilled_session_is_restored_on_the_compute_thread(tmp_path):
    engine = spilling_engine(tmp_path)
    threads: list[int] = []
    real = engine.restore_session

    def recorded(*args):
        threads.append(threading.get_ident())
        return real(*args)

    engine.restore_session = recorded

    async def main() -> None:
        compute = ComputeThreads(1, 1)
        serving = AsyncEngine(engine, compute)
        try:
            loop_thread = threading.get_ident()
            sid = engine.create_session("m").session_id
            x = torch.randn(1, 5, 32)
            await serving.attend(req("m", x, session_id=sid), torched, received=0.0, deadline=None)
            assert engine.spill_idle() == [sid]
            served = await serving.attend(
                req("", x[:, :1], session_id=sid), torched, received=0.0, deadline=None
            )
            assert served.timing.restore_ms > 0 and served.reply.session.num_tokens == 6
            assert engine.spill_idle() == [sid]
            assert (await serving.get_session(sid)).num_tokens == 6
            assert len(threads) == 2 and loop_thread not in threads
        finally:
            await serving.close()
            compute.shutdown()

    asyncio.run(main())


def test_pruning_the_sequence_map_leaves_spilled_sessions_on_disk(tmp_path):
    """Triton's sequence map, pruning the ids whose session is gone, asks whether each
    session lives without bringing a spilled one back: it did, one by one on the event loop
    (each restore spilling another in a full cache), and made each count as used."""
    engine = spilling_engine(tmp_path)

    async def main() -> None:
        compute = ComputeThreads(1, 1)
        serving = AsyncEngine(engine, compute)
        serving.sequences = SequenceMap(prune_at=2)
        try:
            kept = await serving.start_sequence(("m", "me", 0), "m", "me")
            gone = await serving.start_sequence(("m", "me", 1), "m", "me")
            await serving.close_session(gone)
            x = torch.randn(1, 3, 32)
            await serving.attend(req("m", x, session_id=kept), torched, received=0.0, deadline=None)
            assert engine.spill_idle() == [kept]
            await serving.start_sequence(("m", "me", 2), "m", "me")  # prunes: gone goes
            assert serving.sequences.get(("m", "me", 1)) is None
            assert serving.sequences.get(("m", "me", 0)) == kept
            assert engine.is_spilled(kept)  # still on disk
        finally:
            await serving.close()
            compute.shutdown()

    asyncio.run(main())


def test_sessions_move_between_async_engines_on_their_compute_threads():
    """AsyncEngine's moves: packed on one engine's compute thread, received on the other's,
    the next step there equal to the step the first would have given."""
    spec = ModelSpec("m", AttentionConfig(32, 4, 2), seed=1, kv_cache_bytes=1 << 20)

    def engine(prefix: str) -> Engine:
        return Engine(
            [spec],
            device=torch.device("cpu"),
            dtype=torch.float32,
            max_response_bytes=1 << 24,
            session_id_prefix=prefix,
        )

    async def main() -> None:
        home_compute, other_compute = ComputeThreads(1, 1), ComputeThreads(1, 1)
        home = AsyncEngine(engine("a-"), home_compute)
        other = AsyncEngine(engine("b-"), other_compute)
        try:
            sid = (await home.create_session("m", None, None)).session_id
            x = torch.randn(1, 9, 32)
            await home.attend(req("m", x, session_id=sid), torched, received=0.0, deadline=None)
            assert await home.session_ids() == [sid]
            moved = await other.receive_session(await home.pack_session(sid), "test")
            assert moved.num_tokens == 9
            step = req("m", x[:, :2], session_id=sid)
            want = await home.attend(step, torched, received=0.0, deadline=None)
            got = await other.attend(step, torched, received=0.0, deadline=None)
            assert torch.equal(got.reply.output, want.reply.output)
            await home.session_moved(sid, "b")
            assert await home.session_ids() == []
        finally:
            for serving, compute in ((home, home_compute), (other, other_compute)):
                await serving.close()
                compute.shutdown()

    asyncio.run(main())
