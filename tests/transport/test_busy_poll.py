"""--busy-poll-us: a server process's event loop polls without blocking for that long before
it sleeps (transport/busy_poll.py), never while one of its batches computes; bad values are
refused with a message that says why. What the selector does is read from the calls it makes
(their timeouts), never timed; a busy-polling server answers as the engine computes in this
process."""

from __future__ import annotations

import asyncio
import selectors
import socket
import threading

import numpy as np
import pytest

from mha_client.sdk import Client
from mha_serve.batching import batcher
from mha_serve.config import MAX_BUSY_POLL_US, build_config
from mha_serve.transport import busy_poll
from tests.helpers import ServerProcess


@pytest.mark.parametrize("value", [0, 1, 300, MAX_BUSY_POLL_US])
def test_busy_poll_us_takes_0_to_10_ms(value):
    assert build_config(None, {"busy_poll_us": value}).busy_poll_us == value


@pytest.mark.parametrize("value", [-1, MAX_BUSY_POLL_US + 1])
def test_busy_poll_us_out_of_range_is_refused(value):
    with pytest.raises(ValueError, match=rf"busy_poll_us {value} must be 0 \(off\) to 10000"):
        build_config(None, {"busy_poll_us": value})


class _Recording(selectors.DefaultSelector):
    """The platform's selector, noting the timeout of every select made of it."""

    def __init__(self) -> None:
        super().__init__()
        self.timeouts: list[float | None] = []

    def select(self, timeout=None):
        self.timeouts.append(timeout)
        return super().select(timeout)


class _Probe(busy_poll.BusyPollSelector, _Recording):
    """A BusyPollSelector whose selects of the platform's are noted (its own, no other's)."""


def test_an_idle_selector_polls_without_blocking_then_blocks_for_the_rest():
    with _Probe(0.002) as sel:
        assert sel.select(0.5) == []
    timeouts = sel.timeouts
    assert len(timeouts) >= 2 and set(timeouts[:-1]) == {0}
    assert 0 < timeouts[-1] < 0.5  # the rest of the timeout, after the polling


def test_a_ready_socket_is_taken_while_polling():
    a, b = socket.socketpair()
    with a, b, _Probe(10.0) as sel:  # a 10 s window: it never ends here
        sel.register(a, selectors.EVENT_READ)
        b.send(b"x")
        ready = sel.select(None)
        assert [key.fileobj for key, _ in ready] == [a]
    assert set(sel.timeouts) == {0}  # found by a poll: it never blocked


def test_no_polling_for_a_zero_timeout_or_while_a_batch_computes(monkeypatch):
    with _Probe(10.0) as sel:
        assert sel.select(0) == []
        monkeypatch.setattr(batcher, "_computing", 1)
        assert sel.select(0.01) == []
    assert sel.timeouts == [0, 0.01]


def test_computing_counts_the_batches_on_their_threads():
    """batcher.computing() is one more while a batch runs on its thread than before and
    after (the process's other batchers, any, idle meanwhile)."""
    from mha_serve.spec import BatchPolicy

    inside, release = threading.Event(), threading.Event()

    def run_batch(payloads):
        inside.set()
        release.wait(10)
        return list(payloads)

    async def main():
        b = batcher.Batcher("t", run_batch, BatchPolicy())
        before = batcher.computing()
        call = asyncio.ensure_future(b.submit("p", sequences=1, length=1))
        await asyncio.to_thread(inside.wait, 10)
        seen = batcher.computing() - before
        release.set()
        result, _ = await call
        await b.close()
        return seen, result, batcher.computing() - before

    assert asyncio.run(main()) == (1, "p", 0)


def test_run_uses_the_busy_poll_loop_only_when_asked():
    async def selector():
        return type(asyncio.get_running_loop()._selector)  # noqa: SLF001

    assert busy_poll.run(selector(), 300) is busy_poll.BusyPollSelector
    assert busy_poll.run(selector(), 0) is not busy_poll.BusyPollSelector


@pytest.mark.parametrize("workers", [1, 2])
def test_a_busy_polling_server_answers_as_the_engine_computes(tmp_path, workers):
    """A session's prompt and its lone decode steps (run on the polling loop's thread) equal
    the same steps through the engine in this process; with frontend workers every process
    polls (the frontends' and the engine's loops)."""
    import torch

    from mha_serve.config import default_models
    from mha_serve.engine import Array, AttendRequest, Engine

    rng = np.random.default_rng(5)
    x = rng.standard_normal((6, 512), dtype=np.float32)
    engine = Engine(
        default_models(), device=torch.device("cpu"), dtype=torch.float32, max_response_bytes=2**28
    )
    sid = engine.create_session("gqa").session_id
    want = [
        engine.attend(AttendRequest("gqa", Array(part[None], "float32"), session_id=sid))
        for part in (x[:3], x[3:4], x[4:5], x[5:6])
    ]
    flags = ["--busy-poll-us", "300", "--frontend-workers", str(workers)]
    proc = ServerProcess(*flags, log_path=tmp_path / "mha-serve.log")
    try:
        proc.wait_serving()
        with Client(proc.target) as client:
            session = client.create_session("gqa")
            got = [session.step(x[:3])]
            with session.stream() as stream:
                got += [stream.step(x[i : i + 1]) for i in (3, 4, 5)]
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g.output, w.output.data[0], rtol=1e-5, atol=1e-5)
    finally:
        assert proc.stop() == 0, proc.log()
