"""The engine behind a Unix socket (serving/remote.py): a RemoteEngine answers exactly what
the AsyncEngine it stands for answers, for inline and shared-memory tensors, sessions,
errors, cancellation and a lost engine. One process, a real socket, the real engine."""

from __future__ import annotations

import asyncio
import os
import threading

import numpy as np
import pytest
import torch

from mha_serve.cache import SessionNotFound
from mha_serve.config import default_models
from mha_serve.engine import Engine, InvalidRequest, ModelNotFound, TooLarge
from mha_serve.engine.requests import Array
from mha_serve.engine.threads import ComputeThreads
from mha_serve.serving import AsyncEngine, Unavailable
from mha_serve.serving import link as remote_mod
from mha_serve.serving.host import EngineHost
from mha_serve.serving.link import Hello
from mha_serve.serving.remote import RemoteEngine
from tests.engine_calls import req, torched
from tests.helpers import suite_torch_device

BODY_TIMEOUT_S = 120


async def _attend(client, request):
    """(outcome with tensors, timing) of one attend through either EngineClient."""
    served = await client.attend(request, torched, received=0.0, deadline=None)
    return served.reply, served.timing


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(
        default_models(), device=suite_torch_device(), dtype=torch.float32, max_response_bytes=2**28
    )


def _run(engine: Engine, tmp_path, body) -> None:
    """body(local AsyncEngine, RemoteEngine, host) on one loop, over a real socket."""

    async def main() -> None:
        compute = ComputeThreads(1, 1)
        serving = AsyncEngine(engine, compute)
        host = EngineHost(tmp_path / "engine.sock")
        await host.start()
        host.ready(serving)
        remote = await RemoteEngine.connect(tmp_path / "engine.sock", engine_pid=os.getpid())
        try:  # bounded: a reply that never comes fails the test instead of hanging it
            await asyncio.wait_for(body(serving, remote, host), BODY_TIMEOUT_S)
        finally:
            await remote.close()
            await host.close()
            await serving.close()
            compute.shutdown()

    asyncio.run(main())


