"""Sessions stay on their replica: many sessions stepped at once over two replicas, in random
interleavings of unary steps, streams, forks and truncates, every step equal to its full
causal recompute, every replica's cache empty at the end; then one replica is killed while
the others' sessions run: its sessions answer NOT_FOUND saying the replica is gone, the rest
go on, and new sessions land on live replicas. (Tests here run in file order: the last one
kills a replica.)"""

from __future__ import annotations

import asyncio
import random

import grpc
import numpy as np
import pytest

from mha_client.api import attention_pb2 as pb
from mha_client.api import attention_pb2_grpc as pb_grpc
from mha_client.tensors import from_proto, to_proto
from mha_serve.ray_app.ids import replica_of
from tests.ray_app.conftest import ATOL, replica_handle, replica_ids

pytestmark = pytest.mark.slow

NUM_CLIENTS = 12  # concurrent drivers, each with its own sessions
OPS_PER_CLIENT = 10
MODELS = ("mha", "gqa", "mqa")
EMBED = 512
TIMEOUT_S = 120.0


class Driver:
    """One client's sessions, each with the tokens it should hold (raw mha.v1 stubs: what
    is tested here is the routing, whatever the SDK's shape)."""

    def __init__(self, stub: pb_grpc.AttentionServiceStub, models, seed: int) -> None:
        self.stub, self.models = stub, models
        self.rng = random.Random(seed)
        self.np = np.random.default_rng(seed)
        self.model = MODELS[seed % len(MODELS)]
        self.sessions: dict[str, np.ndarray] = {}  # id -> the tokens it holds
        self.replicas: set[str] = set()

    def tokens(self, n: int) -> np.ndarray:
        return self.np.standard_normal((n, EMBED), dtype=np.float32)

    def step_request(self, sid: str, x: np.ndarray) -> pb.AttendRequest:
        return pb.AttendRequest(session_id=sid, input=to_proto(x))

    def check(self, sid: str, x: np.ndarray, reply: pb.AttendResponse) -> None:
        history = np.concatenate([self.sessions[sid], x])
        want = self.models.step(self.model, history, len(x))
        got = from_proto(reply.output).reshape(want.shape)
        np.testing.assert_allclose(got, want, atol=ATOL, err_msg=f"session {sid}")
        self.sessions[sid] = history

    async def create(self) -> str:
        info = await self.stub.CreateSession(
            pb.CreateSessionRequest(model=self.model), timeout=TIMEOUT_S
        )
        self.sessions[info.session_id] = np.zeros((0, EMBED), np.float32)
        self.replicas.add(replica_of(info.session_id))
        return info.session_id

    async def run(self, num_ops: int) -> None:
        """num_ops random operations on this driver's sessions (forks add sessions)."""
        for _ in range(num_ops):
            sid = self.rng.choice(sorted(self.sessions))
            op = self.rng.random()
            if op < 0.4:
                x = self.tokens(self.rng.randint(1, 4))
                self.check(
                    sid, x, await self.stub.Attend(self.step_request(sid, x), timeout=TIMEOUT_S)
                )
            elif op < 0.75:
                xs = [self.tokens(1) for _ in range(self.rng.randint(1, 3))]
                requests = [self.step_request(sid if i == 0 else "", x) for i, x in enumerate(xs)]
                replies = self.stub.StreamSession(iter(requests), timeout=TIMEOUT_S)
                for x, reply in zip(xs, [r async for r in replies], strict=True):
                    self.check(sid, x, reply)
            elif op < 0.9 and len(self.sessions) < 3:
                child = await self.stub.ForkSession(
                    pb.ForkSessionRequest(session_id=sid), timeout=TIMEOUT_S
                )
                assert replica_of(child.session_id) == replica_of(sid)  # it shares sid's blocks
                self.sessions[child.session_id] = self.sessions[sid].copy()
            else:
                keep = self.rng.randint(0, len(self.sessions[sid]))
                request = pb.TruncateSessionRequest(session_id=sid, num_tokens=keep)
                assert (
                    await self.stub.TruncateSession(request, timeout=TIMEOUT_S)
                ).num_tokens == keep
                self.sessions[sid] = self.sessions[sid][:keep]
            await asyncio.sleep(0)

    async def close(self) -> None:
        for sid in self.sessions:
            await self.stub.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=TIMEOUT_S)
        self.sessions.clear()


