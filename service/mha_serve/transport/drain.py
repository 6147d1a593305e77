"""Graceful stop for the gRPC doors (docs/RELIABILITY.md, "Shutdown"): once the server drains,
each new call is answered UNAVAILABLE by its own handler, an open stream ends UNAVAILABLE at
its next message, and the server waits for the calls still in their handlers, and for the
calls to stop coming, before it closes the port: gRPC cancels a call that reaches a closing
server, so the port closes only when none is arriving (or the grace period is over)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from mha_serve import metrics

SHUTTING_DOWN = "the server is shutting down; retry on another replica"
AT_LIMIT = (
    "this server is handling {limit} calls at once, its max_concurrent_rpcs (open streams "
    "count for as long as they are open); retry later, or raise the limit"
)
# With frontend workers the limit is each frontend's: the refusal says which one refused.
FRONTEND_AT_LIMIT = (
    "frontend worker {index} of {count} is handling {limit} calls at once, its "
    "max_concurrent_rpcs: the limit is per frontend worker (open streams count for as long "
    "as they are open); retry later (a new connection may reach another frontend), or raise "
    "the limit"
)
# gRPC's own limit of concurrent RPCs is set this much above the guarded calls' limit
# (max_concurrent_rpcs): health checks, reflection and calls whose request is still
# arriving get through (gRPC's refusal is uncounted and does not say which limit), while
# the bytes held stay bounded.
GRPC_HEADROOM = 32
# The port closes once no call arrived or ended for this long: a client answered or refused
# has moved on (or backs off), so no call of its reaches the closing server (CANCELLED).
QUIET_S = 0.25


class Draining(Exception):
    """A stream's next message was read, or awaited, once draining began."""


class Drain:
    """Counts the calls inside the handlers it guards; once `close`d, refuses new ones; past
    `max_calls` of them at once, refuses new ones RESOURCE_EXHAUSTED (counted, saying which
    limit: gRPC's own refusal is neither)."""

    def __init__(
        self, quiet_s: float = QUIET_S, max_calls: int | None = None, at_limit: str = AT_LIMIT
    ) -> None:
        """at_limit: the refusal past max_calls, formatted with limit=max_calls."""
        self.quiet_s = quiet_s
        self.max_calls = max_calls  # None: no limit of its own
        self.at_limit = at_limit
        self.in_flight = 0  # calls inside a guarded handler
        self.closed = False
        self.refused = 0  # calls and stream messages answered UNAVAILABLE once closed
        self._last_activity = 0.0  # time.monotonic() at which a call last arrived or ended
        self._idle = asyncio.Event()
        self._idle.set()
        # Tasks waiting for a stream's next message, and those `close` cancelled for it.
        self._reading: set[asyncio.Task] = set()
        self._interrupted: set[asyncio.Task] = set()

    def close(self) -> None:
        """Draining begins: new calls are refused and streams waiting for a message end."""
        self.closed = True
        for task in self._reading:
            self._interrupted.add(task)
            task.cancel()

    async def wait(self, timeout_s: float) -> None:
        """Once closed: until no call is in a guarded handler and none arrived or ended for
        `quiet_s`, or `timeout_s` passed (then `in_flight` says how many are still running)."""
        deadline = time.monotonic() + timeout_s
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        while self.in_flight == 0 and (now := time.monotonic()) < deadline:
            quiet_at = self._last_activity + self.quiet_s
            if now >= quiet_at:
                return
            await asyncio.sleep(min(quiet_at, deadline) - now)

    def guard(
        self,
        handler: Callable[..., Any],
        *,
        method: str,
        protocol: str,
        request_streaming: bool,
        response_streaming: bool,
    ) -> Callable[..., Any]:
        """`handler` (a coroutine function, or an async generator function for streamed
        responses) refusing calls once draining began; streamed requests are read through
        `messages`, and a stream that Draining ends is answered UNAVAILABLE after its replies."""

        def requests(request: Any) -> Any:
            return self.messages(request) if request_streaming else request

        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if self.closed:
                await self._refuse(method, protocol, context)
            if self.max_calls is not None and self.in_flight >= self.max_calls:
                await self._at_limit(method, protocol, context)
            self._enter()
            try:
                return await handler(requests(request), context)
            except Draining:
                await self._refuse(method, protocol, context)
            finally:
                self._exit()

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            if self.closed:
                await self._refuse(method, protocol, context)
            if self.max_calls is not None and self.in_flight >= self.max_calls:
                await self._at_limit(method, protocol, context)
            self._enter()
            try:
                async with contextlib.aclosing(handler(requests(request), context)) as out:
                    async for reply in out:
                        yield reply
            except Draining:
                await self._refuse(method, protocol, context)
            finally:
                self._exit()

        return stream if response_streaming else unary

    # (Plain calls, not a context manager: a few microseconds less on every call.)
    def _enter(self) -> None:
        if self.in_flight == 0:
            self._idle.clear()
        self.in_flight += 1
        self._last_activity = time.monotonic()

    def _exit(self) -> None:
        self._last_activity = time.monotonic()
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    async def messages(self, requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
        """A stream's messages until draining begins; then Draining, at once if it waits for
        one (the task reading is cancelled), else when the next one is asked for."""
        iterator = aiter(requests)
        while True:
            if self.closed:
                raise Draining
            task = asyncio.current_task()  # the reader (not always the handler's own task)
            self._reading.add(task)
            try:
                message = await anext(iterator)
            except StopAsyncIteration:
                return
            except asyncio.CancelledError:
                if task not in self._interrupted:
                    raise
                task.uncancel()
                raise Draining from None
            finally:
                self._reading.discard(task)
                self._interrupted.discard(task)
            yield message

    async def _refuse(self, method: str, protocol: str, context: grpc.aio.ServicerContext) -> None:
        """UNAVAILABLE (retryable elsewhere), counted like every answered call."""
        self.refused += 1
        self._last_activity = time.monotonic()
        metrics.count_request(method, "unknown", grpc.StatusCode.UNAVAILABLE.name, protocol)
        await context.abort(grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN)

    async def _at_limit(
        self, method: str, protocol: str, context: grpc.aio.ServicerContext
    ) -> None:
        """RESOURCE_EXHAUSTED (retryable later), counted like every answered call."""
        self._last_activity = time.monotonic()
        code = grpc.StatusCode.RESOURCE_EXHAUSTED
        metrics.count_request(method, "unknown", code.name, protocol)
        await context.abort(code, self.at_limit.format(limit=self.max_calls))
