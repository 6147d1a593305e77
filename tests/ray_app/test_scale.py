"""A replica added while sessions step: the running sessions stay on their replicas (every
step equal to its recompute), the routers learn of the new replica, new sessions land on
it, and every cache ends empty. Then one removed while 24 sessions step from 8 threads: its
sessions move to the two that stay and none is lost, every step equal to its recompute.
(In file order: the second test scales the first one's three replicas down.)"""

from __future__ import annotations

import asyncio
import copy
import functools
import time

import grpc
import numpy as np
import pytest

from mha_client.api import attention_pb2_grpc as pb_grpc
from mha_client.sdk import Client
from mha_serve.ray_app.ids import replica_of
from tests.ray_app.cluster import deploy
from tests.ray_app.conftest import ATOL, replica_handle, replica_ids
from tests.ray_app.drivers import MODELS, TIMEOUT_S, Driver, wait_metrics_on_first_ports
from tests.ray_app.stepping import (
    OpenStream,
    Stepper,
    metric_sum,
    spread_sessions,
    stepping_through,
)

pytestmark = pytest.mark.slow

RAY_NUM_CPUS = 3  # one logical CPU per replica: room for the third
METRICS_PORTS = 4  # the replicas' metrics: base + local rank on the node (0..2, one spare)
NUM_THREADS = 8
SESSIONS_PER_THREAD = 3
STEPS_AFTER = 2  # steps per thread once scaled down (on the sessions' new replicas too)
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


def test_a_replica_removed_moves_its_sessions_and_none_is_lost(cluster, models):
    """Scaled down from 3 to 2 (Ray picks which replica stops: docs/ray.md, Scale-down)
    while 8 threads step 24 sessions spread over all three (unary steps and streams; a
    stream the stopping replica ends is reopened): every step equals its recompute,
    every session is still there afterwards with all its tokens, the two replicas that
    stay counted the removed one's sessions as moved to them and none as lost, and their
    caches end empty once the sessions close. A stream held open between two steps on
    each replica: the removed replica's ends UNAVAILABLE saying to reopen, without waiting
    for its next message (else it would hold the drain until Ray killed the replica), and
    reopened, steps on where its session moved; the others step on. The SDK's streams,
    one held on each replica the same way, step on through the scale-down with no error:
    the one the removed replica ends is reopened by the SDK itself, its step sent again
    and kept once."""
    before = replica_ids()
    assert len(before) == 3
    channel = grpc.insecure_channel(cluster.target)
    stub = pb_grpc.AttentionServiceStub(channel)
    steppers = [Stepper(stub, models, 600 + i) for i in range(NUM_THREADS)]
    spread_sessions(steppers, SESSIONS_PER_THREAD, before)
    sessions = [sid for st in steppers for sid in st.sessions]
    assert len(sessions) == NUM_THREADS * SESSIONS_PER_THREAD
    idle = Stepper(stub, models, 650)  # one session per replica, its stream held open
    spread_sessions([idle], len(before), before)
    streams = {replica_of(sid): OpenStream(idle, sid) for sid in idle.sessions}
    for stream in streams.values():
        stream.step()
    sdk_side = Stepper(stub, models, 660)  # one session per replica, an SDK stream held open
    spread_sessions([sdk_side], len(before), before)
    sdk = Client(cluster.target)
    sdk_streams = {sid: sdk.session(sid).stream() for sid in sdk_side.sessions}
    for sid, sdk_stream in sdk_streams.items():
        sdk_step(sdk_side, sid, sdk_stream)
    moved_before = metric_sum(cluster.metrics_ports, "mha_serve_sessions_moved_total")
    after = stepping_through(steppers, functools.partial(scale_to, cluster.config, 2), STEPS_AFTER)
    (removed,) = before - after
    # Ray renumbers the two left 0..1 (it stopped any of the three): /metrics moves with
    # them to the app's first ports (the counts below read every port once it has)
    wait_metrics_on_first_ports(cluster.metrics_ports, after)
    everyone = [*sessions, *idle.sessions, *sdk_side.sessions]
    on_removed = [sid for sid in everyone if replica_of(sid) == removed]
    assert len(on_removed) > 1, "the removed replica held none of the stepped sessions"
    cut = streams.pop(removed).ended()
    assert cut is not None and cut.code() == grpc.StatusCode.UNAVAILABLE, cut
    assert "reopen" in cut.details() and removed in cut.details(), cut.details()
    for stream in streams.values():
        stream.step()
        stream.close()
    idle.stream(next(s for s in idle.sessions if replica_of(s) == removed), [idle.tokens(1)])
    for sid, sdk_stream in sdk_streams.items():  # the removed replica's: reopened by the SDK
        sdk_step(sdk_side, sid, sdk_stream)
        sdk_stream.close()
    sdk.close()
    for st in (*steppers, idle, sdk_side):
        st.held()  # none lost: each still there, with every token it was sent
    moved = metric_sum(cluster.metrics_ports, "mha_serve_sessions_moved_total") - moved_before
    assert moved == len(on_removed), (moved, len(on_removed))
    lost = metric_sum(cluster.metrics_ports, "mha_serve_sessions_lost_total", "replica_killed")
    assert lost == 0
    for st in (*steppers, idle, sdk_side):
        st.close()
    channel.close()
    for replica_id in after:
        usage = replica_handle("cache_usage", replica_id).remote().result(timeout_s=TIMEOUT_S)
        assert usage == {m: (0, 0) for m in MODELS}, (replica_id, usage)


def sdk_step(st: Stepper, sid: str, stream) -> None:
    """One token through an SDK session stream, checked against the recompute of the
    session's tokens (as Stepper.check), kept in the stepper's history."""
    model, held = st.sessions[sid]
    x = st.tokens(1)
    history = np.concatenate([held, x])
    want = st.models.step(model, history, 1)
    got = stream.step(x).output.reshape(want.shape)
    np.testing.assert_allclose(got, want, atol=ATOL, err_msg=f"session {sid}")
    st.sessions[sid] = (model, history)
