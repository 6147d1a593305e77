"""The real /metrics endpoint counts requests by status code and passes the Prometheus parser."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

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
    key_ok = (
        "mha_serve_requests_total",
        (("code", "OK"), ("method", "Attend"), ("model", "mqa"), ("protocol", "mha.v1")),
    )
    key_nf = (
        "mha_serve_requests_total",
        (("code", "NOT_FOUND"), ("method", "Attend"), ("model", "unknown"), ("protocol", "mha.v1")),
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
        method: (
            "mha_serve_requests_total",
            (("code", "OK"), ("method", method), ("model", "gqa"), ("protocol", "mha.v1")),
        )
        for method in ("Attend", "StreamSession")
    }
    before = scrape(server)
    stub.Attend(step, timeout=30)
    list(stub.StreamSession(iter([step, pb.AttendRequest(input=step.input)]), timeout=30))
    after = scrape(server)
    assert after[keys["Attend"]] == before.get(keys["Attend"], 0) + 1
    assert after[keys["StreamSession"]] == before.get(keys["StreamSession"], 0) + 2
    stub.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=10)


def test_session_rpcs_are_counted_under_their_sessions_model(server, stub):
    """Get/Fork/Truncate/Close name no model: the session's; a stream refused for its
    session_id counts too (under "unknown" when it names none)."""
    sid = stub.CreateSession(pb.CreateSessionRequest(model="gqa"), timeout=10).session_id

    def key(method, model, code="OK"):
        labels = (("code", code), ("method", method), ("model", model), ("protocol", "mha.v1"))
        return ("mha_serve_requests_total", labels)

    before = scrape(server)
    stub.GetSession(pb.GetSessionRequest(session_id=sid), timeout=10)
    child = stub.ForkSession(pb.ForkSessionRequest(session_id=sid), timeout=10).session_id
    stub.TruncateSession(pb.TruncateSessionRequest(session_id=child), timeout=10)
    for s in (sid, child):
        stub.CloseSession(pb.CloseSessionRequest(session_id=s), timeout=10)
    with pytest.raises(grpc.RpcError):
        stub.GetSession(pb.GetSessionRequest(session_id=sid), timeout=10)
    x = np.zeros((1, 512), np.float32)
    nameless = pb.AttendRequest(
        input=pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=x.shape, data=x.tobytes())
    )
    with pytest.raises(grpc.RpcError):
        list(stub.StreamSession(iter([nameless]), timeout=10))
    after = scrape(server)
    for k, n in (
        (key("GetSession", "gqa"), 1),
        (key("ForkSession", "gqa"), 1),
        (key("TruncateSession", "gqa"), 1),
        (key("CloseSession", "gqa"), 2),
        (key("GetSession", "unknown", "NOT_FOUND"), 1),
        (key("StreamSession", "unknown", "INVALID_ARGUMENT"), 1),
    ):
        assert after.get(k, 0) == before.get(k, 0) + n, k


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


def _promtool() -> str | None:
    """promtool on PATH, or where `make test` puts it (.ci/get-promtool: the venv's bin)."""
    beside = Path(sys.executable).parent / "promtool"
    return shutil.which("promtool") or (str(beside) if beside.exists() else None)


def _all_series_present(stub) -> None:
    """Traffic that gives every labelled metric a series: both lanes, a session step."""
    x = np.zeros((1, 4, 512), np.float32)
    tensor = pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=x.shape, data=x.tobytes())
    stub.Attend(pb.AttendRequest(model="mqa", input=tensor), timeout=30)
    weights = pb.WeightsRequest(enabled=True)
    stub.Attend(pb.AttendRequest(model="mqa", input=tensor, weights=weights), timeout=30)
    sid = stub.CreateSession(pb.CreateSessionRequest(model="mqa"), timeout=10).session_id
    list(stub.StreamSession(iter([pb.AttendRequest(session_id=sid, input=tensor)]), timeout=30))
    stub.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=10)


def test_every_exported_metric_is_documented_and_every_documented_one_exported(server, stub):
    _all_series_present(stub)
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    families = [f for f in text_string_to_metric_families(text) if f.name.startswith("mha_")]
    doc = (Path(__file__).parents[2] / "docs" / "metrics.md").read_text()
    # the doc's table rows: name | type | labels; counters are exported as "name" (family)
    # + "_total"
    rows = re.findall(
        r"^\| `(mha_serve_[a-z_]+)` \| (\w+) \| ?([a-z, ]*?) ?\|", doc, flags=re.MULTILINE
    )
    documented = {
        name.removesuffix("_total"): (kind, {label for label in labels.split(", ") if label})
        for name, kind, labels in rows
    }
    assert {f.name for f in families} == set(documented)
    for f in families:
        labels = {k for s in f.samples for k in s.labels if k != "le"}
        # a family with no series yet shows no labels; one with series shows them all
        expected = documented[f.name]
        assert (f.type, labels or expected[1]) == expected, f.name


def test_the_metrics_endpoint_passes_promtool(server, stub):
    promtool = _promtool()
    if promtool is None:
        pytest.skip("promtool not found: `make test` fetches it (.ci/get-promtool)")
    _all_series_present(stub)
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read()
    assert b"mha_serve_batch_size_bucket" in text and b'lane="weights"' in text
    lint = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, timeout=60
    )
    assert lint.returncode == 0, (lint.stdout + lint.stderr).decode()
