"""One hop through Ray Serve's real gRPC proxy (deploy/ray/serve_config.yaml): no Ingress
deployment; a session's unary calls and streams reach the replica that holds it and no
other (each replica's own request counters say so), every step equal to its full causal
recompute; Watch answered by the proxy; a replica killed while its session's stream is
open: the stream answers NOT_FOUND saying so, and another replica's open stream goes on.
Then the same over Ray's own road for stream messages (`direct_streams: false`). (In file
order: the kills come last on each road.)"""

from __future__ import annotations

import asyncio
import collections
import copy
import os
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mha_client.api import attention_pb2 as pb
from mha_client.api import attention_pb2_grpc as pb_grpc
from mha_client.sdk import Client
from mha_serve.ray_app.ids import replica_of
from tests.helpers import free_ports
from tests.ray_app.cluster import APP, deploy
from tests.ray_app.conftest import replica_handle, replica_ids
from tests.ray_app.drivers import TIMEOUT_S, Driver, replica_metrics
from tests.ray_app.test_affinity import wait_dead

pytestmark = pytest.mark.slow
SESSION_METHODS = ("Attend", "StreamSession", "GetSession", "ForkSession", "TruncateSession")


def requests_by_replica(ports) -> dict[str, collections.Counter]:
    """mha_serve_requests_total of each replica, by (method, code), from its own /metrics
    (the ports that answer: a replica's is the app's metrics_port plus its rank on the
    node, and ranks go on from the replicas a redeploy replaces)."""
    out: dict[str, collections.Counter] = {}
    for text in replica_metrics(ports):
        counts: collections.Counter = collections.Counter()
        (replica,) = {
            line.split('replica="')[1].split('"')[0]
            for line in text.splitlines()
            if line.startswith("mha_serve_") and 'replica="' in line
        }
        for line in text.splitlines():
            if not line.startswith("mha_serve_requests_total{"):
                continue
            labels, value = line.rsplit(" ", 1)
            fields = dict(kv.split("=", 1) for kv in labels[labels.index("{") + 1 : -1].split(","))
            fields = {k: v.strip('"') for k, v in fields.items()}
            counts[(fields["method"], fields["code"])] += float(value)
        out[replica] = counts
    return out


def test_a_sessions_calls_reach_its_replica_and_no_ingress_runs(cluster, models):
    from ray import serve

    deployments = set(serve.status().applications[APP].deployments)
    assert deployments == {"AttentionReplica", "SequenceDirectory"}, deployments
    check_one_replica_per_session(cluster, models, cluster.metrics_ports)


def check_one_replica_per_session(cluster, models, metrics_ports) -> None:
    rng = np.random.default_rng(3)
    before = requests_by_replica(metrics_ports)
    with Client(cluster.target, timeout=60) as client:
        session = client.create_session("gqa")
        owner = replica_of(session.id)
        history = rng.standard_normal((3, 512), dtype=np.float32)
        np.testing.assert_allclose(
            session.step(history).output, models.step("gqa", history, 3), atol=1e-4
        )
        for _ in range(2):  # two streams, three steps each
            with session.stream() as stream:
                for _ in range(3):
                    x = rng.standard_normal((1, 512), dtype=np.float32)
                    history = np.concatenate([history, x])
                    got = stream.step(x).output
                    np.testing.assert_allclose(got, models.step("gqa", history, 1), atol=1e-4)
        child = session.fork()
        assert session.truncate(4).num_tokens == 4 and session.refresh().num_tokens == 4
        child.close()
        session.close()
    after = requests_by_replica(metrics_ports)
    assert set(after) == replica_ids()
    for replica, counts in after.items():
        grown = {m: counts[(m, "OK")] - before[replica][(m, "OK")] for m in SESSION_METHODS}
        if replica == owner:
            assert grown == {
                "Attend": 1,
                "StreamSession": 6,
                "GetSession": 1,
                "ForkSession": 1,
                "TruncateSession": 1,
            }, grown
        else:
            assert not any(grown.values()), (replica, grown)


def test_watch_is_answered_by_the_proxy(cluster):
    async def main():
        async with grpc.aio.insecure_channel(cluster.target) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            watch = health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=TIMEOUT_S)
            first = await watch.read()
            watch.cancel()
            return first.status

    assert asyncio.run(main()) == health_pb2.HealthCheckResponse.SERVING


def wait_exited(pid: int) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    raise TimeoutError(f"process {pid} still runs {TIMEOUT_S} s after ray.kill")


