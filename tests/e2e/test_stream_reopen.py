"""The SDK's session stream reopens itself when its server ends it saying to (a Ray Serve
replica stopping while its sessions move: docs/ray.md), and sends again the step that got
no reply, which is kept once.

Between the SDK and the real server stands a real gRPC front on its own socket that
forwards every call, except that it ends the first `cuts` StreamSession calls the way a
stopping replica does: the message it read is not passed on, the status is UNAVAILABLE
with the replica's words. tests/ray_app/test_scale.py stops a real replica under a held
stream; here the SDK's side of it is held to every answer being kept exactly once."""

from __future__ import annotations

import _thread
import queue
import threading
from concurrent import futures

import grpc
import numpy as np
import pytest

from mha_client.errors import MhaServeError
from mha_client.sdk import AsyncClient, Client
from mha_client.sessions import MAX_REOPENS, REOPEN_HINT, says_reopen

ATOL = 1e-5
STREAM = "/mha.v1.AttentionService/StreamSession"
STOPPING = (
    "the Ray Serve replica 'r1' serving this stream is stopping (scale-down or redeploy); "
    f"its sessions move to another replica under the same ids: {REOPEN_HINT}"
)


class Front(grpc.GenericRpcHandler):
    """Forwards every method to `target` as bytes, a stream message by message over one
    stream there; while `cuts` > 0, the next message a stream reads ends that stream (with
    `status` and `words`) instead of being passed on, one cut each."""

    def __init__(self, target: str) -> None:
        self.channel = grpc.insecure_channel(target)
        self.cuts, self.status, self.words = 0, grpc.StatusCode.UNAVAILABLE, STOPPING
        self.streams = 0  # StreamSession calls seen
        self.lock = threading.Lock()
        # hold(): the next message a stream reads waits (entered set) until released, then is
        # passed on (the front's own call to the server outlives its caller's) and answered
        # by the server (forwarded set)
        self.holding, self.entered, self.released = False, threading.Event(), threading.Event()
        self.forwarded = threading.Event()

    def hold(self) -> None:
        self.entered.clear()
        self.released.clear()
        self.forwarded.clear()
        self.holding = True

    def service(self, details):
        method = details.method
        if method == STREAM:
            return grpc.stream_stream_rpc_method_handler(self.stream)
        forward = self.channel.unary_unary(method)

        def unary(request: bytes, context) -> bytes:
            return forward(request, metadata=context.invocation_metadata())

        return grpc.unary_unary_rpc_method_handler(unary)

    def stream(self, requests, context):
        with self.lock:
            self.streams += 1
        outbound: queue.SimpleQueue = queue.SimpleQueue()
        replies = self.channel.stream_stream(STREAM)(iter(outbound.get, None))
        try:
            for request in requests:
                with self.lock:
                    cut = self.cuts > 0
                    self.cuts -= cut
                if cut:  # read, not passed on: as a stopping replica, never kept
                    context.abort(self.status, self.words)
                held = self.holding
                if held:
                    self.holding = False
                    self.entered.set()
                    assert self.released.wait(10)
                outbound.put(request)
                reply = next(replies)
                if held:
                    self.forwarded.set()
                yield reply
        finally:
            outbound.put(None)


@pytest.fixture(scope="module")
def front(server):
    handler = Front(server.target)
    grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    grpc_server.add_generic_rpc_handlers([handler])
    port = grpc_server.add_insecure_port("127.0.0.1:0")
    grpc_server.start()
    handler.target = f"127.0.0.1:{port}"
    yield handler
    grpc_server.stop(None)
    handler.channel.close()


def cut(front: Front, n: int, status=grpc.StatusCode.UNAVAILABLE, words=STOPPING) -> None:
    front.cuts, front.status, front.words, front.streams = n, status, words, 0


def test_a_cut_stream_is_reopened_and_each_step_kept_once(front, server):
    x = np.random.default_rng(11).standard_normal((10, 512), dtype=np.float32)
    with Client(server.target) as direct:
        ref = direct.attend("gqa", x, causal=True).output
    with Client(front.target) as client, client.create_session("gqa") as s:
        outs = [s.step(x[:4]).output]
        with s.stream() as stream:
            outs.append(stream.step(x[4:5]).output)
            cut(front, 2)  # this stream is cut mid-way, and the one reopened for it too
            outs.append(stream.step(x[5:6]).output)  # reopened twice, sent a third time
            assert front.streams == 2
            for t in range(6, 10):
                outs.append(stream.step(x[t : t + 1]).output)
        assert s.refresh().num_tokens == 10  # no step kept twice, none lost
    np.testing.assert_allclose(np.concatenate(outs), ref, atol=ATOL)


