"""KV-cache sessions from the SDK: append tokens step by step, one call or one stream per step.

    with client.create_session("gqa") as s:        # closed on exit
        r = s.step(prompt)                          # (T, E): T tokens attend to all cached ones
        with s.stream() as stream:                  # a decode loop pays one stream, not a call
            for token in tokens:
                r = stream.step(token[None])        # r.session.num_tokens grows by one

A stream whose server is going away with its sessions moving elsewhere (a Ray Serve replica
being scaled down or redeployed ends its streams UNAVAILABLE, "reopen the stream and send
the messages that got no reply again") is reopened by the stream itself, and the step that
got no reply is sent again: the server answered every message it read before that status,
so the step was not kept and is kept once. At most MAX_REOPENS times a step, within the
stream's timeout; `stream(reopen=False)` raises that status instead.

A step the server refuses (INVALID_ARGUMENT, OUT_OF_RANGE, ...: REFUSALS, nothing of it
kept) ends its stream's call with that status, raised as the step's answer; the stream
object goes on: the next step opens another call. An ending that leaves open whether its
step was kept (the step cancelled or interrupted, a deadline, a lost connection, an
internal error, a reply past max_message_bytes) ends the stream object too: later steps
raise that status again, saying so (whether the step was kept, session.refresh() tells),
and another session.stream() goes on.

Step options are those of build_attend_request (weights, heads, query_range, head_mask, ...).
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import time
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Unpack

import grpc
import numpy as np

from mha_client import ops
from mha_client.errors import ClosedError, MhaServeError, ReplyError
from mha_client.messages import AttendOptions, AttendResult, SessionInfo, step_request_bytes

if TYPE_CHECKING:
    from mha_client.sdk import AsyncClient, Client

_END = object()  # tells a stream's request iterator to finish
_CLOSED = "this stream is closed; open another with session.stream()"
_BUSY = (
    "this stream already has a step in flight (another task's); nothing of this step was "
    "sent: send a stream's steps one at a time, each after the last one's reply"
)
# What a server says when it ends a stream whose sessions live on elsewhere
# (mha_serve.ray_app.moves.REOPEN; tests/e2e/test_stream_reopen.py holds the two together).
REOPEN_HINT = "reopen the stream and send the messages that got no reply again"
MAX_REOPENS = 3  # streams reopened for one step before its status is raised
# A step's status that says the server refused it, keeping nothing: after it the stream
# goes on, on another call (module doc). Other endings (CANCELLED, DEADLINE_EXCEEDED,
# UNAVAILABLE, INTERNAL, UNKNOWN, DATA_LOSS) may come after the step was kept, and so may
# RESOURCE_EXHAUSTED: gRPC's own when a reply is past the client's max_message_bytes, or a
# frontend worker's with no room to hand over an answer past 16 MiB (it says it was kept).
REFUSALS = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.UNIMPLEMENTED,
    }
)


def says_reopen(err: MhaServeError) -> bool:
    """A stream ended because its server is going and its sessions moved: reopen it, and
    send again what got no reply (none of it was kept)."""
    return err.code == grpc.StatusCode.UNAVAILABLE and REOPEN_HINT in (err.details or "")


def _ended_by(err: MhaServeError) -> MhaServeError:
    """What a stream keeps of `err`, a step's status that ended its call, for the steps after
    it: err itself for a refusal (the next step goes on, on another call), else what they
    raise: that status again, saying that an earlier step ended the stream."""
    if err.code in REFUSALS:
        return err
    if says_reopen(err):  # (reopen=False, or MAX_REOPENS spent): its words say it was not kept
        kept = "nothing of that step was kept"
    else:
        kept = "whether that step was kept, session.refresh() tells"
    return MhaServeError(
        err.code,
        f"this stream ended at an earlier step, with {err.code.name}: {err.details} ({kept}); "
        "open another with session.stream()",
        err.target,
    )


def _step_ended_it(how: str, target: str) -> MhaServeError:
    """What later steps raise once the caller broke off a step (`how`: cancelled,
    interrupted), which ended the stream's call: its reply could be read as the next one's."""
    return MhaServeError(
        grpc.StatusCode.CANCELLED,
        f"a step of this stream was {how}, which ended it (whether that step was kept, "
        "session.refresh() tells); open another with session.stream()",
        target,
    )


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(deadline - time.monotonic(), 0.0)


def _task_cancelling() -> bool:
    """Whether the running task is being cancelled. grpc.aio raises CancelledError also
    for a call cancelled under it (by another task, or a cancelled step before)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _read_step(session: Session | AsyncSession, resp: bytes, x, start: float):
    """A streamed step's reply, read as a unary one is (ops.step), into session.info."""
    try:
        return ops.read_step(session, resp, np.ndim(x) == 2, (time.perf_counter() - start) * 1e3)
    except ReplyError as e:
        e.target = session._client.target
        raise


