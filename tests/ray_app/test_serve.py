"""The whole mha.v1 API through Ray Serve's real gRPC proxy (deploy/ray/serve_config.yaml,
two replicas) to the unchanged SDK: stateless calls, weights, sessions by unary call and by
stream, fork, truncate, close; statuses and their messages as the standalone server sends
them; health; each replica's labelled metrics."""

from __future__ import annotations

import urllib.request

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mha_client.errors import MhaServeError
from mha_client.sdk import Client
from mha_serve.ray_app.ids import replica_of
from tests.ray_app.cluster import APP
from tests.ray_app.conftest import ATOL, replica_handle, replica_ids

pytestmark = pytest.mark.slow
rng = np.random.default_rng(0)


def tokens(n: int, embed: int = 512) -> np.ndarray:
    return rng.standard_normal((n, embed), dtype=np.float32)


@pytest.fixture(scope="module")
def client(cluster):
    with Client(cluster.target, timeout=60) as c:
        yield c


def code_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(MhaServeError) as info:
        call()
    return info.value.code, info.value.details


def test_models_and_health(cluster, client):
    assert [m.name for m in client.list_models()] == ["mha", "gqa", "mqa"]
    assert client.model_info("gqa").num_kv_heads == 2
    with grpc.insecure_channel(cluster.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "mha.v1.AttentionService"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=30)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as info:
            health.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=30)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_stateless_attend_and_weights_equal_the_model(client, models):
    x = rng.standard_normal((3, 24, 512), dtype=np.float32)
    for model in ("mha", "gqa", "mqa"):
        want, _ = models.forward(model, x)
        np.testing.assert_allclose(client.attend(model, x).output, want, atol=ATOL)
    x = tokens(12)
    got = client.attend("gqa", x, weights=True, causal=True)
    want, want_w = models.forward("gqa", x[None], causal=True, weights=True)
    np.testing.assert_allclose(got.output, want[0], atol=ATOL)
    np.testing.assert_allclose(got.weights, want_w[0], atol=ATOL)


def test_sessions_by_call_and_stream_fork_truncate_close(client, models):
    session = client.create_session("mha")
    owner = replica_of(session.id)
    assert owner in replica_ids()
    history = tokens(5)
    got = session.step(history)
    np.testing.assert_allclose(got.output, models.step("mha", history, 5), atol=ATOL)
    with session.stream() as stream:
        for _ in range(3):
            x = tokens(1)
            history = np.concatenate([history, x])
            got = stream.step(x)
            np.testing.assert_allclose(got.output, models.step("mha", history, 1), atol=ATOL)
    assert session.refresh().num_tokens == 8

    child = session.fork()
    assert replica_of(child.id) == owner  # forks share the parent's blocks: same replica
    x_child, x_parent = tokens(2), tokens(2)
    got = child.step(x_child)
    want = models.step("mha", np.concatenate([history, x_child]), 2)
    np.testing.assert_allclose(got.output, want, atol=ATOL)
    history = np.concatenate([history, x_parent])
    got = session.step(x_parent)
    np.testing.assert_allclose(got.output, models.step("mha", history, 2), atol=ATOL)

    assert session.truncate(4).num_tokens == 4
    history = np.concatenate([history[:4], tokens(3)])
    got = session.step(history[4:])
    np.testing.assert_allclose(got.output, models.step("mha", history, 3), atol=ATOL)

    child.close()
    session.close()
    code, details = code_of(session.refresh)
    assert code == grpc.StatusCode.NOT_FOUND and "closed" in details