def _x(*shape: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _leftovers() -> list[str]:
    return [p.name for p in remote_mod.SHM_DIR.glob(f"{remote_mod.SHM_PREFIX}{os.getpid()}-*")]


@pytest.mark.parametrize(
    ("shape", "dtype", "weights"),
    [
        ((2, 16, 512), torch.float32, True),  # inline both ways
        ((1, 700, 512), torch.float32, False),  # 1.4 MB: shared memory both ways
        ((1, 1100, 512), torch.bfloat16, True),  # shared memory, bf16, weights 1100x1100
    ],
)
def test_remote_attend_equals_local(engine, tmp_path, shape, dtype, weights):
    async def body(local: AsyncEngine, remote: RemoteEngine, host) -> None:
        x = _x(*shape, seed=1, dtype=dtype)
        kwargs = {"need_weights": weights, "weight_heads": [3, 1] if weights else None}
        want, _ = await _attend(local, req("gqa", x.clone(), **kwargs))
        got, timing = await _attend(remote, req("gqa", x.clone(), **kwargs))
        assert got.output.dtype == want.output.dtype == dtype
        assert torch.equal(got.output, want.output)
        if weights:
            assert torch.equal(got.weights, want.weights) and got.weight_heads == [3, 1]
        else:
            assert got.weights is None
        assert timing.batch_size == shape[0] and timing.total_ms >= timing.compute_ms

    _run(engine, tmp_path, body)
    assert _leftovers() == []  # every shared-memory tensor was taken and unlinked


def test_calls_answered_together_each_get_their_own_answer(engine, tmp_path):
    """A batch's answers leave the engine process in one write; each reaches its caller."""

    async def body(local: AsyncEngine, remote: RemoteEngine, host) -> None:
        xs = [_x(1, 16, 512, seed=10 + i) for i in range(16)]
        got = await asyncio.gather(*(_attend(remote, req("mha", x.clone())) for x in xs))
        for x, (reply, _) in zip(xs, got, strict=True):
            want, _ = await _attend(local, req("mha", x.clone()))
            assert torch.allclose(reply.output, want.output, atol=1e-5)  # batched vs alone

    _run(engine, tmp_path, body)


def test_remote_session_steps_equal_a_causal_recompute(engine, tmp_path):
    async def body(local: AsyncEngine, remote: RemoteEngine, host) -> None:
        full = _x(1, 24, 512, seed=2)
        stats = await remote.create_session("mqa", 64, None, "tester")
        sid = stats.session_id
        outputs = []
        for start, end in ((0, 10), (10, 11), (11, 24)):
            call = req("", full[:, start:end].clone(), session_id=sid)  # model from it
            served = await remote.attend(call, torched, received=0.0, deadline=None)
            assert served.model == "mqa"  # the engine's resolution reaches the frontend
            assert call.model == ""  # and the request stays as the client asked it
            outputs.append(served.reply.output)
        ref, _ = await _attend(local, req("mqa", full.clone(), causal=True))
        assert torch.allclose(torch.cat(outputs, dim=1), ref.output, atol=1e-5)
        assert (await remote.get_session(sid)).num_tokens == 24
        fork = await remote.fork_session(sid, None)
        assert (await remote.truncate_session(fork.session_id, 5)).num_tokens == 5
        assert await remote.session_label(sid) == "mqa"
        info = await remote.cache_info("mqa")
        assert info == await local.cache_info("mqa") and info.num_sessions == 2
        await remote.close_session(fork.session_id)
        await remote.close_session(sid)
        assert (await local.cache_info("mqa")).num_blocks_used == 0

    _run(engine, tmp_path, body)


def test_remote_errors_keep_their_class_and_message(engine, tmp_path):
    async def body(local: AsyncEngine, remote: RemoteEngine, host) -> None:
        for op, args in (("get_session", ("nope",)), ("close_session", ("nope",))):
            with pytest.raises(SessionNotFound) as want:
                await getattr(local, op)(*args)
            with pytest.raises(SessionNotFound) as got:
                await getattr(remote, op)(*args)
            assert str(got.value) == str(want.value) and got.value.session_id == "nope"
        bad = _x(1, 4, 512, seed=3)
        bad[0, 2, 7] = float("nan")
        with pytest.raises(InvalidRequest, match="NaN"):
            await _attend(remote, req("mha", bad))
        with pytest.raises(ModelNotFound) as got_model:
            remote.model("nope")
        with pytest.raises(ModelNotFound) as want_model:
            local.model("nope")
        assert str(got_model.value) == str(want_model.value)
        assert [m.spec.name for m in remote.models()] == ["mha", "gqa", "mqa"]
        assert remote.model("gqa").num_parameters == local.model("gqa").num_parameters
        assert remote.model_label("nope") == "unknown" and remote.model_label("mha") == "mha"

    _run(engine, tmp_path, body)


def test_a_cancelled_remote_call_is_cancelled_in_the_engine(engine, tmp_path):
    async def body(local: AsyncEngine, remote: RemoteEngine, host) -> None:
        entered, release, cancelled = asyncio.Event(), asyncio.Event(), asyncio.Event()
        original = local.compute

        async def gated(call, **kwargs):
            entered.set()
            try:
                await release.wait()
            except asyncio.CancelledError:
                cancelled.set()
                raise
            return await original(call, **kwargs)

        local.compute = gated
        sid = (await remote.create_session("mha", None, None)).session_id
        call = req("mha", _x(1, 3, 512, seed=4), session_id=sid)
        task = asyncio.create_task(_attend(remote, call))
        await entered.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(cancelled.wait(), 30)  # the engine's task got the cancel
        local.compute = original
        step = req("mha", _x(1, 2, 512, seed=5), session_id=sid)
        await _attend(remote, step)  # not left busy
        assert (await remote.get_session(sid)).num_tokens == 2  # the cancelled step not kept

    _run(engine, tmp_path, body)


def _held_shm_write(monkeypatch):
    """Shm.write held on a worker thread until released: (entered, release) threading.Events."""
    real, entered, release = remote_mod.Shm.write, threading.Event(), threading.Event()

    def held(data, engine_pid, frontend_pid):
        if threading.current_thread() is not threading.main_thread():
            entered.set()
            release.wait(BODY_TIMEOUT_S)
        return real(data, engine_pid, frontend_pid)

    monkeypatch.setattr(remote_mod.Shm, "write", staticmethod(held))
    return entered, release


@pytest.mark.parametrize("end", ["frontend", "engine"])
def test_a_caller_gone_while_its_large_message_is_packed_leaves_no_file(
    engine, tmp_path, monkeypatch, end
):
    """The request (frontend) or the reply (engine) is being copied into shared memory on a
    worker thread when its caller goes: the file that thread writes goes too, not at the
    end of the link (a frontend's lasts as long as the frontend)."""
    entered, release = _held_shm_write(monkeypatch)

    async def body(local: AsyncEngine, remote: RemoteEngine, host) -> None:
        if end == "frontend":  # 1.4 MB: the request needs shared memory
            call = req("mha", _x(1, 700, 512, seed=20))
        else:  # the input inline, the reply's weights (5 MB) in shared memory
            call = req("mha", _x(1, 400, 512, seed=21), need_weights=True)
        task = asyncio.create_task(_attend(remote, call))
        while not entered.is_set():
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.2)  # (the engine's end: the cancel reaches its task)
        release.set()
        for _ in range(100):  # the thread's copy ends, then its file goes
            await asyncio.sleep(0.05)
            if not _leftovers():
                break
        assert _leftovers() == []  # while the link lives on
        small, _ = await _attend(remote, req("mha", _x(1, 4, 512, seed=22)))  # still serves
        assert small.output.shape == (1, 4, 512)

    _run(engine, tmp_path, body)


