"""Shared test helpers: free loopback ports, a real `mha-serve` process, and the device the
suite's servers and engines run on."""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

START_TIMEOUT_S = 120.0
# The device of the suite's servers (ServerProcess) and of the engines whose fixtures ask for
# it: cpu (the default) or cuda / cuda:N (`make gpu` runs the whole suite so). Always in
# float32, so the suite's tolerances hold on either. Tests whose subject is the CPU (or a
# dtype) keep their own device.
SUITE_DEVICE_ENV = "MHA_SERVE_TEST_DEVICE"


def suite_device_name() -> str:
    """MHA_SERVE_TEST_DEVICE as a device name, checked (no torch import)."""
    name = os.environ.get(SUITE_DEVICE_ENV, "").strip() or "cpu"
    if not re.fullmatch(r"cpu|cuda(:\d+)?", name):
        raise ValueError(f"{SUITE_DEVICE_ENV}={name!r}: use cpu, cuda or cuda:N")
    return name


def suite_device() -> str:
    """The suite's device name; skips the calling test (or fixture) with the reason when it is
    CUDA and this machine's torch has no such device."""
    name = suite_device_name()
    if name != "cpu":
        import torch

        index = int(name.partition(":")[2] or 0)
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if index >= count:
            seen = f"{count} CUDA device(s)" if count else "no CUDA device"
            pytest.skip(
                f"{SUITE_DEVICE_ENV}={name} but torch {torch.__version__} sees {seen}: run "
                "the suite so on a machine with a GPU (make gpu), or unset it"
            )
    return name


def suite_torch_device():
    """suite_device() as a torch.device, for fixtures that build an Engine."""
    import torch

    return torch.device(suite_device())


def config_of(argv: list[str]):
    """The ServerConfig a command line makes (its --config file, then the environment, then
    its flags), as mha-serve's main() builds it."""
    from mha_serve.config import build_config
    from mha_serve.transport.main import parser

    args = parser().parse_args(argv)
    return build_config(args.config, {k: getattr(args, k) for k in vars(args) if k != "config"})


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for port 0 (Linux's file; its default elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_ports(n: int) -> int:
    """A port p with p + 1 ... p + n - 1 free too, at random below the kernel's ephemeral
    range. Not by port 0: a port it handed out and that was closed again can be handed out
    again at once, to the next call here (seen in CI: a server's --port and --metrics-port
    both 50839, "Address already in use") or to any socket of a server started meanwhile (a
    Ray replica's gRPC server on the port meant for another's /metrics). Ports that a
    process needs together come from one call."""
    low, _ = ephemeral_ports()
    first = max(1024, low - 12000)
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(first, low - n)
        try:
            for k in range(n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port + k))
        except OSError:
            continue
        return port
    raise RuntimeError(f"no {n} consecutive free ports in {first}..{low - 1}")


def free_port() -> int:
    return free_ports(1)


class ServerProcess:
    """`python -m mha_serve.transport.main` on 127.0.0.1, waited on until health is SERVING.

    It runs on the suite's device in float32 (MHA_SERVE_DEVICE / MHA_SERVE_DTYPE), unless
    `env` or a flag (which wins over the environment) names its own; and with a TMPDIR of its
    own, unless `env` names one: what the server leaves there (left_behind, once it stopped)
    is removed with it, so that no test leaves `mha-serve-*` directories in /tmp."""

    def __init__(
        self,
        *args: str,
        env: dict[str, str] | None = None,
        log_path: Path,
        module: str = "mha_serve.transport.main",
        process_group: bool = False,
    ) -> None:
        """module: run instead of mha-serve's (one that runs it, e.g. with a gate);
        process_group: a process group of its own, which a test may signal whole (os.killpg)."""
        device = {"MHA_SERVE_DEVICE": suite_device(), "MHA_SERVE_DTYPE": "float32"}
        self.port = free_ports(2)  # its gRPC port and, next to it, its /metrics
        self.metrics_port = self.port + 1
        self.target = f"127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [
            sys.executable,
            "-m",
            module,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--metrics-port",
            str(self.metrics_port),
            *args,
        ]
        self._own_tmp = None
        if "TMPDIR" not in (env or {}):  # (in /tmp, short: it holds a Unix socket's path)
            self._own_tmp = tempfile.mkdtemp(prefix="mha-test-")
            env = {**(env or {}), "TMPDIR": self._own_tmp}
        env = {**os.environ, **device, **env}
        self.tmp_dir = Path(env["TMPDIR"])
        self.left_behind: list[str] | None = None  # run dirs in tmp_dir once stopped
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            process_group=0 if process_group else None,
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

    def run_dirs(self) -> list[str]:
        """The server's directories (`mha-serve-*`) in its TMPDIR now."""
        return sorted(p.name for p in self.tmp_dir.glob("mha-serve-*"))

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM (SIGKILL after timeout) unless it has exited; its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        if self.left_behind is None:
            self.left_behind = self.run_dirs()
            if self._own_tmp is not None:
                shutil.rmtree(self._own_tmp, ignore_errors=True)
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
        assert proc.left_behind == [], f"mha-serve left {proc.left_behind} in its TMPDIR"
