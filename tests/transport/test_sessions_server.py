"""Sessions under a small cache budget over a real channel: refusal, eviction, TTL, batching."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import numpy as np
import pytest

from mha_client.api import attention_pb2 as pb
from mha_client.api import attention_pb2_grpc as pb_grpc
from mha_serve.config import ServerConfig
from mha_serve.engine import ModelSpec
from mha_serve.model import AttentionConfig
from mha_serve.transport.server import Server
from tests.helpers import free_port

EMBED = 32
# 2 (K, V) x 16 tokens x 2 KV heads x 8 dims x 4 bytes = 2 KiB per block; 4 blocks.
BLOCK_BYTES = 2 * 16 * 2 * 8 * 4


async def serving(*, clock=time.monotonic, sweep_s: float | None = None, **server_kw):
    spec = ModelSpec("tiny", AttentionConfig(EMBED, 4, 2), kv_cache_bytes=4 * BLOCK_BYTES)
    cfg = ServerConfig(
        host="127.0.0.1", port=free_port(), metrics_port=0, models=[spec], **server_kw
    )
    server = Server(cfg, clock=clock)
    if sweep_s is not None:
        server.session_sweep_s = sweep_s
    await server.start()
    return server


def tokens(n: int, seed: int = 0) -> pb.Tensor:
    x = np.random.default_rng(seed).standard_normal((n, EMBED), dtype=np.float32)
    return pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=list(x.shape), data=x.tobytes())


async def used_blocks(stub) -> int:
    info = await stub.GetModelInfo(pb.GetModelInfoRequest(name="tiny"))
    return info.kv_cache.num_blocks_used


async def test_full_cache_refuses_without_touching_other_sessions():
    server = await serving()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.AttentionServiceStub(channel)
            a = (await stub.CreateSession(pb.CreateSessionRequest(model="tiny"))).session_id
            b = (await stub.CreateSession(pb.CreateSessionRequest(model="tiny"))).session_id
            await stub.Attend(pb.AttendRequest(session_id=a, input=tokens(40)))  # 3 blocks
            before = await stub.Attend(pb.AttendRequest(session_id=b, input=tokens(10, 1)))  # 1
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Attend(pb.AttendRequest(session_id=b, input=tokens(10, 2)))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "block" in err.value.details()
            assert (await stub.GetSession(pb.GetSessionRequest(session_id=a))).num_tokens == 40
            assert (await stub.GetSession(pb.GetSessionRequest(session_id=b))).num_tokens == 10
            assert before.session.num_tokens == 10
            assert await used_blocks(stub) == 4
            info = await stub.GetModelInfo(pb.GetModelInfoRequest(name="tiny"))
            assert info.kv_cache.num_sessions == 2 and info.kv_cache.num_blocks == 4
            for sid in (a, b):
                await stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
            assert await used_blocks(stub) == 0  # accounting returns to zero
            info = await stub.GetModelInfo(pb.GetModelInfoRequest(name="tiny"))
            assert info.kv_cache.num_sessions == 0
    finally:
        await server.stop()


async def test_eviction_frees_the_least_recently_used_idle_session():
    server = await serving(evict_idle_sessions=True)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.AttentionServiceStub(channel)
            ids = [
                (await stub.CreateSession(pb.CreateSessionRequest(model="tiny"))).session_id
                for _ in range(3)
            ]
            for i, sid in enumerate(ids[:2]):
                await stub.Attend(
                    pb.AttendRequest(session_id=sid, input=tokens(30, i))
                )  # 2 blocks each
            await stub.Attend(
                pb.AttendRequest(session_id=ids[1], input=tokens(1, 9))
            )  # ids[0] is now LRU
            await stub.Attend(
                pb.AttendRequest(session_id=ids[2], input=tokens(20, 3))
            )  # needs 2 blocks
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.GetSession(pb.GetSessionRequest(session_id=ids[0]))
            assert (
                err.value.code() == grpc.StatusCode.NOT_FOUND and "evicted" in err.value.details()
            )
            assert (await stub.GetSession(pb.GetSessionRequest(session_id=ids[1]))).num_tokens == 31
    finally:
        await server.stop()


async def test_idle_sessions_expire_after_their_ttl():
    """The sessions' clock is the test's: the TTL passes when the test says so, and the
    sweeper (every 10 ms here) frees the session without any lookup of it."""
    now = [1000.0]
    server = await serving(session_ttl_s=30, clock=lambda: now[0], sweep_s=0.01)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.AttentionServiceStub(channel)
            sid = (await stub.CreateSession(pb.CreateSessionRequest(model="tiny"))).session_id
            await stub.Attend(pb.AttendRequest(session_id=sid, input=tokens(20)))
            assert await used_blocks(stub) == 2
            for _ in range(20):  # sweeps within the TTL keep it
                await asyncio.sleep(0.01)
            assert await used_blocks(stub) == 2
            now[0] += 31  # idle past its TTL of 30 s
            for _ in range(500):  # a bounded wait for the next sweep (GetModelInfo looks
                if await used_blocks(stub) == 0:  # up no session)
                    break
                await asyncio.sleep(0.01)
            assert await used_blocks(stub) == 0  # freed by the sweep, without a lookup
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Attend(pb.AttendRequest(session_id=sid, input=tokens(1)))
            assert (
                err.value.code() == grpc.StatusCode.NOT_FOUND and "expired" in err.value.details()
            )
    finally:
        await server.stop()


async def test_steps_of_many_sessions_share_one_forward():
    server = await serving()
    lane = server.lanes["tiny"].fast
    run, release, entered = lane._run_batch, threading.Event(), threading.Event()  # noqa: SLF001
    sizes: list[int] = []

    def gated(calls):
        entered.set()
        assert release.wait(10)
        sizes.append(len(calls))
        return run(calls)

    lane._run_batch = gated
    lane._inline = None  # noqa: SLF001 - held here, never run on the loop
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.AttentionServiceStub(channel)
            ids = [
                (await stub.CreateSession(pb.CreateSessionRequest(model="tiny"))).session_id
                for _ in range(4)
            ]
            first = asyncio.ensure_future(
                stub.Attend(pb.AttendRequest(session_id=ids[0], input=tokens(3)))
            )
            assert await asyncio.to_thread(entered.wait, 10)  # the lane is busy with one step
            rest = [
                asyncio.ensure_future(
                    stub.Attend(pb.AttendRequest(session_id=s, input=tokens(1, i)))
                )
                for i, s in enumerate(ids[1:])
            ]
            while lane.queued_requests < 3:
                await asyncio.sleep(0.01)
            release.set()
            replies = [await first, *[await r for r in rest]]
            assert sizes == [1, 3]  # the three waiting steps ran as one batched forward
            assert [r.timing.batch_size for r in replies] == [1, 3, 3, 3]
            assert [r.session.num_tokens for r in replies] == [3, 1, 1, 1]
    finally:
        release.set()
        await server.stop()


async def test_concurrent_streams_batched_together_each_equal_their_own_recompute():
    """Eight streams step at once (their steps batch, their blocks interleave in the pool);
    every reply equals a causal Attend of that session's whole sequence."""
    server = Server(
        ServerConfig(
            host="127.0.0.1",
            port=free_port(),
            metrics_port=0,
            models=[
                ModelSpec("tiny", AttentionConfig(EMBED, 4, 2), kv_cache_bytes=256 * BLOCK_BYTES)
            ],
        )
    )
    await server.start()
    rng = np.random.default_rng(7)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.AttentionServiceStub(channel)

            async def decode(i: int) -> tuple[np.ndarray, list[np.ndarray]]:
                sid = (await stub.CreateSession(pb.CreateSessionRequest(model="tiny"))).session_id
                chunks = [
                    rng.standard_normal((n, EMBED), dtype=np.float32)
                    for n in (5, 1, 3, 1, 1, 17, 1, 2)
                ]
                call = stub.StreamSession()
                outs = []
                for x in chunks:
                    await call.write(
                        pb.AttendRequest(
                            session_id=sid,
                            input=pb.Tensor(
                                dtype=pb.DTYPE_FLOAT32, shape=list(x.shape), data=x.tobytes()
                            ),
                        )
                    )
                    reply = await call.read()
                    outs.append(np.frombuffer(reply.output.data, np.float32).reshape(x.shape))
                await call.done_writing()
                await stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
                return np.concatenate(chunks), outs

            results = await asyncio.gather(*(decode(i) for i in range(8)))
            for seq, outs in results:
                full = await stub.Attend(
                    pb.AttendRequest(
                        model="tiny",
                        input=pb.Tensor(
                            dtype=pb.DTYPE_FLOAT32, shape=list(seq.shape), data=seq.tobytes()
                        ),
                        causal=True,
                    )
                )
                want = np.frombuffer(full.output.data, np.float32).reshape(seq.shape)
                np.testing.assert_allclose(np.concatenate(outs), want, atol=1e-5, rtol=1e-5)
            assert await used_blocks(stub) == 0
    finally:
        await server.stop()