async def open_stream(stub, sid: str):
    """A StreamSession whose steps the caller sends one by one: (send, replies)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def requests():
        while (item := await queue.get()) is not None:
            yield item

    call = stub.StreamSession(requests(), timeout=TIMEOUT_S)
    return queue, call


def check_killed_mid_stream(cluster, models) -> None:
    import ray

    async def main() -> None:
        async with grpc.aio.insecure_channel(cluster.target) as channel:
            stub = pb_grpc.AttentionServiceStub(channel)
            by_replica: dict[str, Driver] = {}
            for i in range(40):  # a session on each replica (new sessions go by load)
                d = Driver(stub, models, 600 + i)
                await d.create()
                if by_replica.setdefault(next(iter(d.replicas)), d) is not d:
                    # Closed: none left behind (the next redeploy would move it)
                    await d.close()
                if len(by_replica) == 2:
                    break
            assert len(by_replica) == 2, by_replica.keys()
            streams = {}
            for replica, d in by_replica.items():
                (sid,) = d.sessions
                queue, call = await open_stream(stub, sid)
                for i in range(2):
                    x = d.tokens(1)
                    await queue.put(d.step_request(sid if i == 0 else "", x))
                    d.check(sid, x, await call.read())
                streams[replica] = (d, sid, queue, call)
            doomed, kept = sorted(streams)
            name = f"SERVE_REPLICA::{APP}#AttentionReplica#{doomed}"
            actor = ray.get_actor(name, namespace="serve")
            pid = await actor.__ray_call__.remote(lambda self: os.getpid())
            ray.kill(actor, no_restart=True)
            await asyncio.to_thread(wait_dead, name)
            # Ray calls it dead before its process has exited (and a process alive answers
            # what reaches it): this is about a replica that is gone.
            await asyncio.to_thread(wait_exited, pid)

            d, sid, queue, call = streams[doomed]
            await queue.put(d.step_request("", d.tokens(1)))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call.read()
            assert info.value.code() == grpc.StatusCode.NOT_FOUND, info.value
            assert "is gone" in info.value.details() and sid in info.value.details()
            assert "Traceback" not in info.value.details()

            d, sid, queue, call = streams[kept]
            for _ in range(2):
                x = d.tokens(1)
                await queue.put(d.step_request("", x))
                d.check(sid, x, await call.read())
            await queue.put(None)
            await d.close()

    asyncio.run(main())


def test_a_replica_killed_mid_stream(cluster, models):
    check_killed_mid_stream(cluster, models)


def test_over_rays_own_road_for_stream_messages(cluster, models):
    """direct_streams: false: the same app, stream messages through Ray's proxy."""
    config = copy.deepcopy(cluster.config)
    (app,) = config["applications"]
    app["args"]["direct_streams"] = False
    # Ports of their own: the replicas replaced may hold theirs a moment after Ray calls
    # them dead (a replica's /metrics server lives as long as its process).
    metrics_port = free_ports(4)
    app["args"]["metrics_port"] = metrics_port
    before = replica_ids()
    deploy(config)
    deadline = time.monotonic() + TIMEOUT_S
    while len(ids := replica_ids()) != 2 or ids & before:
        assert time.monotonic() < deadline, f"{ids} after {TIMEOUT_S} s"
        time.sleep(0.2)
    for replica_id in ids:  # named as soon as started; answers once warm (its /metrics up)
        assert replica_handle("replica_id_of", replica_id).remote().result(timeout_s=TIMEOUT_S)
    check_one_replica_per_session(cluster, models, range(metrics_port, metrics_port + 4))
    with Client(cluster.target, timeout=60) as client:
        a, b = client.create_session("mqa"), client.create_session("mqa")
        with grpc.insecure_channel(cluster.target) as channel:
            stub = pb_grpc.AttentionServiceStub(channel)
            x = np.ones((1, 512), np.float32)
            from mha_client.tensors import to_proto

            steps = [
                pb.AttendRequest(session_id=a.id, input=to_proto(x)),
                pb.AttendRequest(session_id=b.id, input=to_proto(x)),
            ]
            replies = stub.StreamSession(iter(steps), timeout=60)
            assert next(replies).session.num_tokens == 1
            with pytest.raises(grpc.RpcError) as info:
                next(replies)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "one stream per session" in info.value.details()
        a.close()
        b.close()
    check_killed_mid_stream(cluster, models)