def test_a_lost_engine_fails_pending_and_later_calls_unavailable(engine, tmp_path):
    async def body(local: AsyncEngine, remote: RemoteEngine, host: EngineHost) -> None:
        entered = asyncio.Event()

        async def hang(session_id, caller=None):
            entered.set()
            await asyncio.Event().wait()

        local.get_session = hang
        pending = asyncio.create_task(remote.get_session("any"))
        await entered.wait()
        await host.close()  # the engine's end goes away with a call in flight
        with pytest.raises(Unavailable, match="engine process is gone"):
            await pending
        assert remote.lost.is_set()
        with pytest.raises(Unavailable):
            await remote.cache_info("mha")

    _run(engine, tmp_path, body)


@pytest.mark.parametrize("frame", ["malformed", "file gone"])
def test_a_frame_the_frontend_cannot_read_ends_the_link_as_a_lost_engine(tmp_path, frame):
    """Its calls fail UNAVAILABLE, `lost` is set and close() ends quietly (the frontend's
    stop runs to its end): never the frame's error out of close()."""

    async def main() -> None:
        me = os.getpid()

        async def engine_end(reader, writer) -> None:
            writer.writelines(remote_mod.pack(("hello", 0, Hello([], 1 << 20)), me, me))
            rid = (await remote_mod.read_frame(reader))[1]
            if frame == "malformed":
                parts = [remote_mod._HEAD.pack(1, 0, 5), b"xxxxx"]
            else:  # a reply in shared memory whose file went before the frontend took it
                big = Array(np.zeros((1, 600, 512), np.float32), "float32")
                parts = remote_mod.pack(("ok", rid, big), me, me)
                remote_mod.Shm.clean(me, me)
            writer.writelines(parts)
            await reader.read()  # until the frontend closes

        path = str(tmp_path / "engine.sock")
        server = await asyncio.start_unix_server(engine_end, path=path)
        remote = await RemoteEngine.connect(path, engine_pid=me)
        with pytest.raises(Unavailable, match="engine process is gone"):
            await asyncio.wait_for(remote.get_session("any"), BODY_TIMEOUT_S)
        assert remote.lost.is_set()
        await remote.close()
        server.close()

    asyncio.run(main())
    assert _leftovers() == []