async def test_a_bfloat16_cache_is_reported_and_steps_stay_close_to_recompute():
    """kv_cache_dtype = bfloat16 on a float32 model: ModelInfo says so, a token costs half
    the bytes, and streamed steps agree with a float32 causal Attend (tolerance as in
    tests/engine/test_kv_cache_dtype.py: 1e-2 of max |output|)."""
    spec = ModelSpec(
        "tiny",
        AttentionConfig(EMBED, 4, 2),
        kv_cache_bytes=4 * BLOCK_BYTES,
        kv_cache_dtype="bfloat16",
    )
    server = Server(ServerConfig(host="127.0.0.1", port=free_port(), metrics_port=0, models=[spec]))
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.AttentionServiceStub(channel)
            info = (await stub.GetModelInfo(pb.GetModelInfoRequest(name="tiny"))).kv_cache
            assert info.dtype == pb.DTYPE_BFLOAT16 and info.bytes_per_token == BLOCK_BYTES // 32
            assert info.num_blocks == 8  # the float32 budget of 4 blocks holds 8 in bfloat16
            sid = (await stub.CreateSession(pb.CreateSessionRequest(model="tiny"))).session_id
            x = np.random.default_rng(3).standard_normal((20, EMBED), dtype=np.float32)
            call = stub.StreamSession()
            outs = []
            for lo, hi in ((0, 12), *((t, t + 1) for t in range(12, 20))):
                await call.write(pb.AttendRequest(session_id=sid, input=tokens_of(x[lo:hi])))
                reply = await call.read()
                assert reply.output.dtype == pb.DTYPE_FLOAT32
                outs.append(np.frombuffer(reply.output.data, np.float32).reshape(hi - lo, EMBED))
            await call.done_writing()
            full = await stub.Attend(
                pb.AttendRequest(model="tiny", input=tokens_of(x), causal=True)
            )
            want = np.frombuffer(full.output.data, np.float32).reshape(x.shape)
            err = np.abs(np.concatenate(outs) - want).max()
            assert 0 < err <= 1e-2 * np.abs(want).max(), f"max error {err:.2e}"
    finally:
        await server.stop()


def tokens_of(x: np.ndarray) -> pb.Tensor:
    return pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=list(x.shape), data=x.tobytes())
