"""Sessions lost with their Ray replica, told apart by why (mha_serve_sessions_lost_total):
`move_failed`, the replica stopped (a scale-down or redeploy) and could not move them to
another (moves.py), or `replica_killed`, it died (killed, crashed, out of memory, its node
lost) and moved nothing.

A stopping replica reports every session it could not move, once, to SequenceDirectory,
which keeps the newest (`FailedMoves`): the stopping replica exits before Prometheus would
scrape a count of its own, and the NOT_FOUND its sessions get later comes from another
replica. That replica (`LostSessions`) asks the directory about each such session the
first time it answers one (never on a session's normal calls), counts it lost under the
reason found, once, and says why in its NOT_FOUND, naming the replica that held the
session last (a session moved before it was lost lived on the replica it moved to, not the
one its id names).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import NamedTuple

from mha_serve import metrics

log = logging.getLogger(__name__)

MAX_FAILED_KEPT = 16384  # sessions whose move failed, newest kept (SequenceDirectory)
MAX_COUNTED = 4096  # gone sessions counted lost on this replica, newest kept
ASK_TIMEOUT_S = 5.0  # the directory's answer, past which a session counts replica_killed
RECORD_TIMEOUT_S = 5.0  # a stopping replica's report, past which it stops without it


class Loss(NamedTuple):
    """How a session of another replica was lost, as SequenceDirectory knows it."""

    why: str | None = None  # why its stopping replica could not move it; None: it died
    holder: str | None = None  # the replica that held it last; None: the one its id names


class FailedMoves:
    """Session id -> why its stopping replica could not move it, and that replica, the
    newest MAX_FAILED_KEPT (an older one asked about counts replica_killed). Lives as long
    as the directory."""

    def __init__(self, limit: int = MAX_FAILED_KEPT) -> None:
        self._why: dict[str, Loss] = {}  # oldest first
        self._limit = limit

    def record(self, failed: dict[str, str], replica: str | None = None) -> None:
        losses: dict[str, Loss] = {}  # one record of each reason (most share a few)
        for session_id, why in failed.items():
            self._why.pop(session_id, None)
            self._why[session_id] = losses.setdefault(why, Loss(why, replica))
        while len(self._why) > self._limit:
            self._why.pop(next(iter(self._why)))

    def loss(self, session_id: str) -> Loss:
        return self._why.get(session_id) or Loss()

    def __len__(self) -> int:
        return len(self._why)


class LostSessions:
    """A replica's record of the sessions of other replicas it answered NOT_FOUND: how each
    was lost, asked once (why_lost: SequenceDirectory's answer, Loss() when it knows
    nothing of it), and each counted lost once."""

    def __init__(
        self, why_lost: Callable[[str], Awaitable[Loss]] | None, limit: int = MAX_COUNTED
    ) -> None:
        self._why_lost = why_lost
        self._asked: dict[str, asyncio.Future[Loss]] = {}  # oldest first
        self._limit = limit

    async def why(self, session_id: str) -> Loss:
        """Why its replica could not move the session (why None: it died) and which held
        it last; the first call for a session asks and counts it, the others (at once or
        later) wait for that answer."""
        asked = self._asked.get(session_id)
        if asked is None:
            asked = asyncio.ensure_future(self._ask_and_count(session_id))
            self._asked[session_id] = asked
            if len(self._asked) > self._limit:
                self._asked.pop(next(iter(self._asked)))
        return await asyncio.shield(asked)

    async def _ask_and_count(self, session_id: str) -> Loss:
        loss = Loss()
        if self._why_lost is not None:
            try:
                loss = await asyncio.wait_for(self._why_lost(session_id), ASK_TIMEOUT_S)
            except Exception as e:  # counted as a replica that died: the likelier case
                log.warning("why session %s was lost: no answer (%r)", session_id, e)
        metrics.count_lost("replica_killed" if loss.why is None else "move_failed")
        return loss


def gone_details(session_id: str, owner: str | None, why: str | None, what: str = "") -> str:
    """The NOT_FOUND details for a session lost with its replica `owner` (the one that
    held it last); why: what that
    replica said when it could not move the session (None: it died, or nothing was said).
    what: the session's name for the client (a Triton sequence), when not its id."""
    named = f"{what} (session {session_id!r})" if what else f"session {session_id!r}"
    again = "start it again with sequence_start" if what else "create a new session"
    if why is None:
        how = (
            "which is no longer running or is stopping (it died, or was scaled down or "
            "replaced), and its KV cache went with it"
        )
    else:
        how = (
            "which stopped (scaled down or replaced) and could not move it to another "
            f"replica ({why}), so its KV cache went with it"
        )
    return (
        f"{named} is gone: it lived on Ray Serve replica {owner!r}, {how}; {again} and send "
        "its tokens again"
    )
