"""TLS, mutual TLS and the bearer token over real handshakes on loopback, with certificates
made in the test: what gets through, and every refusal with its status."""

from __future__ import annotations

import logging

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mha_client.api import attention_pb2 as pb
from mha_client.api import attention_pb2_grpc as pb_grpc
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
from tests.security.certs import Authority

TOKEN = "s3cret-token-0123456789"
SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    directory = tmp_path_factory.mktemp("pki")
    ca = Authority(directory)
    rogue = Authority(directory, "rogue CA")
    return {
        "ca": ca,
        "server": ca.issue("mha-serve", server=True),
        "alice": ca.issue("alice", server=False),
        "mallory": rogue.issue("mallory", server=False),
        "rogue": rogue,
    }


def config(**kw) -> ServerConfig:
    models = [ModelSpec("small", AttentionConfig(64, 4, 1), seed=5, kv_cache_bytes=1 << 20)]
    return ServerConfig(host="127.0.0.1", port=free_port(), metrics_port=0, models=models, **kw)


def x() -> np.ndarray:
    return np.random.default_rng(0).standard_normal((1, 3, 64), dtype=np.float32)


async def started(cfg: ServerConfig) -> tuple[Server, str]:
    server = Server(cfg)
    await server.start()
    return server, f"127.0.0.1:{server.port}"


async def status_of(client: AsyncClient) -> grpc.StatusCode:
    try:
        await client.list_models(timeout=10)
    except MhaServeError as e:
        return e.code
    return grpc.StatusCode.OK


async def test_tls_serves_a_client_that_trusts_the_ca_and_refuses_others(pki):
    server, target = await started(
        config(tls_cert_file=pki["server"].cert, tls_key_file=pki["server"].key)
    )
    try:
        async with AsyncClient(target, security=ChannelSecurity(ca_file=pki["ca"].ca_file)) as c:
            result = await c.attend("small", x())
            assert result.output.shape == (1, 3, 64)
        async with AsyncClient(target) as plaintext:  # no TLS: no handshake
            assert await status_of(plaintext) == grpc.StatusCode.UNAVAILABLE
        distrust = ChannelSecurity(ca_file=pki["rogue"].ca_file)  # does not trust the server
        async with AsyncClient(target, security=distrust) as c:
            assert await status_of(c) == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop()


async def test_mutual_tls_needs_a_client_certificate_of_the_ca(pki):
    server, target = await started(
        config(
            tls_cert_file=pki["server"].cert,
            tls_key_file=pki["server"].key,
            tls_client_ca_file=pki["ca"].ca_file,
            max_sessions_per_client=1,
        )
    )
    ca = pki["ca"].ca_file
    alice = ChannelSecurity(ca_file=ca, cert_file=pki["alice"].cert, key_file=pki["alice"].key)
    try:
        async with AsyncClient(target, security=alice) as c:
            assert (await c.attend("small", x())).output.shape == (1, 3, 64)
            # The certificate's name is the client's identity for per-client limits.
            session = await c.create_session("small")
            with pytest.raises(MhaServeError) as refused:
                await c.create_session("small")
            assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "client cert:alice holds 1 live sessions" in refused.value.details
            assert "max_sessions_per_client 1" in refused.value.details
            await session.close()
        async with AsyncClient(target, security=ChannelSecurity(ca_file=ca)) as no_cert:
            assert await status_of(no_cert) == grpc.StatusCode.UNAVAILABLE
        mallory = ChannelSecurity(
            ca_file=ca, cert_file=pki["mallory"].cert, key_file=pki["mallory"].key
        )
        async with AsyncClient(target, security=mallory) as c:  # signed by another CA
            assert await status_of(c) == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop()


