"""A redeploy (a new config version: Ray replaces every replica, one at a time) while 8
threads step 24 sessions: each stopping replica moves its sessions to a replica that stays
(some move twice: to the other old replica, then to a new one), none is lost, every step
equals its recompute, and a session keeps its owner where it moves; SequenceDirectory
killed and restarted rebuilds where the moved sessions live. Then a replica killed
outright: the sessions it held answer NOT_FOUND as before (counted lost, replica_killed),
the others step on. (In file order: the second test kills a replica the first one made.)"""

from __future__ import annotations

import copy
import time

import grpc
import pytest

from mha_client.api import attention_pb2 as pb
from mha_client.api import attention_pb2_grpc as pb_grpc
from mha_client.tensors import to_proto
from mha_serve.ray_app.ids import replica_of
from tests.ray_app.cluster import APP, deploy
from tests.ray_app.conftest import replica_handle, replica_ids
from tests.ray_app.drivers import MODELS, TIMEOUT_S, wait_metrics_on_first_ports
from tests.ray_app.stepping import Stepper, metric_sum, spread_sessions, stepping_through
from tests.ray_app.test_affinity import wait_dead

pytestmark = pytest.mark.slow

RAY_NUM_CPUS = 2  # one per replica: Ray stops an old replica before it starts a new one
METRICS_PORTS = 8  # new replicas start at the next ranks, beside the old
NUM_THREADS = 8
SESSIONS_PER_THREAD = 3
STEPS_AFTER = 2
MAX_NEW_SESSIONS = 40  # tries to land a session on the replica that survives the kill
ALICE = (("authorization", "Bearer alice-token"),)
BOB = (("authorization", "Bearer bob-token"),)
STATE: dict = {}  # what the first test leaves the second


def redeploy(config: dict) -> dict:
    """The same app under a new config version (an override no call depends on): Ray
    replaces every AttentionReplica."""
    config = copy.deepcopy(config)
    (app,) = config["applications"]
    app["args"]["overrides"]["grace_period_s"] = 7.0
    deploy(config)
    return config


def wait_replaced(before: set[str]) -> set[str]:
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        ids = replica_ids()
        if len(ids) == 2 and not ids & before:
            return ids
        assert time.monotonic() < deadline, f"{ids} after {TIMEOUT_S} s (before: {before})"
        time.sleep(0.1)


def test_a_redeploy_moves_every_session_and_keeps_their_owners(cluster, models):
    before = replica_ids()
    assert len(before) == 2
    channel = grpc.insecure_channel(cluster.target)
    stub = pb_grpc.AttentionServiceStub(channel)
    steppers = [
        Stepper(stub, models, 700 + i, metadata=ALICE if i < 2 else ()) for i in range(NUM_THREADS)
    ]
    spread_sessions(steppers, SESSIONS_PER_THREAD, before)
    quiet = Stepper(stub, models, 750)  # no call from the redeploy until the directory restarts
    quiet.step(quiet.create("gqa"))

    def change() -> set[str]:
        cluster.config = redeploy(cluster.config)
        return wait_replaced(before)

    after = stepping_through(steppers, change, STEPS_AFTER)
    for st in steppers:
        st.held()  # none lost
    # /metrics moved with the replicas' ranks to the app's first ports: what a scrape
    # configuration lists (they started at the ports after the old replicas')
    wait_metrics_on_first_ports(cluster.metrics_ports, after)
    moved = metric_sum(cluster.metrics_ports, "mha_serve_sessions_moved_total")
    assert moved >= NUM_THREADS * SESSIONS_PER_THREAD  # each moved at least once
    # Owners: alice's sessions answer alice, and bob exactly as for an unknown id.
    for sid in steppers[0].sessions:
        with pytest.raises(grpc.RpcError) as info:
            stub.GetSession(pb.GetSessionRequest(session_id=sid), timeout=TIMEOUT_S, metadata=BOB)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND, info.value
        step = pb.AttendRequest(session_id=sid, input=to_proto(steppers[0].tokens(1)))
        with pytest.raises(grpc.RpcError) as info:
            stub.Attend(step, timeout=TIMEOUT_S, metadata=BOB)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND, info.value
    steppers[0].held()
    # SequenceDirectory restarted: its map of moved sessions is rebuilt from the replicas,
    # and a session no router has looked up since it moved is found.
    import ray

    prefix = f"SERVE_REPLICA::{APP}#SequenceDirectory#"
    (directory,) = [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith(prefix)
    ]
    ray.kill(ray.get_actor(directory, namespace="serve"), no_restart=True)
    wait_dead(directory)
    quiet.held()
    quiet.step(next(iter(quiet.sessions)))
    quiet.close()
    STATE.update(steppers=steppers, channel=channel, replicas=after)


