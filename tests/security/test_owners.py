"""Owners (issue 24): with bearer tokens, a session answers only the client that created it;
another client stepping, streaming, forking, truncating, reading or closing it gets
NOT_FOUND exactly as for an id never made, over mha.v1 and through the id an Open
Inference Protocol sequence reply names; spilled sessions keep their owner. Real server,
real tokens, loopback."""

from __future__ import annotations

import contextlib

import grpc
import numpy as np
import pytest

from mha_client.api.inference import grpc_service_pb2 as oip
from mha_client.api.inference import grpc_service_pb2_grpc as oip_grpc
from mha_client.channel import ChannelSecurity
from mha_client.errors import MhaServeError
from mha_client.sdk import AsyncClient
from mha_serve.config import ServerConfig
from mha_serve.engine import ModelSpec
from mha_serve.model import AttentionConfig
from mha_serve.transport.server import Server
from tests.helpers import free_port

EMBED = 32
UNKNOWN = "does not exist here"


def x(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, EMBED), dtype=np.float32)


@contextlib.asynccontextmanager
async def serving(tmp_path, **kw):
    tokens = tmp_path / "tokens"
    tokens.write_text("token-alice\ntoken-bob\n")
    spec = ModelSpec("m", AttentionConfig(EMBED, 4, 2), seed=2, kv_cache_bytes=1 << 20)
    cfg = ServerConfig(
        host="127.0.0.1",
        port=free_port(),
        metrics_port=0,
        models=[spec],
        auth_token_file=str(tokens),
        **kw,
    )
    server = Server(cfg)
    await server.start()
    target = f"127.0.0.1:{server.port}"
    try:
        async with (
            AsyncClient(target, security=ChannelSecurity(token="token-alice")) as alice,
            AsyncClient(target, security=ChannelSecurity(token="token-bob")) as bob,
        ):
            yield server, alice, bob
    finally:
        await server.stop()


async def refused(call) -> str:
    with pytest.raises(MhaServeError) as e:
        await call
    assert e.value.code == grpc.StatusCode.NOT_FOUND, e.value
    return e.value.details


@pytest.mark.parametrize("spilled", [False, True], ids=["in-cache", "spilled"])
async def test_another_client_gets_not_found_for_every_call_on_a_session(tmp_path, spilled):
    extra = {}
    if spilled:
        extra = {"session_spill_dir": str(tmp_path / "spill"), "session_spill_bytes": 1 << 24}
    async with serving(tmp_path, **extra) as (server, alice, bob):
        mine = await alice.create_session("m")
        first = await mine.step(x(5))
        if spilled:
            assert server.serving.engine.spill_idle() == [mine.id]
        stolen = bob.session(mine.id)
        never = bob.session("0" * 32)
        for handle in (stolen, never):  # the same answer as for an id never made
            for call in (
                handle.step(x(1)),
                handle.refresh(),
                handle.fork(),
                handle.truncate(1),
            ):
                assert UNKNOWN in await refused(call)
            await handle.close()  # (the SDK takes NOT_FOUND on close as done: below, it was not)
        with pytest.raises(MhaServeError) as streamed:
            async with stolen.stream() as stream:
                await stream.step(x(1))
        assert (
            streamed.value.code == grpc.StatusCode.NOT_FOUND and UNKNOWN in streamed.value.details
        )
        # Nothing of it moved: the owner steps on, its session as it was.
        info = await mine.refresh()
        assert info.num_tokens == 5
        again = await mine.step(x(1, seed=1))
        assert again.session.num_tokens == 6 and first.output.shape == (5, EMBED)
        child = await mine.fork()
        assert (await child.truncate(2)).num_tokens == 2
        await child.close()
        await mine.close()


async def test_a_sequences_session_answers_its_client_alone(tmp_path):
    """The Open Inference Protocol reply names its sequence's session; another client that
    uses that id over mha.v1 gets NOT_FOUND."""
    async with serving(tmp_path) as (server, alice, bob):
        target = f"127.0.0.1:{server.port}"
        async with grpc.aio.insecure_channel(target) as channel:
            stub = oip_grpc.GRPCInferenceServiceStub(channel)
            request = oip.ModelInferRequest(model_name="m", id="r")
            tensor = request.inputs.add(name="INPUT", datatype="FP32", shape=[1, 3, EMBED])
            assert tensor.name == "INPUT"
            request.raw_input_contents.append(x(3).tobytes())
            request.parameters["sequence_id"].int64_param = 7
            request.parameters["sequence_start"].bool_param = True
            reply = await stub.ModelInfer(
                request, metadata=(("authorization", "Bearer token-alice"),)
            )
        session_id = reply.parameters["session_id"].string_param
        assert session_id and reply.parameters["sequence_num_tokens"].int64_param == 3
        assert UNKNOWN in await refused(bob.session(session_id).step(x(1)))
        assert (await alice.session(session_id).refresh()).num_tokens == 3


async def test_a_gone_session_is_told_gone_to_its_client_alone(tmp_path):
    """Why a session ended (closed, expired, evicted) is its owner's to read: to another
    client the id is one never made, as while it lived (docs/api.md, "Session owners")."""
    async with serving(tmp_path) as (server, alice, bob):
        mine = await alice.create_session("m")
        await mine.step(x(5))
        await mine.close()
        stolen = bob.session(mine.id)
        for call in (stolen.step(x(1)), stolen.refresh(), stolen.fork(), stolen.truncate(0)):
            details = await refused(call)
            assert UNKNOWN in details and "closed" not in details
        assert "was closed" in await refused(alice.session(mine.id).refresh())