class _Handle:
    """What both session classes hold: the client and the session's state as last returned."""

    def __init__(self, client: Any, info: SessionInfo) -> None:
        self._client = client
        self.info = info  # as of the last call that returned it

    @property
    def id(self) -> str:
        return self.info.session_id


class Session(_Handle):
    """A session on the server (blocking). Use as a context manager to close it on exit."""

    _client: Client

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def step(
        self, x: np.ndarray, *, timeout: float | None = None, **options: Unpack[AttendOptions]
    ) -> AttendResult:
        """Append x (T, E) or (1, T, E); its tokens attend to all cached tokens and themselves."""
        return self._client._run(ops.step(self, x, options), timeout)

    def stream(self, *, timeout: float | None = None, reopen: bool = True) -> SessionStream:
        """One bidirectional stream for many steps (timeout bounds the whole stream,
        reopened ones included); reopen: reopen it when its server says to (module doc)."""
        return SessionStream(self, timeout, reopen)

    def refresh(self, *, timeout: float | None = None) -> SessionInfo:
        return self._client._run(ops.refresh(self), timeout)

    def fork(self, *, ttl_s: float | None = None, timeout: float | None = None) -> Session:
        """A new session sharing this one's tokens (no copy until they diverge)."""
        return Session(self._client, self._client._run(ops.fork(self.id, ttl_s), timeout))

    def truncate(self, num_tokens: int, *, timeout: float | None = None) -> SessionInfo:
        """Keep the first num_tokens tokens and drop the rest (e.g. rejected draft tokens)."""
        return self._client._run(ops.truncate(self, num_tokens), timeout)

    def close(self, *, timeout: float | None = None) -> None:
        """Frees the session's cache at once; closing a session that is already gone is a no-op."""
        self._client._run(ops.close(self.id), timeout)


