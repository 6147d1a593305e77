"""One real `mha-serve` on the built-in models per test module of this package."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from mha_client.api import attention_pb2_grpc as pb_grpc
from tests.helpers import serving_process

MESSAGE_BYTES = 256 * 2**20


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving_process(tmp_path_factory.mktemp("server")) as proc:
        yield proc


@pytest.fixture(scope="module")
def channel(server):
    options = [
        ("grpc.max_receive_message_length", MESSAGE_BYTES),
        ("grpc.max_send_message_length", MESSAGE_BYTES),
    ]
    with grpc.insecure_channel(server.target, options=options) as channel:
        yield channel


@pytest.fixture(scope="module")
def stub(channel):
    return pb_grpc.AttentionServiceStub(channel)


def peak_rss_bytes(pid: int) -> int:
    """The process's high-water resident memory (VmHWM): what it ever allocated and touched."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/PID/status")


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/PID/status")
