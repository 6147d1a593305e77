"""Session ids that name their replica, the stand-in servicer context, labelled metrics:
the pieces of mha_serve.ray_app that need no Ray running."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request
import uuid

import grpc
import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest

from mha_serve.ray_app.context import CallContext
from mha_serve.ray_app.ids import replica_of, session_prefix
from mha_serve.ray_app.scrape import Labelled, RankedMetrics
from tests.helpers import free_ports


def test_a_session_id_names_its_replica():
    session_id = session_prefix("k3x9ab12") + uuid.uuid4().hex
    assert replica_of(session_id) == "k3x9ab12"


@pytest.mark.parametrize(
    "session_id", ["", "abc", uuid.uuid4().hex, "-" + uuid.uuid4().hex, "x_" + uuid.uuid4().hex]
)
def test_ids_that_name_no_replica(session_id):
    assert replica_of(session_id) is None


def test_a_replica_id_with_the_separator_is_refused():
    with pytest.raises(ValueError, match="holds"):
        session_prefix("a-b")


async def test_abort_records_the_status_and_raises_as_grpcio_does():
    context = CallContext("ipv4:127.0.0.1:1")
    with pytest.raises(grpc.aio.AbortError):
        await context.abort(grpc.StatusCode.NOT_FOUND, "session 'x' does not exist")
    reply = context.reply()
    assert (reply.response, reply.code, reply.details) == (
        None,
        grpc.StatusCode.NOT_FOUND,
        "session 'x' does not exist",
    )
    assert context.time_remaining() is None and context.peer() == "ipv4:127.0.0.1:1"


def test_every_sample_gets_the_replica_labels():
    registry = CollectorRegistry()
    Counter("mha_serve_demo_total", "demo", ["model"], registry=registry).labels("mha").inc()
    out = CollectorRegistry(auto_describe=False)
    out.register(Labelled(registry, {"replica": "r1", "application": "mha"}))
    text = generate_latest(out).decode()
    assert 'mha_serve_demo_total{application="mha",model="mha",replica="r1"} 1.0' in text


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return reply.read().decode()


def test_metrics_follow_the_replicas_local_rank():
    """A replica's /metrics on base + local rank, moved when Ray gives it a new rank (a
    node's replicas renumbered 0..K-1 after a redeploy or a scale-down), the old port
    closed; a new port still taken leaves it where it was."""
    base = free_ports(3)
    endpoint = RankedMetrics(base, {"replica": "r1", "application": "mha"}, host="127.0.0.1")
    try:
        endpoint.serve_at(1)  # started beside an old replica at rank 0
        assert endpoint.port == base + 1 and 'replica="r1"' in scrape(base + 1)
        endpoint.serve_at(1)  # the same rank again (Ray's first reconfigure): unchanged
        assert endpoint.port == base + 1
        endpoint.serve_at(0)  # the old one stopped: renumbered
        assert endpoint.port == base and 'replica="r1"' in scrape(base)
        with pytest.raises(urllib.error.URLError):
            scrape(base + 1)
        with socket.socket() as taken:  # another process holds the next rank's port
            taken.bind(("127.0.0.1", base + 2))
            taken.listen()
            endpoint.serve_at(2)
            assert endpoint.port == base and 'replica="r1"' in scrape(base)
    finally:
        endpoint.close()
    with pytest.raises(urllib.error.URLError):
        scrape(base)


def test_the_proxy_registration_parses_plain_messages():
    """Ray registers the services with a unittest.mock servicer; requests must still parse
    into plain (picklable) messages, bad bytes into Malformed."""
    from unittest.mock import Mock

    pytest.importorskip("ray", reason="the registration is Ray's (the ray extra)")

    from mha_client.api import attention_pb2 as pb
    from mha_serve.ray_app.grpc_services import add_attention_service
    from mha_serve.transport.handlers import Malformed

    server = Mock()
    add_attention_service(Mock(), server)
    name, handlers = server.add_registered_method_handlers.call_args.args
    assert name == "mha.v1.AttentionService"
    parse = handlers["Attend"].request_deserializer
    request = parse(pb.AttendRequest(model="gqa", session_id="s").SerializeToString())
    assert type(request) is pb.AttendRequest and request.model == "gqa"
    assert isinstance(parse(b"\xff\xff\xff"), Malformed)
