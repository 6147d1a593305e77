"""One real `mha-serve` on the built-in models for the whole e2e package."""

from __future__ import annotations

import contextlib

import grpc
import pytest

from mha_client.api import attention_pb2_grpc as pb_grpc
from tests.helpers import serving_process


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    with serving_process(tmp_path_factory.mktemp("server")) as proc:
        yield proc


@pytest.fixture(scope="session")
def stub(server):
    with attention_stub(server.target) as s:
        yield s


@contextlib.contextmanager
def attention_stub(target: str):
    """An AttentionService stub whose channel takes messages up to 256 MiB each way."""
    options = [
        ("grpc.max_receive_message_length", 256 * 2**20),
        ("grpc.max_send_message_length", 256 * 2**20),
    ]
    with grpc.insecure_channel(target, options=options) as channel:
        yield pb_grpc.AttentionServiceStub(channel)
