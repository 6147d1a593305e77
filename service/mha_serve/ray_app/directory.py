"""SequenceDirectory: the session each Triton sequence steps, for every proxy and replica.

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
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from typing import Any

from mha_serve.ray_app.forward import calls
from mha_serve.ray_app.ids import pinned_to, replica_of
from mha_serve.transport.oip.sequences import SequenceKey, SequenceMap

log = logging.getLogger(__name__)


class SequenceDirectory:
    """Sequence -> session id, in one replica (no lock: an actor's calls interleave only at
    awaits, and the map changes only between them)."""

    def __init__(self, replicas: str = "AttentionReplica") -> None:
        # The replicas' deployment, by name: they hold this directory's handle, so the
        # application graph cannot hand it theirs (no cycles); looked up on first prune.
        self._replicas = replicas
        self._live: Any = None
        self._sequences = SequenceMap()

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

    async def _live_of(self, session_ids: set[str]) -> set[str]:
        """Which of session_ids still live: each replica asked about its own (a gone
        replica's are asked of another, which holds none of them)."""
        by_replica: dict[str, list[str]] = defaultdict(list)
        for session_id in session_ids:
            by_replica[replica_of(session_id) or ""].append(session_id)
        if self._live is None:
            from ray import serve

            app = serve.get_replica_context().app_name
            self._live = calls(serve.get_deployment_handle(self._replicas, app), "live_sessions")
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
