"""A replica that Ray stops moves its sessions to the replicas that stay (docs/ray.md,
"Scale-down and redeploy").

Ray 2.60 stops a replica (a scale-down, or a redeploy replacing it) in this order: it leaves
every router's view (no new call reaches it), its calls in flight drain, then its `__del__`
runs, within `graceful_shutdown_timeout_s` of the stop (replica.py,
`_perform_graceful_shutdown`). So:
- `Stopping` learns of the stop from the replica's own handle's router, the moment the
  replica leaves its view (leaving.when_leaving), and open streams end after their current
  step with UNAVAILABLE saying to reopen (`until_stopping`): an open stream is a call in
  flight, and would hold the drain until Ray kills the replica;
- `move_all`, from `__del__`, packs each session (its one record: cache/record.py), sends
  the bytes to a replica that stays (a handle call: Ray's object store carries them) which
  adopts it under the same id, owner, limits and idle time and records it in
  SequenceDirectory, and only then frees it here. Meanwhile the session's calls wait in
  the routers (router.py) and then go to its new home.

Why other replicas and not a store every replica reads (Ray's object store, a shared
directory): a session must live in some replica's KV cache to answer its next step, and
moving it there at once costs one copy; a store would add a copy and a restore on the next
call, outlive the replicas with objects nobody owns (an object in Ray's store dies with the
worker that put it, so it would need an owner that outlives the replica), and a shared
directory is one more system to run that Ray does not give. A replica killed outright
(SIGKILL, OOM, a lost node) moves nothing: its sessions are lost, as before.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from mha_serve.cache import SessionBusy, SessionNotFound
from mha_serve.ray_app.leaving import when_leaving

log = logging.getLogger(__name__)

MOVES_AT_ONCE = 4  # sessions packed and sent at a time (each holds one record's bytes)
BUSY_TRIES = 50  # a session still pinned by a call that is ending: tries, BUSY_WAIT_S apart
BUSY_WAIT_S = 0.02
SEND_TRIES = 5  # replicas tried for one session (one refused: it is stopping too)
MARGIN_S = 1.0  # of the shutdown budget left for the rest of the replica's shutdown
# No other replica in view this long: none stays, and no replacement is starting in time
# (it would be running by then: a replacement started in ~6 s on 2 cores). Moves give up.
NOWHERE_GRACE_S = 15.0
NOWHERE_POLL_S = 0.1  # how often a move under way asks
# Why a session was not moved (what SequenceDirectory records, and its NOT_FOUND says)
NOWHERE = f"no other replica ran for {NOWHERE_GRACE_S:g} s: none stays, and none could start"
OUT_OF_TIME = "not moved within the replica's graceful_shutdown_timeout_s"
MAX_WHY_CHARS = 300  # of a refusal's words kept (each receiver's, joined)
REOPEN = (
    "the Ray Serve replica {replica!r} serving this stream is stopping (scale-down or "
    "redeploy); its sessions move to another replica under the same ids: reopen the stream "
    "and send the messages that got no reply again"
)


class Stopping:
    """Whether Ray is stopping this replica, and since when (monotonic seconds)."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.since: float | None = None

    def set(self) -> None:
        if self.since is None:
            self.since = time.monotonic()
            log.info("Ray is stopping this replica: open streams end, sessions will move")
        self.event.set()

    def is_set(self) -> bool:
        return self.event.is_set()

    def watch(self, replica_id: str) -> None:
        """Set once a router in this process sees this replica leave its view."""
        loop = asyncio.get_running_loop()
        when_leaving(replica_id, lambda: loop.call_soon_threadsafe(self.set))


