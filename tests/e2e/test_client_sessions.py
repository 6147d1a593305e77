"""Sessions from the SDK (sync and async, per-call and streamed) against the real server."""

from __future__ import annotations

import gc
import threading
import time

import numpy as np
import pytest

from mha_client.errors import ClosedError, MhaServeError
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
        assert (s.info.max_len, s.info.ttl_s) == (64, 30)  # step replies keep the limits
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


def test_a_refused_step_leaves_the_stream_usable(client):
    """A step the server refuses ends the stream's call with its status, raised as that
    step's answer; the next steps go on (on another call), each answered for itself, and
    the session holds exactly the steps kept (a step refused on the client alike)."""
    x = np.ones((1, 512), np.float32)
    with client.create_session("gqa") as s:
        stream = s.stream()
        stream.step(x)
        with pytest.raises(MhaServeError) as err:
            stream.step(x, causal=False)
        assert err.value.code.name == "INVALID_ARGUMENT" and "causal" in err.value.details
        assert stream.step(x, weights=True).weights is not None  # not the earlier error
        with pytest.raises(MhaServeError) as err:
            stream.step(np.ones((1, 256), np.float32))  # the server's: wrong embed_dim
        assert err.value.code.name == "INVALID_ARGUMENT" and "embed_dim" in err.value.details
        assert stream.step(x, output_dtype="float16").output.dtype == np.float16
        with pytest.raises(MhaServeError):
            stream.step(np.ones(512, np.float32))  # the client's: 1-D
        assert stream.step(x).session.num_tokens == 4
        stream.close()
        assert s.refresh().num_tokens == 4


async def test_a_refused_step_leaves_the_async_stream_usable(server):
    x = np.ones((1, 512), np.float32)
    async with AsyncClient(server.target) as c, await c.create_session("mqa") as s:
        async with s.stream() as stream:
            for kept in range(1, 4):
                with pytest.raises(MhaServeError) as err:
                    await stream.step(x, causal=False)
                assert err.value.code.name == "INVALID_ARGUMENT"
                assert (await stream.step(x)).session.num_tokens == kept
        assert (await s.refresh()).num_tokens == 3


def test_a_reply_past_the_clients_limit_ends_the_stream(server):
    """gRPC refuses a reply larger than the client's max_message_bytes after the server kept
    its step: RESOURCE_EXHAUSTED there is no refusal of the step, so the stream does not go
    on as if nothing was kept; later steps say an earlier step ended it."""
    x = np.ones((256, 512), np.float32)
    with Client(server.target, max_message_bytes=1 << 20) as c, c.create_session("mha") as s:
        stream = s.stream()
        with pytest.raises(MhaServeError) as err:
            stream.step(x, weights=True)  # 256 x 8 x 256 float32 weights: 2 MiB
        assert err.value.code.name == "RESOURCE_EXHAUSTED"
        with pytest.raises(MhaServeError) as err:
            stream.step(x[:1])
        assert err.value.code.name == "RESOURCE_EXHAUSTED"
        assert "ended at an earlier step" in err.value.details
        stream.close()
        assert s.refresh().num_tokens == 256  # (it was kept)


def test_a_closed_stream_says_so(client):
    with client.create_session("mqa") as s:
        stream = s.stream()
        stream.step(np.ones((1, 512), np.float32))
        stream.close()
        stream.close()  # twice is a no-op
        # A ClosedError (an MhaServeError, as every SDK error), still the RuntimeError it was.
        with pytest.raises(ClosedError, match="stream is closed") as err:
            stream.step(np.ones((1, 512), np.float32))
        assert isinstance(err.value, RuntimeError)
        assert s.refresh().num_tokens == 1


async def test_async_stream_after_a_refusal_answers_the_next_step(server):
    """Sync and async streams agree: after the server refused a step, the next step is
    answered for itself (here refused again: the session is full), and a closed stream says
    it is closed."""
    async with AsyncClient(server.target) as c, await c.create_session("mha", max_len=2) as s:
        stream = s.stream()
        await stream.step(np.zeros((2, 512), np.float32))
        for _ in range(2):
            with pytest.raises(MhaServeError) as err:
                await stream.step(np.zeros((1, 512), np.float32))
            assert err.value.code.name == "OUT_OF_RANGE" and "max_len 2" in err.value.details
        await stream.close()
        with pytest.raises(ClosedError, match="stream is closed") as err:
            await stream.step(np.zeros((1, 512), np.float32))
        assert isinstance(err.value, RuntimeError)


def test_a_dropped_unclosed_stream_ends_its_request_thread(client):
    """gRPC reads a sync stream's requests on a thread of its own, which waited forever on a
    stream that was dropped without close(); now dropping it ends the request stream."""
    with client.create_session("gqa") as s:
        before = threading.active_count()
        stream = s.stream()
        stream.step(np.ones((1, 512), np.float32))  # gRPC's threads for it are running now
        assert threading.active_count() > before
        del stream
        gc.collect()
        deadline = time.monotonic() + 10
        while threading.active_count() > before and time.monotonic() < deadline:
            time.sleep(0.01)
        assert threading.active_count() <= before
        assert s.refresh().num_tokens == 1


def test_truncate_rewinds_a_session_from_the_sdk(client):
    x = np.random.default_rng(16).standard_normal((12, 512), dtype=np.float32)
    draft = np.random.default_rng(17).standard_normal((4, 512), dtype=np.float32)
    with client.create_session("gqa") as s:
        s.step(x[:8])
        s.step(draft)  # a verifier accepts the first draft token only
        info = s.truncate(9)
        assert info.num_tokens == 9 and s.info.num_tokens == 9 and info.num_blocks == 1
        got = s.step(x[9:12]).output
        with pytest.raises(MhaServeError) as err:
            s.truncate(13)
        assert err.value.code.name == "INVALID_ARGUMENT" and "holds 12 tokens" in err.value.details
        for bad, fragment in ((-1, "an int >= 0"), (2**64, "past any session's length")):
            with pytest.raises(ValueError, match=fragment):
                s.truncate(bad)
    ref = client.attend("gqa", np.concatenate([x[:8], draft[:1], x[9:12]]), causal=True).output
    np.testing.assert_allclose(got, ref[9:], atol=ATOL)