async def test_bearer_token_over_tls_and_health_without_it(pki, tmp_path, caplog):
    token_file = tmp_path / "tokens"
    token_file.write_text(f"other-token\n{TOKEN}\n")
    caplog.set_level(logging.DEBUG)
    server, target = await started(
        config(
            tls_cert_file=pki["server"].cert,
            tls_key_file=pki["server"].key,
            auth_token_file=str(token_file),
        )
    )
    ca = pki["ca"].ca_file
    try:
        async with AsyncClient(target, security=ChannelSecurity(ca_file=ca, token=TOKEN)) as c:
            assert (await c.attend("small", x())).output.shape == (1, 3, 64)
        async with AsyncClient(target, security=ChannelSecurity(ca_file=ca)) as c:
            with pytest.raises(MhaServeError) as no_token:
                await c.attend("small", x())
            assert no_token.value.code == grpc.StatusCode.UNAUTHENTICATED
            assert "needs a bearer token" in no_token.value.details
            # The way it names works: ChannelSecurity(token=...), as above.
            assert "security=ChannelSecurity(token=...)" in no_token.value.details
            # Health is exempt: probes carry no secrets.
            assert (await c.health()) == "SERVING"
        wrong = ChannelSecurity(ca_file=ca, token="not-" + TOKEN)
        async with AsyncClient(target, security=wrong) as c:
            with pytest.raises(MhaServeError) as bad:
                await c.list_models()
            assert bad.value.code == grpc.StatusCode.UNAUTHENTICATED
            assert "not valid" in bad.value.details
            assert TOKEN not in bad.value.details
    finally:
        await server.stop()
    assert TOKEN not in caplog.text and "other-token" not in caplog.text


async def test_token_on_plaintext_loopback_every_rpc_kind(monkeypatch):
    monkeypatch.setenv("MHA_SERVE_AUTH_TOKEN", TOKEN)  # the token from the environment
    server, target = await started(config())
    try:
        async with grpc.aio.insecure_channel(target) as channel:
            stub = pb_grpc.AttentionServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as unary:
                await stub.ListModels(pb.ListModelsRequest())
            assert unary.value.code() == grpc.StatusCode.UNAUTHENTICATED
            stream = stub.StreamSession()  # a bidirectional stream is refused alike
            with pytest.raises(grpc.aio.AioRpcError) as streamed:
                await stream.read()
            assert streamed.value.code() == grpc.StatusCode.UNAUTHENTICATED
            health = health_pb2_grpc.HealthStub(channel)
            assert (await health.Check(health_pb2.HealthCheckRequest())).status == SERVING
            # The Open Inference Protocol's probes are exempt too; the rest of it is not.
            inference = oip_grpc.GRPCInferenceServiceStub(channel)
            assert (await inference.ServerLive(oip.ServerLiveRequest())).live
            assert (await inference.ServerReady(oip.ServerReadyRequest())).ready
            with pytest.raises(grpc.aio.AioRpcError) as metadata_call:
                await inference.ServerMetadata(oip.ServerMetadataRequest())
            assert metadata_call.value.code() == grpc.StatusCode.UNAUTHENTICATED
            metadata = (("authorization", f"Bearer {TOKEN}"),)
            models = await stub.ListModels(pb.ListModelsRequest(), metadata=metadata)
            assert [m.name for m in models.models] == ["small"]
        # The SDK sends its token over loopback plaintext (local credentials).
        async with AsyncClient(target, security=ChannelSecurity(token=TOKEN)) as c:
            session = await c.create_session("small")
            step = await session.step(x()[0])
            assert step.output.shape == (3, 64)
    finally:
        await server.stop()


@pytest.mark.parametrize(
    "target", ["127.0.0.1:1", "localhost:1", "[::1]:1", "dns:///localhost:1", "unix:/tmp/s"]
)
def test_sdk_sends_a_token_over_plaintext_to_this_machine_only(target):
    assert ChannelSecurity(token=TOKEN).credentials(target) is not None


@pytest.mark.parametrize("target", ["example.com:50051", "10.0.0.1:1", "[2001:db8::1]:1"])
def test_sdk_refuses_a_token_over_plaintext_to_another_host(target):
    with pytest.raises(ValueError, match="use TLS"):
        ChannelSecurity(token=TOKEN).credentials(target)


def test_the_token_is_never_printed():
    assert TOKEN not in repr(ChannelSecurity(token=TOKEN))