def test_a_full_shared_memory_refuses_requests_and_answers_through_the_socket(
    engine, tmp_path, monkeypatch, caplog
):
    """No room in shared memory: a large request is refused (RESOURCE_EXHAUSTED, before
    anything ran); a large answer (computed, a session step kept by then) comes in the frame
    itself, the same as through shared memory, with a warning."""

    def no_room(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(remote_mod.os, "posix_fallocate", no_room)

    async def body(local: AsyncEngine, remote: RemoteEngine, host) -> None:
        big = _x(1, 700, 512, seed=6)  # 1.4 MB: the request itself needs shared memory
        with pytest.raises(TooLarge, match="no room in .* for a 1433600-byte tensor"):
            await _attend(remote, req("mha", big))
        small = _x(1, 400, 512, seed=7)  # inline, but its weights (5 MB) need shared memory
        call = req("mha", small, need_weights=True)
        result, _ = await _attend(remote, call)
        expected, _ = await _attend(local, call)
        assert torch.equal(result.weights, expected.weights)
        assert torch.equal(result.output, expected.output)
        sid = (await remote.create_session("mha", None, None, "")).session_id
        step = req("mha", small, session_id=sid, need_weights=True)
        result, _ = await _attend(remote, step)  # kept: its answer must arrive
        assert result.session.num_tokens == 400 and result.weights is not None
        assert (await remote.get_session(sid)).num_tokens == 400

    with caplog.at_level("WARNING", logger="mha_serve.serving.host"):
        _run(engine, tmp_path, body)
    assert _leftovers() == []
    assert any("goes through the socket" in r.getMessage() for r in caplog.records)


def test_an_answer_too_large_for_the_socket_says_its_step_was_kept(engine, tmp_path, monkeypatch):
    """Past SOCKET_FALLBACK_BYTES an answer with no room in shared memory is not sent through
    the socket (its copies would hold the engine's loop): its error says that the session
    step was kept, so that its caller does not send it again."""
    from mha_serve.serving import host as host_mod

    def no_room(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(remote_mod.os, "posix_fallocate", no_room)
    monkeypatch.setattr(host_mod, "SOCKET_FALLBACK_BYTES", 1 << 20)

    async def body(local: AsyncEngine, remote: RemoteEngine, host) -> None:
        small = _x(1, 400, 512, seed=7)  # its weights: 5 MB
        sid = (await remote.create_session("mha", None, None, "")).session_id
        with pytest.raises(TooLarge, match="this session step was kept") as err:
            await _attend(remote, req("mha", small, session_id=sid, need_weights=True))
        assert "do not send it again" in str(err.value)
        assert (await remote.get_session(sid)).num_tokens == 400
        with pytest.raises(TooLarge) as err:  # an Attend: nothing to keep, nothing said
            await _attend(remote, req("mha", small, need_weights=True))
        assert "kept" not in str(err.value)

    _run(engine, tmp_path, body)
    assert _leftovers() == []


def test_a_half_packed_message_leaves_no_file_and_no_waiter(engine, tmp_path, monkeypatch):
    """The reply's output finds room, its weights do not: the output's file goes too, the
    caller gets why (an answer past SOCKET_FALLBACK_BYTES), and nothing is left waiting in
    the frontend."""
    real, calls = remote_mod.os.posix_fallocate, []

    def third_has_no_room(fd, offset, length):
        calls.append(length)
        if len(calls) == 3:  # request input, reply output: room; reply weights: none
            raise OSError(28, "No space left on device")
        real(fd, offset, length)

    monkeypatch.setattr(remote_mod.os, "posix_fallocate", third_has_no_room)

    async def body(local: AsyncEngine, remote: RemoteEngine, host) -> None:
        call = req("mha", _x(1, 700, 512, seed=8), need_weights=True)
        with pytest.raises(TooLarge, match="no room"):  # (17 MB: past the socket's share)
            await _attend(remote, call)
        assert len(calls) == 3 and _leftovers() == []
        assert remote._pending == {}

    _run(engine, tmp_path, body)


def test_a_reply_that_cannot_be_packed_still_answers(engine, tmp_path, monkeypatch):
    """Any failure to send an answer's tensors (here not an OSError at all) reaches the
    caller as an error: never a call left waiting for good."""
    real = remote_mod.Shm.write

    def broken_after_the_request(data, engine_pid, frontend_pid):
        if broken_after_the_request.used:
            raise RuntimeError("mapping failed")
        broken_after_the_request.used = True
        return real(data, engine_pid, frontend_pid)

    broken_after_the_request.used = False
    monkeypatch.setattr(remote_mod.Shm, "write", staticmethod(broken_after_the_request))

    async def body(local: AsyncEngine, remote: RemoteEngine, host) -> None:
        big = _x(1, 700, 512, seed=9)
        with pytest.raises(RuntimeError, match="mapping failed"):
            await _attend(remote, req("mha", big))
        small, _ = await _attend(remote, req("mha", big[:, :4].clone()))  # still serves
        assert small.output.shape == (1, 4, 512)

    _run(engine, tmp_path, body)
    assert _leftovers() == []


def test_sequence_changes_are_one_engine_call_each(engine, tmp_path):
    """start_sequence makes, maps and replaces in one call; end_sequence unmaps and closes."""

    async def body(local: AsyncEngine, remote: RemoteEngine, host) -> None:
        key = ("gqa", "peer:test", 7)
        first = await remote.start_sequence(key, "gqa", "peer:test")
        second = await remote.start_sequence(key, "gqa", "peer:test")  # replaces the first
        assert await remote.sequence_session(key) == second != first
        with pytest.raises(SessionNotFound):
            await local.get_session(first)
        await remote.end_sequence(key, second, close=True)
        assert await remote.sequence_session(key) is None
        assert (await local.cache_info("gqa")).num_sessions == 0

    _run(engine, tmp_path, body)
