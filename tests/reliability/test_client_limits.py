"""A hostile client cannot take the cache from everyone: sessions and KV-cache bytes per
client identity (bearer token, certificate or peer address), RESOURCE_EXHAUSTED naming the
limit, while other clients keep creating and stepping."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from mha_client.channel import ChannelSecurity
from mha_client.errors import MhaServeError
from mha_client.sdk import AsyncClient
from mha_serve.cache import ClientQuotaExceeded, SessionTable
from mha_serve.config import ServerConfig
from mha_serve.engine import ModelSpec
from mha_serve.model import AttentionConfig
from mha_serve.transport.server import Server
from tests.helpers import free_port

BLOCK_BYTES = 2048  # AttentionConfig(64, 4, 1): 16 tokens x K and V x 1 head x 16 x float32


class Storage:
    num_blocks, block_size, bytes_per_block, budget_bytes = 64, 16, BLOCK_BYTES, 64 * BLOCK_BYTES

    def copy_block(self, src: int, dst: int) -> None:
        pass


def table(max_sessions: int, max_bytes: int) -> SessionTable:
    t = SessionTable()
    t.add_model("m", Storage())
    t.set_client_limits(max_sessions=max_sessions, max_bytes=max_bytes)
    return t


def test_table_counts_sessions_and_bytes_per_owner():
    t = table(max_sessions=2, max_bytes=3 * BLOCK_BYTES)
    a1, a2 = t.create("m", owner="a"), t.create("m", owner="a")
    with pytest.raises(ClientQuotaExceeded, match="max_sessions_per_client 2"):
        t.create("m", owner="a")
    with pytest.raises(ClientQuotaExceeded, match="holds 2 live sessions"):
        t.fork(a1.id)  # a fork counts against its parent's owner
    t.create("m", owner="b")  # another client is not affected
    t.create("m")  # nor sessions of nobody
    t.commit(t.reserve(a1.id, 32))  # 2 blocks
    with pytest.raises(ClientQuotaExceeded, match="max_cache_bytes_per_client 6144"):
        t.reserve(a2.id, 17)  # 2 more blocks: past 3
    assert t.session_stats(a2.id).num_blocks == 0  # the refused step allocated nothing
    t.commit(t.reserve(a2.id, 16))  # 1 block: exactly the limit
    t.close(a1.id)  # closing frees its share at once
    assert t.quota.bytes_held("a") == BLOCK_BYTES
    t.create("m", owner="a")
    t.truncate(a2.id, 0)
    assert t.quota.bytes_held("a") == 0


def test_no_limits_by_default():
    t = SessionTable()
    t.add_model("m", Storage())
    for _ in range(50):
        t.commit(t.reserve(t.create("m", owner="a").id, 16))
    assert t.quota.num_sessions("a") == 50


def step_input(n: int) -> np.ndarray:
    return np.random.default_rng(n).standard_normal((n, 64), dtype=np.float32)


def tokened_server(tmp_path, *tokens: str, **settings) -> Server:
    """A server of the small model that takes these bearer tokens, with these settings."""
    path = tmp_path / "tokens"
    path.write_text("".join(t + "\n" for t in tokens))
    models = [ModelSpec("small", AttentionConfig(64, 4, 1), seed=5, kv_cache_bytes=1 << 20)]
    return Server(
        ServerConfig(
            host="127.0.0.1",
            port=free_port(),
            metrics_port=0,
            models=models,
            auth_token_file=str(path),
            **settings,
        )
    )


async def test_a_hostile_token_holder_cannot_take_the_cache(tmp_path):
    server = tokened_server(
        tmp_path,
        "token-of-mallory",
        "token-of-alice",
        max_sessions_per_client=3,
        max_cache_bytes_per_client=4 * BLOCK_BYTES,
    )
    await server.start()
    target = f"127.0.0.1:{server.port}"
    mallory = AsyncClient(target, security=ChannelSecurity(token="token-of-mallory"))
    alice = AsyncClient(target, security=ChannelSecurity(token="token-of-alice"))
    try:
        hers = [await mallory.create_session("small") for _ in range(3)]
        with pytest.raises(MhaServeError) as too_many:
            await mallory.create_session("small")
        assert too_many.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_sessions_per_client 3" in too_many.value.details
        assert "token-of" not in too_many.value.details  # named by a hash, never itself

        await hers[0].step(step_input(64))  # 4 blocks: her whole share
        with pytest.raises(MhaServeError) as too_big:
            await hers[1].step(step_input(1))
        assert too_big.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_cache_bytes_per_client 8192" in too_big.value.details
        assert (await hers[1].refresh()).num_tokens == 0  # the refused step was not kept

        # Alice is unaffected: her own sessions and bytes.
        mine = await alice.create_session("small")
        result = await mine.step(step_input(40))
        assert result.session.num_tokens == 40

        await hers[0].close()  # freeing her share lets her go on
        assert (await hers[1].step(step_input(5))).session.num_tokens == 5
        await mallory.create_session("small")
    finally:
        await mallory.close()
        await alice.close()
        await server.stop()


async def test_peer_address_is_the_identity_without_credentials():
    models = [ModelSpec("small", AttentionConfig(64, 4, 1), seed=5, kv_cache_bytes=1 << 20)]
    cfg = ServerConfig(
        host="127.0.0.1", port=free_port(), metrics_port=0, models=models, max_sessions_per_client=1
    )
    server = Server(cfg)
    await server.start()
    try:
        # Two channels (two connections, two ports) from one host are one client.
        async with (
            AsyncClient(f"127.0.0.1:{server.port}") as a,
            AsyncClient(
                f"127.0.0.1:{server.port}", options=[("grpc.use_local_subchannel_pool", 1)]
            ) as b,
        ):
            await a.create_session("small")
            with pytest.raises(MhaServeError) as refused:
                await b.create_session("small")
        assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "client peer:ipv4:127.0.0.1 holds 1 live sessions" in refused.value.details
    finally:
        await server.stop()


async def test_a_spilled_session_comes_back_within_its_owners_byte_limit(tmp_path):
    """A spilled session holds no blocks, so its owner may fill its share meanwhile; bringing
    it back must not take the owner past max_cache_bytes_per_client."""
    server = tokened_server(
        tmp_path,
        "token-of-mallory",
        max_cache_bytes_per_client=4 * BLOCK_BYTES,
        session_spill_dir=str(tmp_path / "spill"),
        session_spill_bytes=1 << 24,
    )
    await server.start()
    mallory = AsyncClient(
        f"127.0.0.1:{server.port}", security=ChannelSecurity(token="token-of-mallory")
    )
    try:
        first = await mallory.create_session("small")
        await first.step(step_input(64))  # 4 blocks: her whole share
        assert server.serving.engine.spill_idle() == [first.id]  # (others' need of room)
        second = await mallory.create_session("small")
        await second.step(step_input(64))  # her share again, the first being on disk
        for call in (first.refresh(), first.step(step_input(1))):
            with pytest.raises(MhaServeError) as refused:
                await call
            assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max_cache_bytes_per_client 8192" in refused.value.details
        assert server.serving.engine.is_spilled(first.id)  # still on disk, as it was
        await second.close()
        assert (await first.refresh()).num_tokens == 64
    finally:
        await mallory.close()
        await server.stop()