def test_errors_keep_their_codes_and_messages(client):
    code, details = code_of(lambda: client.attend("mha", tokens(4, embed=64)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "512" in details
    code, details = code_of(lambda: client.attend("nope", tokens(4)))
    assert code == grpc.StatusCode.NOT_FOUND and "nope" in details
    code, details = code_of(lambda: client.session("no-such-session").refresh())
    assert code == grpc.StatusCode.NOT_FOUND and "no-such-session" in details
    # 8 heads x 1500 x 1500 float32 weights: past the model's max_weights_bytes (64 MiB)
    code, details = code_of(lambda: client.attend("mha", tokens(1500), weights=True))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
    session = client.create_session("mqa", max_len=4)
    code, details = code_of(lambda: session.step(tokens(5)))
    assert code == grpc.StatusCode.OUT_OF_RANGE and "4" in details
    session.close()


def test_stream_rules_and_malformed_bytes(cluster, client):
    a, b = client.create_session("gqa"), client.create_session("gqa")
    from mha_client.api import attention_pb2 as pb
    from mha_client.api import attention_pb2_grpc as pb_grpc
    from mha_client.tensors import to_proto

    with grpc.insecure_channel(cluster.target) as channel:
        stub = pb_grpc.AttentionServiceStub(channel)
        step = pb.AttendRequest(input=to_proto(tokens(1)))
        with pytest.raises(grpc.RpcError) as info:
            list(stub.StreamSession(iter([step]), timeout=60))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "needs session_id" in info.value.details()

        first = pb.AttendRequest(session_id=a.id, input=to_proto(tokens(1)))
        other = pb.AttendRequest(session_id=b.id, input=to_proto(tokens(1)))
        replies = stub.StreamSession(iter([first, other]), timeout=60)
        assert next(replies).session.num_tokens == 1
        with pytest.raises(grpc.RpcError) as info:
            next(replies)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "one stream per session" in info.value.details()

        raw = channel.unary_unary("/mha.v1.AttentionService/Attend")
        with pytest.raises(grpc.RpcError) as info:
            raw(b"\xff\xff\xff", timeout=60)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "mha.v1.AttendRequest" in info.value.details()
    a.close()
    b.close()


def test_each_replica_serves_its_metrics_labelled(cluster, client):
    client.attend("mha", tokens(4))
    seen = set()
    for port in cluster.metrics_ports:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
            text = r.read().decode()
        assert "mha_serve_requests_total{" in text
        labels = {
            line.split('replica="')[1].split('"')[0]
            for line in text.splitlines()
            if line.startswith("mha_serve_") and 'replica="' in line
        }
        assert len(labels) == 1, labels
        seen |= labels
    assert seen == replica_ids()


def test_replica_caches_end_empty(client):
    for replica_id in replica_ids():
        usage = replica_handle("cache_usage", replica_id).remote().result(timeout_s=60)
        assert usage == {m: (0, 0) for m in ("mha", "gqa", "mqa")}, (replica_id, usage)


def test_the_application_metadata_picks_the_app(cluster, capsys):
    with Client(cluster.target, timeout=60, metadata=(("application", "mha"),)) as c:
        assert [m.name for m in c.list_models()] == ["mha", "gqa", "mqa"]
        session = c.create_session("mqa")
        with session.stream() as stream:
            assert stream.step(tokens(2)).session.num_tokens == 2
        session.close()
    # With a single application Ray's proxy routes every call to it, whatever the name
    # (proxy_router.get_handle_for_endpoint); the name picks one when there are several.
    with Client(cluster.target, timeout=60, metadata=(("application", "other"),)) as c:
        assert len(c.list_models()) == 3
    from mha_client.cli import main

    assert main(["--target", cluster.target, "--application", "mha", "models"]) == 0
    assert "gqa" in capsys.readouterr().out


def test_a_call_past_its_deadline_is_dropped_not_computed(client):
    """The deadline the Ingress forwards reaches the engine: a call that reaches a replica
    past it is dropped from its lane (DEADLINE_EXCEEDED saying so), and a session step past
    it keeps nothing; one within it is answered."""
    import time

    from ray import serve

    from mha_client.api import attention_pb2 as pb
    from mha_client.tensors import to_proto
    from mha_serve.ray_app.context import Caller

    call = serve.get_deployment_handle("AttentionReplica", APP).options(method_name="call")
    request = pb.AttendRequest(model="mha", input=to_proto(tokens(4)))
    late, soon = Caller(deadline=time.time() - 1), Caller(deadline=time.time() + 600)
    reply = call.remote("Attend", request, late).result(timeout_s=60)
    assert reply.code == grpc.StatusCode.DEADLINE_EXCEEDED, reply
    assert "deadline passed" in reply.details, reply.details
    assert call.remote("Attend", request, soon).result(timeout_s=60).code is None

    session = client.create_session("mha")
    step = pb.AttendRequest(session_id=session.id, input=to_proto(tokens(2)))
    pinned = call.options(session_id=session.id)
    reply = pinned.remote("Attend", step, late).result(timeout_s=60)
    assert reply.code == grpc.StatusCode.DEADLINE_EXCEEDED, reply
    assert session.refresh().num_tokens == 0
    assert pinned.remote("Attend", step, soon).result(timeout_s=60).code is None
    assert session.refresh().num_tokens == 2
    session.close()


def test_the_ingress_tells_live_replicas_from_gone_ones(cluster):
    """What decides UNAVAILABLE (unreachable, still runs) against NOT_FOUND (gone) when Ray
    fails a session's call (forward.py; the cases themselves: test_forward.py)."""
    import asyncio

    from ray import serve

    from mha_serve.ray_app.router import liveness

    alive = liveness(serve.get_deployment_handle("AttentionReplica", APP))
    for replica_id in replica_ids():
        assert asyncio.run(alive(replica_id)), replica_id
    assert not asyncio.run(alive("gone0replica"))


def test_messages_past_grpc_default_4_mib_go_both_ways(client, models):
    """Past gRPC's default 4 MiB on every hop (the proxy, the Ingress's calls, and with
    RAY_SERVE_PROXY_USE_GRPC Ray's own gRPC, whose cap deploy/ray/Dockerfile raises): a
    4.5 MB request and its 4.5 MB reply pass and are right."""
    x = rng.standard_normal((2, 1100, 512), dtype=np.float32)  # 4.5 MB each way
    want, _ = models.forward("mqa", x)
    np.testing.assert_allclose(client.attend("mqa", x).output, want, atol=ATOL)


def test_a_request_past_max_receive_message_bytes_is_refused_as_standalone(client):
    """Ray's proxy takes messages up to 2 GiB; the replica refuses one past the server's
    max_receive_message_bytes (64 MiB) as the standalone server's gRPC does, its stream
    messages too. (Found by a walk through docs/ray.md: a 100 MiB Attend answered OK
    through Ray, RESOURCE_EXHAUSTED on the standalone server.)"""
    x = np.ones((33, 1024, 512), dtype=np.float32)  # 69 MB
    code, details = code_of(lambda: client.attend("mha", x))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
    assert "Received message larger than max (" in details and "vs. 67108864)" in details
    session = client.create_session("mha")
    with session.stream(reopen=False) as stream:
        stream.step(tokens(1))
        code, details = code_of(lambda: stream.step(np.ones((33000, 512), np.float32)))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
    assert "Received message larger than max (" in details
    assert session.refresh().num_tokens == 1
    session.close()
