"""What the Ingress answers when Ray itself fails a call (forward.py): a replica that Ray
reports unreachable but that still runs keeps its sessions (UNAVAILABLE, retry); one that
died, or whose actor is gone, lost them (NOT_FOUND naming the session or sequence)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

pytest.importorskip("ray")

from ray.exceptions import ActorDiedError, ActorUnavailableError  # noqa: E402

from mha_serve.ray_app.forward import forward  # noqa: E402
from mha_serve.ray_app.ids import session_prefix  # noqa: E402

SESSION = session_prefix("r1") + "a" * 32


class Failing:
    """A DeploymentHandle whose call fails with `error`."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    async def _raise(self):
        raise self.error

    def remote(self, *args):
        return self._raise()


def answer(error: Exception, *, alive: bool | None, session_id: str = SESSION, what: str = ""):
    asked: list[str] = []

    async def is_alive(replica: str) -> bool:
        asked.append(replica)
        assert alive is not None, "liveness asked where the error already says"
        return alive

    reply = asyncio.run(
        forward(Failing(error), "Attend", None, session_id=session_id, what=what, alive=is_alive)
    )
    return reply, asked


def unavailable() -> ActorUnavailableError:
    return ActorUnavailableError("the connection to the replica was lost", None)


def test_unreachable_but_alive_is_unavailable_not_gone():
    reply, asked = answer(unavailable(), alive=True)
    assert asked == ["r1"]
    assert reply.code == grpc.StatusCode.UNAVAILABLE, reply
    assert "still runs: retry" in reply.details and SESSION in reply.details


def test_unreachable_and_gone_is_not_found():
    reply, _ = answer(unavailable(), alive=False)
    assert reply.code == grpc.StatusCode.NOT_FOUND, reply
    assert f"session {SESSION!r} is gone" in reply.details and "'r1'" in reply.details


def test_died_is_not_found_without_asking():
    reply, asked = answer(ActorDiedError(), alive=None)
    assert asked == [] and reply.code == grpc.StatusCode.NOT_FOUND, reply
    reply, _ = answer(ActorDiedError(), alive=None, what="sequence 7 to model 'mha'")
    assert "sequence 7 to model 'mha'" in reply.details and "sequence_start" in reply.details


def test_no_session_is_unavailable():
    for error in (unavailable(), ActorDiedError()):
        reply, asked = answer(error, alive=None, session_id="")
        assert asked == [] and reply.code == grpc.StatusCode.UNAVAILABLE, reply
        assert "retry" in reply.details


class Hanging:
    """A DeploymentHandle whose call never answers; it records its cancellation."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.cancelled = False

    async def _wait(self):
        self.started.set()
        await asyncio.Event().wait()

    def remote(self, *args):
        handle = self

        class Response:
            def __await__(self):
                return handle._wait().__await__()

            def cancel(self):
                handle.cancelled = True

        return Response()


def test_a_caller_that_leaves_cancels_its_call():
    """A stream message's call carries a request id of its own (own_request_id), so Ray's
    cancellation of the stream does not reach it by id: forward cancels it itself."""

    async def run() -> Hanging:
        handle = Hanging()
        task = asyncio.create_task(forward(handle, "Attend", None, session_id=SESSION))
        await handle.started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return handle

    assert asyncio.run(run()).cancelled
