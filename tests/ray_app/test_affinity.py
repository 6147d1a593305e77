"""Sessions stay on their replica: many sessions stepped at once over two replicas, in random
interleavings of unary steps, streams, forks and truncates, every step equal to its full
causal recompute, every replica's cache empty at the end; then one replica is killed while
the others' sessions run: its sessions answer NOT_FOUND saying the replica is gone, the rest
go on, and new sessions land on live replicas. (Tests here run in file order: the last one
kills a replica.)"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from mha_client.api import attention_pb2 as pb
from mha_client.api import attention_pb2_grpc as pb_grpc
from tests.ray_app.conftest import replica_handle, replica_ids
from tests.ray_app.drivers import MODELS, TIMEOUT_S, Driver

pytestmark = pytest.mark.slow

NUM_CLIENTS = 12  # concurrent drivers, each with its own sessions
OPS_PER_CLIENT = 10


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
            # Sessions until both replicas hold some (a bounded number of tries: new sessions
            # go to either replica by load, and a router may learn of a replica late).
            drivers: list[Driver] = []
            by_replica: dict[str, list[Driver]] = {}
            for i in range(200):
                d = Driver(stub, models, 100 + i)
                await d.create()
                drivers.append(d)
                by_replica.setdefault(next(iter(d.replicas)), []).append(d)
                if len(drivers) >= 24 and len(by_replica) == 2:
                    break
                if len(drivers) >= 24:  # pacing for the router's next view, no assertion
                    await asyncio.sleep(0.05)
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
