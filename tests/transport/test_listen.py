"""Where the server listens: --host as an IPv6 address (with or without brackets) serves
gRPC and /metrics there, and a /metrics port it cannot take stops the start with a message
that names it."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mha_serve import metrics
from mha_serve.net import host_port
from tests.helpers import ServerProcess


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def _free_ipv6_port() -> int:
    with socket.socket(socket.AF_INET6) as s:
        s.bind(("::1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    ("host", "written"),
    [
        ("::1", "[::1]:7"),
        ("[::1]", "[::1]:7"),
        ("::", "[::]:7"),
        ("127.0.0.1", "127.0.0.1:7"),
        ("localhost", "localhost:7"),
    ],
)
def test_host_port_brackets_ipv6_addresses_once(host, written):
    assert host_port(host, 7) == written


def test_a_metrics_port_in_use_is_named_in_the_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=rf"/metrics on 127\.0\.0\.1:{port} \(--metrics-port"):
            metrics.serve_metrics(port, "127.0.0.1")


def test_the_server_stops_its_start_naming_a_taken_metrics_port(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = ServerProcess("--metrics-port", str(port), log_path=tmp_path / "log")
        try:
            code = server.proc.wait(120)
        finally:
            server.stop()
    assert code != 0
    assert f"cannot start: could not serve /metrics on 127.0.0.1:{port}" in server.log()


@pytest.mark.skipif(not _ipv6_loopback(), reason="this machine has no IPv6 loopback (::1)")
@pytest.mark.parametrize("host", ["::1", "[::1]"])
def test_an_ipv6_host_serves_grpc_and_metrics_there(tmp_path, host):
    port, metrics_port = _free_ipv6_port(), _free_ipv6_port()
    log = tmp_path / "log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mha_serve.transport.main", "--host", host]
            + ["--port", str(port), "--metrics-port", str(metrics_port), "--device", "cpu"],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline, status = time.monotonic() + 120, None
            with grpc.insecure_channel(f"[::1]:{port}") as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                while time.monotonic() < deadline and proc.poll() is None:
                    try:
                        status = stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                    except grpc.RpcError:
                        status = None
                    if status == health_pb2.HealthCheckResponse.SERVING:
                        break
                    time.sleep(0.1)
            assert status == health_pb2.HealthCheckResponse.SERVING, log.read_text()
            url = f"http://[::1]:{metrics_port}/metrics"
            with urllib.request.urlopen(url, timeout=10) as reply:
                assert b"mha_serve_ready" in reply.read()
        finally:
            proc.terminate()
            code = proc.wait(60)
    text = log.read_text()
    assert code == 0, text
    assert f"gRPC listening on [::1]:{port}" in text
    assert f"metrics on http://[::1]:{metrics_port}/metrics" in text
