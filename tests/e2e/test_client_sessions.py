"""Sessions from the SDK (sync and async, per-call and streamed) against the real server."""

from __future__ import annotations

import numpy as np
import pytest

from mha_client.errors import MhaServeError
from mha_client.sdk import AsyncClient, Client

ATOL = 1e-5


@pytest.fixture(scope="module")
def client(server):
    with Client(server.target) as c:
        yield c


def test_steps_and_stream_equal_one_causal_attend(client):
    x = np.random.default_rng(5).standard_normal((20, 512), dtype=np.float32)
    ref = client.attend("gqa", x, causal=True, weights=True)
    with client.create_session("gqa", max_len=64, ttl_s=30) as s:
        assert s.info.max_len == 64 and s.info.ttl_s == 30 and s.info.num_tokens == 0
        first = s.step(x[:12], weights=True, heads=[1, 6])
        assert first.weights.shape == (2, 12, 12) and first.session.num_tokens == 12
        np.testing.assert_allclose(first.weights, ref.weights[[1, 6], :12, :12], atol=ATOL)
        outs = [first.output]
        with s.stream() as stream:
            for t in range(12, 20):
                outs.append(stream.step(x[t : t + 1]).output)
        assert s.info.num_tokens == 20 and s.refresh().num_tokens == 20
        np.testing.assert_allclose(np.concatenate(outs), ref.output, atol=ATOL)
    with pytest.raises(MhaServeError) as err:
        s.refresh()
    assert "closed" in str(err.value)


def test_fork_from_the_sdk(client):
    x = np.random.default_rng(6).standard_normal((10, 512), dtype=np.float32)
    with client.create_session("mha") as parent:
        parent.step(x[:6])
        with parent.fork() as child:
            assert child.info.num_tokens == 6 and child.id != parent.id
            got = child.step(x[6:]).output
    np.testing.assert_allclose(got, client.attend("mha", x, causal=True).output[6:], atol=ATOL)


async def test_async_session_stream(server):
    x = np.random.default_rng(7).standard_normal((9, 512), dtype=np.float32)
    async with AsyncClient(server.target) as c:
        ref = (await c.attend("mqa", x, causal=True)).output
        async with await c.create_session("mqa") as s:
            outs = [(await s.step(x[:4])).output]
            async with s.stream() as stream:
                for t in range(4, 9):
                    outs.append((await stream.step(x[t : t + 1])).output)
            assert (await s.refresh()).num_tokens == 9
    np.testing.assert_allclose(np.concatenate(outs), ref, atol=ATOL)


def test_stream_error_carries_the_status(client):
    with client.create_session("mha", max_len=2) as s, s.stream() as stream:
        stream.step(np.zeros((2, 512), np.float32))
        with pytest.raises(MhaServeError) as err:
            stream.step(np.zeros((1, 512), np.float32))
        assert err.value.code.name == "OUT_OF_RANGE" and "max_len 2" in err.value.details
