"""How AttentionReplica hands its sessions over and takes others': when Ray stops it, every
session moves to a replica that stays (moves.py) within the shutdown budget left; a session
a stopping replica moves here is adopted and recorded in SequenceDirectory; a call for a
session of another replica that was not moved here answers NOT_FOUND saying why (lost.py).
Part of AttentionReplica (replica.py), kept in a file of its own; its state is the
replica's."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections.abc import Awaitable
from typing import Any

import grpc

from mha_serve import metrics
from mha_serve.cache import CacheError, SessionExists
from mha_serve.cache.record import BadRecord, read_header
from mha_serve.ray_app import leaving
from mha_serve.ray_app.context import Reply
from mha_serve.ray_app.forward import calls, own_request_id
from mha_serve.ray_app.ids import replica_of
from mha_serve.ray_app.lost import RECORD_TIMEOUT_S, Loss, gone_details
from mha_serve.ray_app.moves import MARGIN_S, NOWHERE_GRACE_S, Sent, move_all

log = logging.getLogger(__name__)

MAX_FOREIGN_REMEMBERED = 4096  # ended sessions that moved here, still told apart from gone


class Handover:
    """AttentionReplica's moves: Ray stopping this replica, or another (mixed into it; its
    state is the replica's)."""

    async def receive_session(self, data: bytes, source: str) -> Sent:
        """Adopts a session that a stopping replica (`source`) moves here, and records it in
        SequenceDirectory; refused (saying why) when this replica is stopping too or has no
        room, or the session is not one of a model served here (a redeploy that changed
        the models)."""
        if self.stopping.is_set():
            return Sent(refused=f"replica {self.replica_id!r} is stopping too")
        origin = f"a session moved from Ray Serve replica {source!r}"
        try:
            session_id = read_header(data, origin).session_id
            await self.serving.receive_session(data, origin)
        except SessionExists:  # an earlier try of this very move reached here: it is here
            pass
        except (BadRecord, CacheError) as e:
            return Sent(refused=f"replica {self.replica_id!r}: {e}")
        self._remember_foreign(session_id)
        try:
            await calls(self._directory, "moved").remote(session_id, self.replica_id)
        except Exception as e:  # unrecorded, the session could not be found: give it back
            with contextlib.suppress(Exception):
                await _value(self.serving.close_session(session_id))
            return Sent(refused=f"SequenceDirectory did not record it ({e!r})")
        metrics.count_moved()
        return Sent(replica=self.replica_id)

    async def foreign_sessions(self) -> tuple[str, list[str]]:
        """(this replica, the sessions it holds that another replica made): what a
        restarted SequenceDirectory rebuilds its map of moved sessions from."""
        held = await self.serving.session_ids()
        return self.replica_id, [s for s in held if replica_of(s) != self.replica_id]

    async def __del__(self) -> None:
        """Ray's last call on a replica it stops gracefully (its calls drained): every
        session moves to a replica that stays, within the shutdown budget left."""
        if not hasattr(self, "_receivers"):  # stopped before it was ready: nothing to move
            return
        self.stopping.set()
        since = self.stopping.since or time.monotonic()
        budget_s = self._shutdown_s - (time.monotonic() - since) - MARGIN_S

        async def send(data: bytes) -> Sent:
            own_request_id()  # each move's call routed on its own (forward.own_request_id)
            return await self._receivers.remote(data, self.replica_id)

        def nowhere() -> bool:  # no replica stays (the app deleted), none can start in time
            return leaving.none_stays(self.replica_id, NOWHERE_GRACE_S)

        moved, failed = await move_all(self.serving, send, budget_s, nowhere)
        # (An error when some stay: they are lost with this replica.)
        (log.error if failed else log.info)(
            "replica %s stopping: %d sessions moved, %d not (%s)%s",
            self.replica_id,
            moved,
            len(failed),
            ", ".join(list(failed)[:8]),
            f": no other replica ran for {NOWHERE_GRACE_S:g} s" if nowhere() else "",
        )
        if failed:
            await self._report_failed(failed)

    async def _report_failed(self, failed: dict[str, str]) -> None:
        """Tells SequenceDirectory which sessions could not move, and why (one call), so
        that the replica answering NOT_FOUND for them counts them move_failed (lost.py)."""
        try:
            own_request_id()
            report = calls(self._directory, "moves_failed").remote(self.replica_id, failed)
            await asyncio.wait_for(_value(report), RECORD_TIMEOUT_S)
        except Exception as e:  # they will count as replica_killed
            log.error(
                "replica %s: SequenceDirectory did not record the %d sessions not moved (%r)",
                self.replica_id,
                len(failed),
                e,
            )

    async def _why_lost(self, session_id: str) -> Loss:
        """What SequenceDirectory recorded when the session's stopping replica could not
        move it (why None: nothing, so it died), and which replica held it last."""
        own_request_id()  # (its own call: the request that asked may have others in flight)
        return await calls(self._directory, "why_lost").remote(session_id)

    def _remember_foreign(self, session_id: str) -> None:
        self._foreign.pop(session_id, None)
        self._foreign[session_id] = None  # the newest last
        if len(self._foreign) > 2 * MAX_FOREIGN_REMEMBERED:
            held = set(self.serving.engine.session_ids())
            ended = [s for s in self._foreign if s not in held]
            for s in ended[: len(self._foreign) - MAX_FOREIGN_REMEMBERED]:
                del self._foreign[s]

    def _held_here(self, session_id: str) -> bool:
        """Whether the session is this replica's to answer: made here, moved here, or no
        session of any replica (the door answers it)."""
        owner = replica_of(session_id)
        return owner is None or owner == self.replica_id or session_id in self._foreign

    def _gone(self, method: str, session_id: str, what: str = "") -> Awaitable[Reply] | None:
        """NOT_FOUND (an awaitable) for a session that lived on another replica and was not
        moved here: the router sends a call here only when that replica is gone (dead, or
        stopped without moving it), and its cache with it. Counted lost once per session
        here, move_failed or replica_killed (lost.py). None (no await: every call asks) for
        a session of this replica's to answer. what: the session's name for the client (a
        Triton sequence), when not its id."""
        if not session_id or self._held_here(session_id):
            return None
        return self._answer_gone(method, session_id, what)

    async def _answer_gone(self, method: str, session_id: str, what: str) -> Reply:
        why, holder = await self._lost.why(session_id)
        protocol = metrics.PROTOCOL_KSERVE_V2 if what else metrics.PROTOCOL_MHA_V1
        metrics.count_request(method, "unknown", grpc.StatusCode.NOT_FOUND.name, protocol)
        details = gone_details(session_id, holder or replica_of(session_id), why, what)
        return Reply(code=grpc.StatusCode.NOT_FOUND, details=details)


async def _value(result: Any) -> Any:
    """AsyncEngine's session and cache methods, whether they are coroutines or not."""
    return await result if inspect.isawaitable(result) else result
