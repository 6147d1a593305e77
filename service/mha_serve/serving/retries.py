"""A session call tried again (AsyncEngine._session_call): the wait for room in a full KV cache
that other calls in flight hold, and a spilled session brought back from the spill tier before
a call runs. Part of AsyncEngine (async_engine.py), kept in a file of its own."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import TypeVar

from mha_serve import metrics
from mha_serve.cache import CacheExhausted, SessionSpilled
from mha_serve.engine import AttendRequest
from mha_serve.engine.session_api import RESTORE_TRIES
from mha_serve.serving.finish import Computed
from mha_serve.serving.ticket import Ticket

T = TypeVar("T")

# A session call refused for KV-cache room that other calls in flight hold waits for them at
# most this long (or to its deadline), then answers RESOURCE_EXHAUSTED.
ROOM_WAIT_S = 30.0


class Retrying:
    """AsyncEngine's session calls tried again (mixed into it; its state is AsyncEngine's:
    engine, _answered, _room_waiters, _room_turn, _compute, _on_compute)."""

    async def _session_call(
        self, request: AttendRequest, ticket: Ticket, caller: str | None
    ) -> Computed:
        """A session step, tried again while room for it in a full KV cache may come."""
        seen, started = self._answered, time.monotonic()
        try:  # most steps: answered (or refused) at the first try
            return await self._compute(request, ticket, caller)
        except CacheExhausted as e:
            refused = e
        return await self._room_retries(request, ticket, caller, refused, seen, started)

    async def _room_retries(
        self,
        request: AttendRequest,
        ticket: Ticket,
        caller: str | None,
        refused: CacheExhausted,
        seen: int,
        started: float,
    ) -> Computed:
        """A session step refused for room at its first try (`refused`; `seen`: calls
        answered before it, `started`: time.monotonic() then), tried again while room may
        come."""
        give_up = started + ROOM_WAIT_S
        if ticket.deadline is not None:
            give_up = min(give_up, ticket.deadline)
        while True:
            # Others answered since: not this try's own release (refused bringing its
            # session back, it never held the claim).
            others = self._answered - seen - ticket.claimed
            if not await self._room_may_come(refused, others, give_up):
                raise refused
            seen = self._answered
            ticket.claimed = False  # (until this try holds the session's claim)
            try:
                # Tries again one at a time: calls refused together (one batch whose
                # sessions held the room each needed) would otherwise batch together again.
                async with self._room_turn:
                    return await self._compute(request, ticket, caller)
            except CacheExhausted as e:
                refused = e

    def _session_answered(self) -> None:
        """A session call let go of its session: calls waiting for room try again."""
        self._answered += 1
        if not self._room_waiters:  # (most steps: none waits, no list made)
            return
        waiters, self._room_waiters = self._room_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def _room_may_come(self, refused: CacheExhausted, others: int, give_up: float) -> bool:
        """A session call refused for room (bringing its session back, or its step) while
        other calls in flight held sessions that could not be spilled or evicted: True once
        another session call has let go since (`others` already had, or one does now: try
        again), False when none held any or
        none lets go before give_up (the refusal stands). A full cache thus queues such
        calls instead of refusing them; the call waits without its claim, so that its own
        session may be spilled to make room for the others meanwhile."""
        if not refused.in_flight:
            return False
        if others > 0:
            return True
        left = give_up - time.monotonic()
        if left <= 0:
            return False
        waiter = asyncio.get_running_loop().create_future()
        self._room_waiters.append(waiter)
        try:
            await asyncio.wait_for(waiter, left)
        except TimeoutError:
            return False
        finally:
            with contextlib.suppress(ValueError):
                self._room_waiters.remove(waiter)
        return True

    async def _live(
        self, session_id: str, caller: str | None, call: Callable[[], T]
    ) -> tuple[T, float]:
        """(call(), seconds spent bringing the session back from the spill tier): a spilled
        session's file is read and adopted off the event loop, then call() runs here. Sent
        back to disk in between (a step of another session made room), call() raises
        SessionSpilled (the engine's session calls with restore=False) and it is brought
        back again the same way, waiting for room alike."""
        restore_s = 0.0
        if self.engine.is_spilled(session_id):
            restore_s = await self._restore_when_room(session_id, caller)
        for attempt in range(RESTORE_TRIES + 1):
            try:
                value = call()
            except SessionSpilled:  # (spilled again meanwhile, to make room: once more)
                if attempt == RESTORE_TRIES:
                    raise
            else:
                if restore_s:
                    metrics.observe_restore(self.engine.session_model(session_id), restore_s)
                return value, restore_s
            restore_s += await self._restore_when_room(session_id, caller)
        raise AssertionError("unreachable")

    async def _restore_when_room(self, session_id: str, caller: str | None) -> float:
        """_restore, waiting as a step does (_room_may_come, up to ROOM_WAIT_S) while the
        room it needs is held by calls in flight: a GetSession, fork or truncate of a spilled
        session was refused RESOURCE_EXHAUSTED at once where a step of it waited."""
        seen, give_up = self._answered, time.monotonic() + ROOM_WAIT_S
        while True:
            try:
                return await self._restore(session_id, caller)
            except CacheExhausted as refused:
                if not await self._room_may_come(refused, self._answered - seen, give_up):
                    raise
            seen = self._answered

    async def _restore(self, session_id: str, caller: str | None) -> float:
        """On the compute thread: torch ops on another thread would start a team of their
        own (engine/threads.py); a restore is rare and short."""
        return await self._on_compute(self.engine.restore_session, session_id, caller)
