"""SequenceDirectory: the session each Triton sequence steps, and the replica each moved
session lives on, for every proxy and replica.

A Triton client names a sequence by an id of its own (sequence_id, with sequence_start and
sequence_end) and sends each step as a call of its own. Through Ray, the calls of one
sequence may reach different proxies, and its session lives on one AttentionReplica,
so the map (the client's identity, model, sequence id) -> session id (which names its
replica, ids.py) lives in one place they all ask: this deployment, one replica, part of the
application (it starts, stops and restarts with it). docs/ray.md ("Triton sequences") says
why here and not elsewhere.

Entries go on the sequence's end, when a step finds its session gone (the replica reports
both), and, past SequenceMap's prune size, when their replica says their session no longer
lives (expired, evicted, closed through mha.v1, or its replica gone).

Moved sessions (a replica Ray stops moves its sessions to others: moves.py): the replica
that took one records it here (`moved`), and SessionRouter asks `home_of` for a session whose
replica has left its view. A directory rebuilds that map from the replicas themselves when it
starts (each lists the sessions it holds that another replica made: `foreign_sessions`),
before its first answer, so one that restarts loses nothing; past HOMES_PRUNE_AT entries it keeps those
whose replica still holds them.

Sessions a stopping replica could not move (`moves_failed`: no room, nowhere to go, out of
time) are kept with why (lost.FailedMoves, the newest MAX_FAILED_KEPT), for the replica that
answers NOT_FOUND for one to count it move_failed, not replica_killed (`why_lost`). Kept as
long as this directory runs: one that restarts has none (those count replica_killed).
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from typing import Any

from mha_serve.ray_app.forward import calls
from mha_serve.ray_app.ids import pinned_to, replica_of
from mha_serve.ray_app.lost import FailedMoves, Loss
from mha_serve.transport.oip.sequences import SequenceKey, SequenceMap

log = logging.getLogger(__name__)

HOMES_PRUNE_AT = 4096  # moved sessions recorded before the ended ones are looked for
REBUILD_ASK_S = 5.0  # a replica that does not list its sessions by then is skipped
SERVE_NAMESPACE = "serve"


class SequenceDirectory:
    """Sequence -> session id, in one replica (no lock: an actor's calls interleave only at
    awaits, and the map changes only between them)."""

    async def __init__(self, replicas: str = "AttentionReplica") -> None:
        # The replicas' deployment, by name: they hold this directory's handle, so the
        # application graph cannot hand it theirs (no cycles).
        self._replicas = replicas
        self._live: Any = None
        self._sequences = SequenceMap()
        self._homes: dict[str, str] = {}  # moved session id -> the replica holding it
        self._homes_prune_at = HOMES_PRUNE_AT
        self._failed = FailedMoves()
        self._replicas_handle: Any = None
        # Started now (a restarted directory answers home_of once the replicas have said
        # what they hold), and with it the replicas' router, which learns which run.
        self._rebuilt = asyncio.ensure_future(self._rebuild())

    def get(self, key: SequenceKey) -> str | None:
        return self._sequences.get(key)

    async def start(self, key: SequenceKey, session_id: str | None) -> str | None:
        """Maps key to its new session (None: the sequence ended with its first step);
        returns the session it named before, for the caller to close."""
        if session_id is None:
            previous = self._sequences.get(key)
            if previous is not None:
                self._sequences.end(key, previous)
            return previous
        checked: set[str] = set()
        live: set[str] = set()
        if self._sequences.prune_due:
            checked = self._sequences.session_ids()
            live = await self._live_of(checked)
        # Only what was asked about and found dead goes: entries made meanwhile stay.
        return self._sequences.start(key, session_id, live=lambda s: s in live or s not in checked)

    def end(self, key: SequenceKey, session_id: str) -> None:
        """Forgets key if it still names session_id (a new start may have replaced it)."""
        self._sequences.end(key, session_id)

    def size(self) -> int:
        return len(self._sequences)

    # --- moved sessions ------------------------------------------------------------------

    async def moved(self, session_id: str, replica: str) -> None:
        """session_id now lives on that replica (which received it)."""
        self._homes[session_id] = replica
        if len(self._homes) > self._homes_prune_at:
            asked = dict(self._homes)
            live = await self._live_of(set(asked), home=asked)
            for sid, home in asked.items():  # what moved meanwhile stays
                if sid not in live and self._homes.get(sid) == home:
                    del self._homes[sid]
            self._homes_prune_at = max(HOMES_PRUNE_AT, 2 * len(self._homes))

    async def home_of(self, session_id: str) -> str | None:
        """The replica holding a moved session; None for one that never moved (or ended)."""
        await asyncio.shield(self._rebuilt)
        return self._homes.get(session_id)

    def moves_failed(self, replica: str, failed: dict[str, str]) -> None:
        """The sessions that stopping replica could not move, each with why (one call)."""
        self._failed.record(failed, replica)
        log.warning("SequenceDirectory: %d sessions of %s not moved", len(failed), replica)

    def why_lost(self, session_id: str) -> Loss:
        """Why its stopping replica could not move the session (None when it did not say:
        it died, or this directory restarted since), and the replica that held it last
        (the one that reported it, else where it moved; None: where it was made)."""
        loss = self._failed.loss(session_id)
        return loss if loss.holder else Loss(loss.why, self._homes.get(session_id))

    async def _rebuild(self) -> None:
        """The map as the replicas hold it: each one's foreign sessions (a directory that
        restarted lost what it had). Entries recorded meanwhile are newer and stay."""
        try:
            await self._ask_replicas()
        except Exception:  # answer from what is recorded from now on
            log.exception("SequenceDirectory: the map of moved sessions was not rebuilt")

    async def _ask_replicas(self) -> None:
        import ray

        prefix = f"SERVE_REPLICA::{self._app()}#{self._replicas}#"
        names = await asyncio.to_thread(ray.util.list_named_actors, all_namespaces=True)
        replicas = [
            n["name"].removeprefix(prefix)
            for n in names
            if n.get("namespace") == SERVE_NAMESPACE and n["name"].startswith(prefix)
        ]
        foreign = calls(self._handle(), "foreign_sessions")
        asks = [
            asyncio.wait_for(foreign.options(session_id=pinned_to(r)).remote(), REBUILD_ASK_S)
            for r in replicas
        ]
        found = 0
        for replica, answer in zip(
            replicas, await asyncio.gather(*asks, return_exceptions=True), strict=True
        ):
            if isinstance(answer, BaseException):  # stopping (it moves them) or starting
                log.warning("SequenceDirectory: %s did not list its sessions: %r", replica, answer)
                continue
            holder, session_ids = answer
            for session_id in session_ids:
                self._homes.setdefault(session_id, holder)
                found += 1
        log.info("SequenceDirectory: %d moved sessions found on %d replicas", found, len(replicas))

    def homes(self) -> dict[str, str]:
        return dict(self._homes)

    # --- liveness -------------------------------------------------------------------------

    def _app(self) -> str:
        from ray import serve

        return serve.get_replica_context().app_name

    def _handle(self) -> Any:
        """The replicas' handle; its router (made on first use) learns which run."""
        if self._replicas_handle is None:
            from ray import serve

            self._replicas_handle = serve.get_deployment_handle(self._replicas, self._app())
        return self._replicas_handle

    async def _live_of(self, session_ids: set[str], home: dict[str, str] | None = None) -> set[str]:
        """Which of session_ids still live: each replica asked about its own (home: where
        each lives, when not the replica its id names; a gone replica's are asked of
        another, which holds none of them)."""
        by_replica: dict[str, list[str]] = defaultdict(list)
        for session_id in session_ids:
            where = (home or {}).get(session_id) or replica_of(session_id) or ""
            by_replica[where].append(session_id)
        if self._live is None:
            self._live = calls(self._handle(), "live_sessions")
        asks = [
            self._live.options(session_id=pinned_to(replica)).remote(ids)
            for replica, ids in by_replica.items()
            if replica
        ]
        live: set[str] = set()
        for answer in await asyncio.gather(*asks, return_exceptions=True):
            if isinstance(answer, BaseException):  # keep what could not be checked
                log.warning("SequenceDirectory: a liveness check failed: %r", answer)
                return set(session_ids)
            live.update(answer)
        return live
