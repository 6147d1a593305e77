"""Soak: many clients at once, each with its own sessions, over a real channel to an
in-process server whose small cache evicts. Random steps (unary, streamed, with weights,
some abandoned at their deadline), forks, truncates and closes; every answered step equals
the model's own full causal forward over that session's history, no other session's
tokens ever show, nothing answers INTERNAL, and the cache is empty at the end.

Bounded: SOAK_CLIENTS clients x SOAK_OPS operations, and SOAK_S seconds at most."""

from __future__ import annotations

import asyncio
import random
import time

import grpc
import numpy as np
import pytest
import torch

from mha_client.api import attention_pb2 as pb
from mha_client.api import attention_pb2_grpc as pb_grpc
from mha_client.tensors import from_proto, to_proto
from mha_serve.config import ServerConfig
from mha_serve.engine import ModelSpec
from mha_serve.model import AttentionConfig
from mha_serve.transport.server import Server
from tests.helpers import free_port

pytestmark = pytest.mark.slow

EMBED, HEADS, KV_HEADS, BLOCK = 32, 4, 2, 16
BLOCK_BYTES = 2 * BLOCK * KV_HEADS * (EMBED // HEADS) * 4
NUM_BLOCKS = 48  # 768 tokens for up to ~40 sessions of up to 96: eviction happens
MAX_LEN = 96
SOAK_CLIENTS, SOAK_OPS, SOAK_S = 8, 200, 120.0
ATOL = 1e-4  # float32, one model forward against the cached path


class Client:
    """One client's sessions and what each should hold: its history of input tokens."""

    def __init__(self, stub, model, seed: int, stats: dict) -> None:
        self.stub, self.model, self.rng = stub, model, random.Random(seed)
        self.np = np.random.default_rng(seed)
        self.history: dict[str, np.ndarray] = {}
        self.stats = stats

    def count(self, what: str) -> None:
        self.stats[what] = self.stats.get(what, 0) + 1

    def reference(self, x: np.ndarray, new: int, weights: bool = False):
        """The model's full causal forward over x (S, E): the last `new` rows."""
        with torch.inference_mode():
            out = self.model(torch.from_numpy(x)[None], causal=True, need_weights=weights)
        w = None if out.weights is None else out.weights[0, :, -new:].numpy()
        return out.output[0, -new:].numpy(), w

    def gone(self, sid: str, err: grpc.aio.AioRpcError) -> bool:
        """An evicted session (the only way one of ours may vanish): forget it."""
        if err.code() == grpc.StatusCode.NOT_FOUND:
            assert "evicted" in err.details(), err.details()
            del self.history[sid]
            self.count("evicted")
            return True
        return False

    def refused(self, err: grpc.aio.AioRpcError) -> bool:
        """Refusals a small cache and max_len give; nothing of the step was kept."""
        if err.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.OUT_OF_RANGE):
            self.count(err.code().name)
            return True
        return False

    def check(self, sid: str, x: np.ndarray, reply: pb.AttendResponse, weights=False) -> None:
        past = self.history[sid]
        full = np.concatenate([past, x])
        want, want_w = self.reference(full, len(x), weights)
        np.testing.assert_allclose(from_proto(reply.output), want, atol=ATOL)
        if weights:
            np.testing.assert_allclose(from_proto(reply.attention_weights), want_w, atol=ATOL)
        assert reply.session.num_tokens == len(full)
        self.history[sid] = full

    async def step(self, sid: str, weights: bool = False) -> None:
        x = self.np.standard_normal((self.rng.randint(1, 8), EMBED), dtype=np.float32)
        request = pb.AttendRequest(
            session_id=sid, input=to_proto(x), weights=pb.WeightsRequest(enabled=weights)
        )
        try:
            reply = await self.stub.Attend(request, timeout=30)
        except grpc.aio.AioRpcError as err:
            assert self.gone(sid, err) or self.refused(err), (err.code(), err.details())
            return
        self.check(sid, x, reply, weights)
        self.count("weights step" if weights else "step")

    async def stream(self, sid: str) -> None:
        call = self.stub.StreamSession(timeout=30)
        try:
            for _ in range(self.rng.randint(2, 6)):
                x = self.np.standard_normal((1, EMBED), dtype=np.float32)
                await call.write(pb.AttendRequest(session_id=sid, input=to_proto(x)))
                reply = await call.read()
                assert reply is not grpc.aio.EOF
                self.check(sid, x, reply)
                self.count("streamed step")
            await call.done_writing()
            assert await call.read() is grpc.aio.EOF
        except grpc.aio.AioRpcError as err:  # the first error ends the stream
            assert self.gone(sid, err) or self.refused(err), (err.code(), err.details())

    async def abandoned_step(self, sid: str) -> None:
        """A step whose deadline may pass anywhere: queued, computing, or after it was kept.
        The session then holds it entirely or not at all."""
        x = self.np.standard_normal((self.rng.randint(1, 8), EMBED), dtype=np.float32)
        try:
            reply = await self.stub.Attend(
                pb.AttendRequest(session_id=sid, input=to_proto(x)), timeout=0.002
            )
        except grpc.aio.AioRpcError as err:
            if err.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                assert self.gone(sid, err) or self.refused(err), (err.code(), err.details())
                return
        else:
            self.check(sid, x, reply)
            return
        await asyncio.sleep(0.2)  # a step still computing is settled by now
        try:
            held = (await self.stub.GetSession(pb.GetSessionRequest(session_id=sid))).num_tokens
        except grpc.aio.AioRpcError as err:
            assert self.gone(sid, err), (err.code(), err.details())
            return
        before = len(self.history[sid])
        assert held in (before, before + len(x)), (held, before, len(x))
        if held > before:  # kept, its reply lost: the documented recovery is a truncate
            await self.stub.TruncateSession(
                pb.TruncateSessionRequest(session_id=sid, num_tokens=before)
            )
        self.count("abandoned kept" if held > before else "abandoned dropped")

    async def run(self, deadline: float) -> None:
        ops = ["create", "step", "step", "stream", "weights", "abandon", "fork", "truncate"]
        ops += ["close"]
        for _ in range(SOAK_OPS):
            if time.monotonic() > deadline:
                break
            op = self.rng.choice(ops) if self.history else "create"
            if op == "create":
                info = await self.stub.CreateSession(
                    pb.CreateSessionRequest(model="tiny", max_len=MAX_LEN)
                )
                self.history[info.session_id] = np.zeros((0, EMBED), np.float32)
                continue
            sid = self.rng.choice(list(self.history))
            try:
                if op == "step":
                    await self.step(sid)
                elif op == "weights":
                    await self.step(sid, weights=True)
                elif op == "stream":
                    await self.stream(sid)
                elif op == "abandon":
                    await self.abandoned_step(sid)
                elif op == "fork":
                    child = await self.stub.ForkSession(pb.ForkSessionRequest(session_id=sid))
                    assert child.num_tokens == len(self.history[sid])
                    self.history[child.session_id] = self.history[sid].copy()
                elif op == "truncate":
                    n = self.rng.randint(0, len(self.history[sid]))
                    info = await self.stub.TruncateSession(
                        pb.TruncateSessionRequest(session_id=sid, num_tokens=n)
                    )
                    assert info.num_tokens == n
                    self.history[sid] = self.history[sid][:n]
                else:
                    await self.stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
                    del self.history[sid]
            except grpc.aio.AioRpcError as err:
                assert self.gone(sid, err), (op, err.code(), err.details())

    async def close_all(self) -> None:
        for sid in list(self.history):
            try:
                await self.stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
            except grpc.aio.AioRpcError as err:
                assert self.gone(sid, err), (err.code(), err.details())