async def expect_gone(call, sid: str) -> None:
    """The call answers NOT_FOUND saying that the session's replica is gone."""
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    assert info.value.code() == grpc.StatusCode.NOT_FOUND, info.value
    assert "is gone" in info.value.details() and sid in info.value.details(), info.value


async def first_reply(replies) -> pb.AttendResponse:
    async for reply in replies:
        return reply
    raise AssertionError("the stream ended without a reply or a status")


def wait_dead(name: str) -> None:
    """Until the named actor is dead (its name freed), within TIMEOUT_S."""
    import time

    import ray

    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            ray.get_actor(name, namespace="serve")
        except ValueError:
            return
        time.sleep(0.05)
    raise TimeoutError(f"{name} still alive {TIMEOUT_S} s after ray.kill")


def cache_usage(replica_id: str) -> dict:
    return replica_handle("cache_usage", replica_id).remote().result(timeout_s=TIMEOUT_S)


def test_sessions_stay_on_their_replica_under_load(cluster, models):
    async def main() -> set[str]:
        async with grpc.aio.insecure_channel(cluster.target) as channel:
            stub = pb_grpc.AttentionServiceStub(channel)
            drivers = [Driver(stub, models, seed) for seed in range(NUM_CLIENTS)]
            await asyncio.gather(*(d.create() for d in drivers))
            await asyncio.gather(*(d.run(OPS_PER_CLIENT) for d in drivers))
            await asyncio.gather(*(d.close() for d in drivers))
            return set().union(*(d.replicas for d in drivers))

    used = asyncio.run(main())
    assert used == replica_ids() and len(used) == 2, used  # both replicas held sessions
    for replica_id in used:
        assert cache_usage(replica_id) == {m: (0, 0) for m in MODELS}, replica_id


def test_a_killed_replicas_sessions_answer_not_found_and_the_rest_go_on(cluster, models):
    import ray

    async def main() -> None:
        async with grpc.aio.insecure_channel(cluster.target) as channel:
            stub = pb_grpc.AttentionServiceStub(channel)
            # Sessions until both replicas hold some (a bounded number of tries).
            drivers = [Driver(stub, models, 100 + i) for i in range(24)]
            for d in drivers:
                await d.create()
            by_replica: dict[str, list[Driver]] = {}
            for d in drivers:
                by_replica.setdefault(next(iter(d.replicas)), []).append(d)
            assert len(by_replica) == 2, by_replica.keys()
            doomed, kept = sorted(by_replica, key=lambda r: len(by_replica[r]))
            for d in drivers:  # one step each before the kill
                await d.run(1)

            # The kept replica's sessions step on while the other replica is killed.
            killed = asyncio.Event()

            async def keep_going(d: Driver) -> None:
                await d.run(1)
                await killed.wait()
                await d.run(3)

            running = [asyncio.create_task(keep_going(d)) for d in by_replica[kept]]
            name = f"SERVE_REPLICA::mha#AttentionReplica#{doomed}"
            ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
            await asyncio.to_thread(wait_dead, name)  # ray.kill returns before the death
            killed.set()

            for d in by_replica[doomed]:
                for sid in d.sessions:
                    x = d.tokens(1)
                    await expect_gone(d.stub.Attend(d.step_request(sid, x), timeout=TIMEOUT_S), sid)
                    request = pb.GetSessionRequest(session_id=sid)
                    await expect_gone(d.stub.GetSession(request, timeout=TIMEOUT_S), sid)
                    stream = d.stub.StreamSession(iter([d.step_request(sid, x)]), timeout=TIMEOUT_S)
                    await expect_gone(first_reply(stream), sid)
            await asyncio.gather(*running)  # every step of theirs matched its recompute

            fresh = [Driver(stub, models, 200 + i) for i in range(4)]
            await asyncio.gather(*(d.create() for d in fresh))
            await asyncio.gather(*(d.run(2) for d in fresh))
            for d in fresh:
                assert doomed not in d.replicas, d.replicas
            for d in (*by_replica[kept], *fresh):
                await d.close()

    asyncio.run(main())
    assert all(cache_usage(r) == {m: (0, 0) for m in MODELS} for r in replica_ids())