class SessionStream:
    """Steps over one StreamSession call; each step waits for its reply (in order). A stream
    is used by one thread at a time; close() from another thread ends it for good: a step
    under way ends with its call, and no later step reopens it."""

    def __init__(self, session: Session, timeout: float | None, reopen: bool = True) -> None:
        self._session = session
        client = session._client
        timeout = client.timeout if timeout is None else timeout
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._reopen = reopen
        self._closed = False
        self._open()

    def _open(self) -> None:
        if self._closed:  # by another thread, while a step was reopening it
            raise ClosedError(_CLOSED, self._session._client.target)
        client = self._session._client
        client._check_open()
        # The last step's status, when it ended this call (None: the call goes on), as
        # _ended_by keeps it: a refusal, or what later steps raise.
        self._ended: MhaServeError | None = None
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._replies: Iterator[bytes] = client._bytes_stub.StreamSession(
            iter(self._requests.get, _END),
            timeout=_remaining(self._deadline),
            metadata=client.call_metadata(),
        )
        # Ends the request stream once, on close() or when the stream is dropped unclosed
        # (gRPC's thread reading the requests would otherwise wait on the queue forever).
        self._end = weakref.finalize(self, self._requests.put, _END)

    def __enter__(self) -> SessionStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def step(self, x: np.ndarray, **options: Any) -> AttendResult:
        if self._closed:
            raise ClosedError(_CLOSED, self._session._client.target)
        start = time.perf_counter()
        request = step_request_bytes(self._session.id, x, options)
        if self._ended is not None:  # an earlier step's status ended the call
            if self._ended.code not in REFUSALS:
                raise self._ended
            self._end()  # a refusal (nothing kept): this step on another call
            self._open()
        for reopened in range(MAX_REOPENS + 1):
            try:
                return _read_step(self._session, self._round_trip(request), x, start)
            except MhaServeError as e:
                if not (self._reopen and says_reopen(e)) or reopened == MAX_REOPENS:
                    raise
            self._end()  # that call has ended: finish its request iterator, open another
            self._open()
        raise AssertionError("unreachable")

    def _round_trip(self, request: bytes) -> bytes:
        try:
            self._requests.put(request)
            return next(self._replies)
        except grpc.RpcError as err:
            e = MhaServeError.from_rpc_error(err, self._session._client.target)
            self._ended = _ended_by(e)
            raise e from err
        except StopIteration:  # the server ended the stream without a status: not expected
            e = MhaServeError(
                grpc.StatusCode.UNKNOWN,
                "the stream ended before this step's reply",
                self._session._client.target,
            )
            self._ended = _ended_by(e)
            raise e from None
        except BaseException:  # a KeyboardInterrupt (Ctrl-C) while waiting, say: this step's
            self._replies.cancel()  # reply would be read as the next one's, so the call ends
            self._ended = _step_ended_it("interrupted", self._session._client.target)
            raise

    def close(self) -> None:
        """Ends the stream and waits for the server to finish it; closing twice is a no-op."""
        if self._closed:
            return
        self._closed = True
        self._end()
        with contextlib.suppress(grpc.RpcError):  # an error was already raised by step()
            for _ in self._replies:  # drain: the server ends the stream after the last request
                pass


class AsyncSession(_Handle):
    """A session on the server (asyncio). `async with` closes it on exit."""

    _client: AsyncClient

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def step(
        self, x: np.ndarray, *, timeout: float | None = None, **options: Unpack[AttendOptions]
    ) -> AttendResult:
        return await self._client._run(ops.step(self, x, options), timeout)

    def stream(self, *, timeout: float | None = None, reopen: bool = True) -> AsyncSessionStream:
        """As Session.stream."""
        return AsyncSessionStream(self, timeout, reopen)

    async def refresh(self, *, timeout: float | None = None) -> SessionInfo:
        return await self._client._run(ops.refresh(self), timeout)

    async def fork(
        self, *, ttl_s: float | None = None, timeout: float | None = None
    ) -> AsyncSession:
        info = await self._client._run(ops.fork(self.id, ttl_s), timeout)
        return AsyncSession(self._client, info)

    async def truncate(self, num_tokens: int, *, timeout: float | None = None) -> SessionInfo:
        return await self._client._run(ops.truncate(self, num_tokens), timeout)

    async def close(self, *, timeout: float | None = None) -> None:
        await self._client._run(ops.close(self.id), timeout)


