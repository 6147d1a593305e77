"""A redeploy of one replica on a Ray with no room for a second: the replacement cannot
start until the old replica is gone, so its sessions have nowhere to move. The old replica
gives up on them once no other replica has run for NOWHERE_GRACE_S, rather than hold its
stop (and so the replacement's start) for its whole shutdown budget: the session answers
NOT_FOUND saying its replica stopped and could not move it, and why (the old replica told
SequenceDirectory), counted lost as move_failed (not replica_killed) on the replacement's
/metrics; the replacement serves, and the old replica said why in its log.
(With room for the replacement, the same redeploy moves the session: docs/ray.md.)"""

from __future__ import annotations

import copy
import shutil
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from mha_client.errors import MhaServeError
from mha_client.sdk import Client
from tests.helpers import free_port, free_ports
from tests.ray_app.cluster import deploy, load_config, start_ray
from tests.ray_app.conftest import replica_ids
from tests.ray_app.drivers import TIMEOUT_S
from tests.ray_app.stepping import metric_sum

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def receiver():
    """Where the replica sends its spans (an OTLP/HTTP endpoint, tests/otlp.py)."""
    otlp = pytest.importorskip("tests.otlp")
    r = otlp.Receiver()
    yield r
    r.close()


@pytest.fixture(scope="module")
def one_replica(receiver):
    """A Ray of one CPU (its logs in a folder of its own) running the app with one replica,
    its /metrics on the first of two ports (the replacement's rank may be 1), its spans sent
    to `receiver`, only once it stops (they would go every 5 s)."""
    ray = pytest.importorskip("ray")
    temp = Path(tempfile.mkdtemp(prefix="ray1", dir="/tmp"))  # short: Ray's socket paths
    start_ray(ray, 1, _temp_dir=str(temp))
    try:
        config = load_config(
            grpc_port=free_port(),
            num_replicas=1,
            metrics_port=free_ports(2),
            overrides={"tracing_endpoint": receiver.endpoint},
        )
        env = {"OTEL_BSP_SCHEDULE_DELAY": str(3_600_000)}  # an hour: held until a stop
        config["applications"][0]["runtime_env"] = {"env_vars": env}
        deploy(config)
        yield config, temp
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


def test_a_call_through_rays_proxy_joins_the_clients_trace_sent_as_the_replica_stops(
    one_replica, receiver
):
    """Ray's gRPC proxy hands the replica the call's metadata: the client's traceparent
    makes the replica's span a child of the client's, with its queue and compute. The
    replica holds it until Ray stops it (a redeploy), and sends it then: Ray ends a replica
    with ray.kill, which runs no atexit handler (the SDK's own flush)."""
    from tests.otlp import attributes, call_in, traceparent

    config, _ = one_replica
    target = f"127.0.0.1:{config['grpc_options']['port']}"
    header, trace_id, parent_id = traceparent()
    x = np.random.default_rng(5).standard_normal((3, 512), dtype=np.float32)
    with Client(target, metadata=(("traceparent", header),)) as client:
        client.attend("mqa", x)
    assert not receiver.spans, "held for an hour (OTEL_BSP_SCHEDULE_DELAY)"
    (old,) = replica_ids()
    config = copy.deepcopy(config)
    config["applications"][0]["args"]["overrides"]["torch_threads"] = 2  # a new version
    deploy(config)
    deadline = time.monotonic() + TIMEOUT_S
    while replica_ids() in ({old}, set()):
        assert time.monotonic() < deadline, "the replacement never ran"
        time.sleep(0.2)
    [(resource, span)] = receiver.wait_for(call_in(trace_id))
    assert span.name == "mha.v1.AttentionService/Attend"
    assert span.parent_span_id == parent_id
    assert attributes(span.attributes)["mha.model"] == "mqa"
    assert resource["mha_serve.role"] == "ray-replica"
    assert set(receiver.children(span)) == {"queue", "compute"}


def test_a_session_with_nowhere_to_move_is_given_up_not_waited_for(one_replica):
    from mha_serve.ray_app.moves import NOWHERE, NOWHERE_GRACE_S

    config, temp = one_replica
    target = f"127.0.0.1:{config['grpc_options']['port']}"
    (old,) = replica_ids()
    x = np.random.default_rng(3).standard_normal((5, 512), dtype=np.float32)
    with Client(target) as client:
        session = client.create_session("gqa")
        session.step(x[:4])
        config = copy.deepcopy(config)
        config["applications"][0]["args"]["overrides"]["grace_period_s"] = 7.0
        deploy(config)  # a new version: Ray replaces the replica
        deadline = time.monotonic() + TIMEOUT_S
        while replica_ids() in ({old}, set()):
            assert time.monotonic() < deadline, "the replacement never ran"
            time.sleep(0.2)
        with pytest.raises(MhaServeError) as err:
            session.step(x[4:])
        assert err.value.code == grpc.StatusCode.NOT_FOUND
        assert "is gone" in err.value.details and old in err.value.details
        assert f"could not move it to another replica ({NOWHERE})" in err.value.details
        with pytest.raises(MhaServeError) as err:  # asked again: counted once
            session.step(x[4:])
        assert NOWHERE in err.value.details
        again = client.create_session("gqa")  # the replacement serves
        assert again.step(x).session.num_tokens == 5
    first = config["applications"][0]["args"]["metrics_port"]
    ports = (first, first + 1)
    lost = "mha_serve_sessions_lost_total"
    assert metric_sum(ports, lost, 'reason="move_failed"') == 1
    assert metric_sum(ports, lost, 'reason="replica_killed"') == 0
    said = f"replica {old} stopping: 0 sessions moved, 1 not ({session.id}): no other "
    said += f"replica ran for {NOWHERE_GRACE_S:g} s"
    logs = [p.read_text(errors="replace") for p in temp.glob("session_*/logs/worker-*.err")]
    assert any(said in text for text in logs), "the old replica's log does not say it gave up"