class UntilStopping:
    """A stream's requests, ending early (`cut`) once the replica is stopping: between two
    messages, never inside one's step (a message read is always answered)."""

    def __init__(self, requests: AsyncIterator[Any], stopping: Stopping) -> None:
        self._requests = requests.__aiter__()
        self._stopping = stopping
        self.cut = False

    def __aiter__(self) -> UntilStopping:
        return self

    async def __anext__(self) -> Any:
        if not self._stopping.is_set():
            following = asyncio.ensure_future(_next(self._requests))
            stop = asyncio.ensure_future(self._stopping.event.wait())
            try:
                await asyncio.wait({following, stop}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                stop.cancel()
            if following.done():  # (when both are, the message read is answered)
                item = following.result()
                if item is _END:
                    raise StopAsyncIteration
                return item
            # Left to end with the stream, not cancelled: cancelling a read that gRPC is in
            # the middle of can break the call, and the stream's status with it. A message
            # it still reads is never handed on (the client sends it again).
            following.add_done_callback(_dropped)
        self.cut = True
        raise StopAsyncIteration


_END = object()


def _dropped(read: asyncio.Future) -> None:
    if not read.cancelled():
        read.exception()  # (retrieved: the stream ended, so may its last read)


async def _next(requests: AsyncIterator[Any]) -> Any:
    try:
        return await requests.__anext__()
    except StopAsyncIteration:
        return _END


@dataclass
class Sent:
    """A receiver's answer: where the session now lives, or why it was refused."""

    replica: str = ""
    refused: str = ""


async def move_all(
    serving: Any,
    send: Callable[[bytes], Awaitable[Sent]],
    budget_s: float,
    nowhere: Callable[[], bool] = lambda: False,
) -> tuple[int, dict[str, str]]:
    """Moves every session this engine holds (live or spilled) through `send` (a handle call
    to a replica that stays); each is freed here once received there, its later calls here
    told where it went. Returns (sessions moved, {id not moved: why}). Sessions made or received
    meanwhile move too (the engine is asked again until it holds none). nowhere(): no
    replica stays or is coming to take them (leaving.none_stays): then no move is tried and
    one under way gives up, rather than wait on a handle with no replica behind it for the
    whole budget (and hold the replica's stop, and so a replacement's start, that long)."""
    deadline = time.monotonic() + budget_s
    moved, failed = 0, {}
    gate = asyncio.Semaphore(MOVES_AT_ONCE)

    async def one(session_id: str) -> None:
        nonlocal moved
        async with gate:
            left = deadline - time.monotonic()
            try:
                if nowhere():
                    raise NoReplicaStays
                if left <= 0:  # the budget is spent: none is tried
                    raise TimeoutError
                move = _unless(_move(serving, send, session_id), nowhere)
                where = await asyncio.wait_for(move, max(left, 0.0))
            except NoReplicaStays:  # (said once, by the caller)
                failed[session_id] = NOWHERE
                return
            except TimeoutError:
                log.error("session %s not moved: %s", session_id, OUT_OF_TIME)
                failed[session_id] = OUT_OF_TIME
                return
            except Exception as e:
                log.error("session %s not moved: %r", session_id, e)
                failed[session_id] = str(e)[:MAX_WHY_CHARS] or repr(e)
                return
            if where:
                moved += 1

    tried: set[str] = set()
    while ids := [s for s in await serving.session_ids() if s not in tried]:
        tried.update(ids)
        await asyncio.gather(*(one(s) for s in ids))
    return moved, failed


class NoReplicaStays(Exception):
    """No replica stays or is coming: a session has nowhere to move."""


async def _unless(move: Awaitable[str], nowhere: Callable[[], bool]) -> str:
    """move, given up (NoReplicaStays) once nowhere() says so."""
    task = asyncio.ensure_future(move)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=NOWHERE_POLL_S)
            if done:
                return task.result()
            if nowhere():
                raise NoReplicaStays
    finally:
        task.cancel()


async def _move(serving: Any, send: Callable[[bytes], Awaitable[Sent]], session_id: str) -> str:
    """One session sent and freed here; its new replica ("": it ended meanwhile)."""
    for _ in range(BUSY_TRIES):
        try:
            data = await serving.pack_session(session_id)
            break
        except SessionBusy:  # a call's pin not yet released (calls have drained)
            await asyncio.sleep(BUSY_WAIT_S)
        except SessionNotFound:  # closed or expired meanwhile
            return ""
    else:
        raise RuntimeError(f"session {session_id!r} stayed busy")
    refusals = []
    for _ in range(SEND_TRIES):
        try:
            sent = await send(data)
        except Exception as e:  # the receiver died or was cut off: try another
            sent = Sent(refused=repr(e))
        if sent.replica:
            await serving.session_moved(session_id, f"Ray Serve replica {sent.replica!r}")
            return sent.replica
        refusals.append(sent.refused)
    raise RuntimeError(f"no replica took it: {'; '.join(refusals)}")