class AsyncSessionStream:
    """Steps over one StreamSession call; each step waits for its reply (in order).

    Cancelling a step ends the stream: the server may have kept the step or not
    (`session.refresh()` tells), and its reply can no longer be told from the next one's.
    Later steps raise MhaServeError CANCELLED; open another stream to go on. A step the
    server refuses leaves the stream usable (module doc). A step while another task's step
    of the stream is unanswered is refused ABORTED, nothing of it sent, as the server refuses
    a second step of a session: its reply could not be told from the other's."""

    def __init__(self, session: AsyncSession, timeout: float | None, reopen: bool = True) -> None:
        self._session = session
        timeout = session._client.timeout if timeout is None else timeout
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._reopen = reopen
        self._open()
        self._closed = False
        self._stepping = False  # a step is unanswered (another task's, meanwhile)

    def _open(self) -> None:
        client = self._session._client
        client._check_open()
        self._ended: MhaServeError | None = None  # as SessionStream's
        self._call = client._bytes_stub.StreamSession(
            timeout=_remaining(self._deadline), metadata=client.call_metadata()
        )

    async def __aenter__(self) -> AsyncSessionStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def step(self, x: np.ndarray, **options: Any) -> AttendResult:
        if self._closed:
            raise ClosedError(_CLOSED, self._session._client.target)
        if self._stepping:  # both would read the call's replies: either could get the other's
            raise MhaServeError(grpc.StatusCode.ABORTED, _BUSY, self._session._client.target)
        start = time.perf_counter()
        request = step_request_bytes(self._session.id, x, options)
        self._stepping = True
        try:
            if self._ended is not None:  # an earlier step's status ended the call
                if self._ended.code not in REFUSALS:
                    raise self._ended
                self._open()  # a refusal (nothing kept): this step on another call
            for reopened in range(MAX_REOPENS + 1):
                try:
                    return _read_step(self._session, await self._round_trip(request), x, start)
                except MhaServeError as e:
                    if not (self._reopen and says_reopen(e)) or reopened == MAX_REOPENS:
                        raise
                self._open()  # that call has ended: open another
            raise AssertionError("unreachable")
        finally:
            self._stepping = False

    async def _round_trip(self, request: bytes) -> bytes:
        try:
            if self._call.done():  # ended while no step was in flight: say how
                raise await self._ended_status()
            await self._call.write(request)
            resp = await self._call.read()
        except grpc.RpcError as err:
            e = MhaServeError.from_rpc_error(err, self._session._client.target)
            raise self._ending(self._as_deadline(e)) from err
        except asyncio.InvalidStateError:  # the call ended between done() and write()
            raise await self._ended_status() from None
        except asyncio.CancelledError:
            if _task_cancelling():  # whether the server got the step is unknown: end the call,
                self._call.cancel()  # or the next step could read this one's reply
                self._ended = _step_ended_it("cancelled", self._session._client.target)
                raise
            raise await self._ended_status() from None  # the call was cancelled, not this task
        if resp is grpc.aio.EOF:
            raise await self._ended_status()
        return resp

    def _ending(self, e: MhaServeError) -> MhaServeError:
        """e, a step's status that ended the call, kept for the steps after it (_ended_by)."""
        self._ended = _ended_by(e)
        return e

    async def _ended_status(self) -> MhaServeError:
        """The ended call's status as the error to raise (and kept, _ending)."""
        code, details = await self._call.code(), await self._call.details()
        e = MhaServeError(code, details, self._session._client.target)
        return self._ending(self._as_deadline(e))

    def _as_deadline(self, e: MhaServeError) -> MhaServeError:
        """grpcio ends a stream whose deadline passes as a step is written with INTERNAL
        ("Internal error from Core"), seen with deadlines of milliseconds; INTERNAL is a
        server bug in this API, so past the stream's deadline it is said as what it is."""
        if e.code != grpc.StatusCode.INTERNAL or self._deadline is None:
            return e
        if time.monotonic() < self._deadline:
            return e
        return MhaServeError(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"the stream's deadline passed (gRPC reported INTERNAL: {e.details})",
            e.target,
        )

    async def close(self) -> None:
        """Ends the stream and waits for the server to finish it; closing twice is a no-op.
        Cancelling the task that closes it cancels the call."""
        if self._closed:
            return
        self._closed = True
        if self._call.done():
            return
        try:
            with contextlib.suppress(grpc.RpcError, asyncio.InvalidStateError):  # it failed
                await self._call.done_writing()
                await self._call.code()  # the server ends the stream after the last request
        except asyncio.CancelledError:
            if _task_cancelling():
                self._call.cancel()
                raise
            # else the call was cancelled under us (a cancelled step): it has ended