async def test_many_clients_with_sessions_under_eviction_stay_exact_and_leave_nothing():
    spec = ModelSpec(
        "tiny",
        AttentionConfig(EMBED, HEADS, KV_HEADS),
        kv_cache_bytes=NUM_BLOCKS * BLOCK_BYTES,
        max_seq_len=MAX_LEN,
    )
    cfg = ServerConfig(
        host="127.0.0.1",
        port=free_port(),
        metrics_port=0,
        models=[spec],
        evict_idle_sessions=True,
    )
    server = Server(cfg)
    await server.start()
    stats: dict[str, int] = {}
    try:
        model = server.serving.engine.get("tiny").module
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.AttentionServiceStub(channel)
            clients = [Client(stub, model, seed, stats) for seed in range(SOAK_CLIENTS)]
            deadline = time.monotonic() + SOAK_S
            await asyncio.gather(*(c.run(deadline) for c in clients))
            await asyncio.gather(*(c.close_all() for c in clients))
            cache = server.serving.engine.cache_info("tiny")
            assert cache.num_blocks_used == 0 and cache.num_sessions == 0
    finally:
        await server.stop()
    print("soak:", stats)
    # The soak exercised what it claims to (a run that never evicts proves less).
    assert stats.get("step", 0) > 20 and stats.get("streamed step", 0) > 20, stats
    assert stats.get("evicted", 0) > 0 and stats.get("weights step", 0) > 0, stats