async def test_the_async_stream_reopens_too(front, server):
    x = np.random.default_rng(12).standard_normal((6, 512), dtype=np.float32)
    async with AsyncClient(server.target) as direct:
        ref = (await direct.attend("mqa", x, causal=True)).output
    async with AsyncClient(front.target) as client, await client.create_session("mqa") as s:
        outs = [(await s.step(x[:3])).output]
        cut(front, 1)
        async with s.stream() as stream:
            for t in range(3, 6):
                outs.append((await stream.step(x[t : t + 1])).output)
        assert front.streams == 2
        assert (await s.refresh()).num_tokens == 6
    np.testing.assert_allclose(np.concatenate(outs), ref, atol=ATOL)


def test_other_statuses_and_reopen_false_are_raised_as_they_came(front):
    x = np.zeros((1, 512), np.float32)
    with Client(front.target) as client, client.create_session("mha") as s:
        cut(front, 1, words="the server is shutting down")  # UNAVAILABLE, not a move
        with s.stream() as stream, pytest.raises(MhaServeError) as err:
            stream.step(x)
        assert err.value.code == grpc.StatusCode.UNAVAILABLE and front.streams == 1
        cut(front, 1)
        with s.stream(reopen=False) as stream, pytest.raises(MhaServeError) as err:
            stream.step(x)
        assert says_reopen(err.value) and front.streams == 1
        cut(front, MAX_REOPENS + 1)  # cut every time: the last status is raised
        with s.stream() as stream, pytest.raises(MhaServeError) as err:
            stream.step(x)
        assert says_reopen(err.value) and front.streams == MAX_REOPENS + 1
        assert s.refresh().num_tokens == 0  # nothing cut was ever kept


@pytest.mark.parametrize("use_async", [False, True])
async def test_after_an_uncertain_ending_later_steps_say_so(front, use_async):
    """A stream that ended UNAVAILABLE without the words to reopen (the step got no reply:
    kept or not, the client cannot tell) stays ended: every later step raises that status,
    saying that an earlier step ended it, and opens nothing; another stream goes on. A
    refused step's stream goes on (tests/e2e/test_client_sessions.py)."""
    x = np.zeros((1, 512), np.float32)
    async with AsyncClient(front.target) as ac:
        with Client(front.target) as client, client.create_session("mha") as s:
            cut(front, 1, words="the server is shutting down")
            stream = ac.session(s.id).stream() if use_async else s.stream()

            async def step():
                return await stream.step(x) if use_async else stream.step(x)

            with pytest.raises(MhaServeError) as first:
                await step()
            assert first.value.code == grpc.StatusCode.UNAVAILABLE
            for _ in range(2):
                with pytest.raises(MhaServeError) as err:
                    await step()
                assert err.value.code == grpc.StatusCode.UNAVAILABLE
                assert "ended at an earlier step" in err.value.details
                assert (
                    "shutting down" in err.value.details
                    and "session.refresh()" in err.value.details
                )
            assert front.streams == 1  # nothing reopened
            await stream.close() if use_async else stream.close()
            with s.stream() as again:
                assert again.step(x).session.num_tokens == 1


def test_an_interrupted_sync_step_ends_the_stream(front):
    """A KeyboardInterrupt (Ctrl-C) while a sync step waits for its reply: the step's reply
    must never be read as the next step's. The call ends, later steps say the stream was
    interrupted, close() works, and another stream goes on from what the server kept (here
    the interrupted step too: the front passes it on once released, as a server that got
    the step before the cancel keeps it)."""
    x = np.zeros((1, 512), np.float32)
    with Client(front.target) as client, client.create_session("mha") as s:
        cut(front, 0)
        stream = s.stream()
        stream.step(x)
        front.hold()  # the next step waits in the front: its reply cannot have come
        interrupter = threading.Thread(
            target=lambda: front.entered.wait(10) and _thread.interrupt_main()
        )
        interrupter.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                stream.step(np.ones((3, 512), np.float32))
        finally:
            interrupter.join()
            front.released.set()
        assert front.forwarded.wait(10)  # the held step reached the server after all: kept
        for _ in range(2):
            with pytest.raises(MhaServeError) as err:
                stream.step(x)
            assert err.value.code == grpc.StatusCode.CANCELLED
            assert "interrupted" in err.value.details
        stream.close()
        assert s.refresh().num_tokens == 4  # (what session.refresh() is there to tell)
        with s.stream() as again:
            assert again.step(x).session.num_tokens == 5


def test_the_ray_replicas_words_are_the_ones_the_sdk_reopens_on():
    pytest.importorskip("ray", reason="the Ray Serve app's message (mha_serve.ray_app)")
    from mha_serve.ray_app.moves import REOPEN

    err = MhaServeError(grpc.StatusCode.UNAVAILABLE, REOPEN.format(replica="r1"))
    assert says_reopen(err)
    assert not says_reopen(MhaServeError(grpc.StatusCode.NOT_FOUND, err.details))
