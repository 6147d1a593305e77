"""A replica added while sessions step: the running sessions stay on their replicas (every
step equal to its recompute), the routers learn of the new replica, new sessions land on
it, and every cache ends empty. Then one removed: only its sessions answer NOT_FOUND.
(In file order: the second test scales the first one's three replicas down.)"""

from __future__ import annotations

import asyncio
import copy
import time

import grpc
import pytest

from mha_client.api import attention_pb2_grpc as pb_grpc
from mha_serve.ray_app.ids import replica_of
from tests.ray_app.cluster import deploy
from tests.ray_app.conftest import replica_handle, replica_ids
from tests.ray_app.drivers import MODELS, TIMEOUT_S, Driver

pytestmark = pytest.mark.slow

RAY_NUM_CPUS = 3  # one logical CPU per replica: room for the third
MAX_NEW_SESSIONS = 40  # tries to land a session on the new replica (each picks by load)


def scale_to(config: dict, num_replicas: int) -> set[str]:
    """Redeploys the config with num_replicas AttentionReplicas; their ids once all run."""
    config = copy.deepcopy(config)
    (app,) = config["applications"]
    (replica,) = [d for d in app["deployments"] if d["name"] == "AttentionReplica"]
    replica["num_replicas"] = num_replicas
    deploy(config)
    deadline = time.monotonic() + TIMEOUT_S
    while len(ids := replica_ids()) != num_replicas:
        assert time.monotonic() < deadline, f"{ids} after {TIMEOUT_S} s"
        time.sleep(0.1)
    return ids


def test_a_replica_added_under_load(cluster, models):
    before = replica_ids()
    assert len(before) == 2

    async def main() -> set[str]:
        async with grpc.aio.insecure_channel(cluster.target) as channel:
            stub = pb_grpc.AttentionServiceStub(channel)
            drivers = [Driver(stub, models, 300 + i) for i in range(8)]
            await asyncio.gather(*(d.create() for d in drivers))
            added = asyncio.Event()

            async def drive(d: Driver) -> None:
                await d.run(2)
                await added.wait()
                await d.run(4)

            running = [asyncio.create_task(drive(d)) for d in drivers]
            # The sessions step while Ray starts the third replica.
            new = await asyncio.to_thread(scale_to, cluster.config, 3) - before
            added.set()
            assert len(new) == 1, new
            fresh = Driver(stub, models, 400)
            for _ in range(MAX_NEW_SESSIONS):
                await fresh.create()
                if fresh.replicas & new:
                    break
            assert fresh.replicas & new, f"no session of {MAX_NEW_SESSIONS} on {new}"
            await fresh.run(6)
            await asyncio.gather(*running)
            for d in (*drivers, fresh):
                assert d.replicas <= before | new
                await d.close()
            return before | new

    for replica_id in asyncio.run(main()):
        usage = replica_handle("cache_usage", replica_id).remote().result(timeout_s=TIMEOUT_S)
        assert usage == {m: (0, 0) for m in MODELS}, (replica_id, usage)


def test_a_replica_removed_takes_only_its_sessions(cluster, models):
    """Scaled down from 3 to 2 (Ray picks which replica stops: docs/ray.md, Downscaling):
    the stopped replica's sessions answer NOT_FOUND saying their replica is gone, the others
    go on, every step equal to its recompute, and the remaining caches end empty."""
    before = replica_ids()
    assert len(before) == 3

    async def main() -> set[str]:
        async with grpc.aio.insecure_channel(cluster.target) as channel:
            stub = pb_grpc.AttentionServiceStub(channel)
            driver = Driver(stub, models, 500)
            for _ in range(MAX_NEW_SESSIONS):
                await driver.create()
                if driver.replicas == before:
                    break
            assert driver.replicas == before, driver.replicas
            for sid in list(driver.sessions):
                x = driver.tokens(2)
                driver.check(sid, x, await stub.Attend(driver.step_request(sid, x), timeout=60))
            after = await asyncio.to_thread(scale_to, cluster.config, 2)
            (removed,) = before - after
            for sid in list(driver.sessions):
                x = driver.tokens(1)
                call = stub.Attend(driver.step_request(sid, x), timeout=TIMEOUT_S)
                if replica_of(sid) != removed:
                    driver.check(sid, x, await call)
                    continue
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await call
                assert info.value.code() == grpc.StatusCode.NOT_FOUND, info.value
                assert "is gone" in info.value.details() and removed in info.value.details()
                del driver.sessions[sid]
            await driver.close()
            return after

    for replica_id in asyncio.run(main()):
        usage = replica_handle("cache_usage", replica_id).remote().result(timeout_s=TIMEOUT_S)
        assert usage == {m: (0, 0) for m in MODELS}, (replica_id, usage)