def test_a_killed_replica_loses_its_sessions_as_before(cluster, models):
    """Killed outright (no graceful stop: nothing moves): the sessions it held answer
    NOT_FOUND saying their replica (the one they lived on last) is gone, each counted lost
    (replica_killed, not move_failed) by the replica that answers; the other replica's
    sessions step on."""
    import ray

    steppers, channel, replicas = STATE["steppers"], STATE["channel"], STATE["replicas"]
    holders = {}
    for replica_id in replicas:
        holder, ids = (
            replica_handle("foreign_sessions", replica_id).remote().result(timeout_s=TIMEOUT_S)
        )
        holders.update(dict.fromkeys(ids, holder))
    # The moved sessions went to the first new replica (the second started once the last
    # old one had moved them): it dies; a few sessions made on the other one step on.
    victim = max(replicas, key=lambda r: sum(h == r for h in holders.values()))
    doomed = {sid for sid, holder in holders.items() if holder == victim}
    (survivor,) = replicas - {victim}
    fresh = Stepper(steppers[0].stub, models, 800)
    for _ in range(MAX_NEW_SESSIONS):
        if survivor in {replica_of(s) for s in fresh.sessions}:
            break
        fresh.create(MODELS[len(fresh.sessions) % len(MODELS)])
    assert survivor in {replica_of(s) for s in fresh.sessions}, fresh.sessions
    for sid in [s for s in fresh.sessions if replica_of(s) != survivor]:
        doomed.add(sid)
    steppers = [*steppers, fresh]
    assert doomed, (victim, holders)
    name = f"SERVE_REPLICA::{APP}#AttentionReplica#{victim}"
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    wait_dead(name)
    wait_replaced({victim})  # Ray started another: the routers' views have moved on
    counted_here = 0
    for st in steppers:
        for sid in list(st.sessions):
            if sid not in doomed:
                st.step(sid)
                continue
            request = pb.GetSessionRequest(session_id=sid)
            with pytest.raises(grpc.RpcError) as info:
                st.stub.GetSession(request, timeout=TIMEOUT_S, metadata=st.metadata)
            assert info.value.code() == grpc.StatusCode.NOT_FOUND, info.value
            assert "is gone" in info.value.details(), info.value.details()
            # The replica that held it last, also for a session moved there (its id names
            # the old replica it was made on)
            assert f"lived on Ray Serve replica {victim!r}" in info.value.details()
            # Answered by a live replica (not Ray failing the call on the dead one): counted.
            counted_here += "no longer running" in info.value.details()
            del st.sessions[sid]
    assert counted_here == len(doomed)  # each answered by a live replica, none by Ray
    lost = metric_sum(cluster.metrics_ports, "mha_serve_sessions_lost_total", "replica_killed")
    assert lost == len(doomed)
    # Not move_failed: the killed replica told SequenceDirectory nothing (test_one_replica.py
    # has a stopped replica that could not move its session).
    failed = metric_sum(cluster.metrics_ports, "mha_serve_sessions_lost_total", "move_failed")
    assert failed == 0
    for st in steppers:
        st.close()
    channel.close()
