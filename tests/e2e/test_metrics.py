"""The real /metrics endpoint counts requests by status code and passes the Prometheus parser."""

from __future__ import annotations

import time
import urllib.request

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mha_client.api import attention_pb2 as pb


def scrape(server) -> dict[tuple[str, tuple], float]:
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_requests_are_counted_by_code(server, stub):
    x = np.zeros((2, 3, 512), np.float32)
    ok = pb.AttendRequest(
        model="mqa", input=pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=x.shape, data=x.tobytes())
    )
    key_ok = ("mha_serve_requests_total", (("code", "OK"), ("method", "Attend"), ("model", "mqa")))
    key_nf = (
        "mha_serve_requests_total",
        (("code", "NOT_FOUND"), ("method", "Attend"), ("model", "unknown")),
    )
    before = scrape(server)
    stub.Attend(ok, timeout=30)
    with pytest.raises(grpc.RpcError):
        stub.Attend(pb.AttendRequest(model="no-such", input=ok.input), timeout=30)
    after = scrape(server)
    assert after[key_ok] == before.get(key_ok, 0) + 1
    assert after[key_nf] == before.get(key_nf, 0) + 1
    tokens = ("mha_serve_tokens_total", (("model", "mqa"),))
    assert after[tokens] == before.get(tokens, 0) + 6
    assert after[("mha_serve_ready", ())] == 1


def test_session_steps_are_counted_under_their_sessions_model(server, stub):
    """A step may leave the model empty (the SDK does): it counts under its session's model."""
    sid = stub.CreateSession(pb.CreateSessionRequest(model="gqa"), timeout=10).session_id
    x = np.zeros((1, 512), np.float32)
    step = pb.AttendRequest(
        session_id=sid, input=pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=x.shape, data=x.tobytes())
    )
    keys = {
        method: ("mha_serve_requests_total", (("code", "OK"), ("method", method), ("model", "gqa")))
        for method in ("Attend", "StreamSession")
    }
    before = scrape(server)
    stub.Attend(step, timeout=30)
    list(stub.StreamSession(iter([step, pb.AttendRequest(input=step.input)]), timeout=30))
    after = scrape(server)
    assert after[keys["Attend"]] == before.get(keys["Attend"], 0) + 1
    assert after[keys["StreamSession"]] == before.get(keys["StreamSession"], 0) + 2
    stub.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=10)


def test_sessions_ended_are_counted_by_reason(server, stub):
    """Closed and expired sessions (evicted: tests/cache) show in the ended counter."""
    ended = {r: ("mha_serve_sessions_ended_total", (("reason", r),)) for r in ("closed", "expired")}
    before = scrape(server)
    assert ("mha_serve_sessions_ended_total", (("reason", "evicted"),)) in before  # 0 from start
    sid = stub.CreateSession(pb.CreateSessionRequest(model="mqa"), timeout=10).session_id
    stub.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=10)
    short = stub.CreateSession(pb.CreateSessionRequest(model="mqa", ttl_s=0.05), timeout=10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # expired by the lookup once the TTL passed
        try:
            stub.GetSession(pb.GetSessionRequest(session_id=short.session_id), timeout=10)
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.NOT_FOUND and "expired" in e.details()
            break
        time.sleep(0.05)
    after = scrape(server)
    assert after[ended["closed"]] == before.get(ended["closed"], 0) + 1
    assert after[ended["expired"]] == before.get(ended["expired"], 0) + 1
