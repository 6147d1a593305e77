"""Shared test helpers: free loopback ports and a real `mha-serve` process."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

START_TIMEOUT_S = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m mha_serve.transport.main` on 127.0.0.1, waited on until health is SERVING."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, log_path: Path) -> None:
        self.port = free_port()
        self.metrics_port = free_port()
        self.target = f"127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [
            sys.executable,
            "-m",
            "mha_serve.transport.main",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--metrics-port",
            str(self.metrics_port),
            *args,
        ]
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )

    def wait_serving(self, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(self.target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"mha-serve exited with {self.proc.returncode}:\n{self.log()}"
                    )
                try:
                    status = stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                    if status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.1)
        raise TimeoutError(f"mha-serve not SERVING after {timeout} s:\n{self.log()}")

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


@contextlib.contextmanager
def serving_process(log_dir: Path, *args: str):
    """A ServerProcess, SERVING, stopped at the end: exit code 0 on SIGTERM or the test fails."""
    proc = ServerProcess(*args, log_path=log_dir / "mha-serve.log")
    try:
        proc.wait_serving()
        yield proc
    finally:
        code = proc.stop()
        assert code == 0, f"mha-serve exited {code} on SIGTERM:\n{proc.log()}"
