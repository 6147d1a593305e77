"""What the served benchmarks share (bench/overhead.py, bench/frontend_workers.py and the
others): the gRPC options and methods, a free port, mha-serve started in a process of its own
(this checkout's code or another's), a bidi stream of bytes and its timed round trips, and
the machine's description for a report. bench/overhead.py re-exports them."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc

STEP_METHOD = "/mha.v1.AttentionService/StreamSession"
ATTEND_METHOD = "/mha.v1.AttentionService/Attend"
MAX_MESSAGE = 64 << 20
OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE),
    ("grpc.max_send_message_length", MAX_MESSAGE),
]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
    )


def start_served(
    tmp: Path, name: str, tree: Path | None = None, extra: list[str] | None = None
) -> tuple[subprocess.Popen, str]:
    """mha-serve on its built-in models; tree: run that checkout's code instead (a baseline);
    extra: more flags for both."""
    port = free_port()
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join(str(tree / d) for d in ("service", "client"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "mha_serve.transport.main", "--host", "127.0.0.1"]
        + ["--port", str(port), "--metrics-port", "0", "--log-level", "WARNING"]
        + (extra or []),
        stdout=(tmp / f"{name}.log").open("wb"),
        stderr=subprocess.STDOUT,
        env=env,
    )
    return proc, f"127.0.0.1:{port}"


class BytesStream:
    """A bidi stream of bytes (no serializers): write one message, read one."""

    def __init__(self, channel: grpc.aio.Channel, metadata: Any = None) -> None:
        self.call = channel.stream_stream(STEP_METHOD)(metadata=metadata)

    async def round_trip(self, payload: bytes) -> bytes:
        await self.call.write(payload)
        return await self.call.read()

    async def close(self) -> None:
        await self.call.done_writing()
        await self.call.read()  # the end of the stream


async def timed_stream(channel: grpc.aio.Channel, payloads: list[bytes]) -> list[float]:
    """The payloads as one stream's messages, each awaiting its reply; each round trip's
    seconds."""
    stream, times = BytesStream(channel), []
    for p in payloads:
        t = time.perf_counter()
        await stream.round_trip(p)
        times.append(time.perf_counter() - t)
    await stream.close()
    return times


def machine() -> dict[str, Any]:
    model = ""
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "loadavg_at_start": os.getloadavg(),
    }
