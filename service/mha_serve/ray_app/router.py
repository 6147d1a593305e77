"""The request router of AttentionReplica: a session's calls go to the replica that holds it.

Ray Serve runs one router per handle owner: each gRPC proxy (the proxy calls AttentionReplica
directly; proxy.py puts the call's session into the `session_id` metadata that reaches the
router), and each replica that forwards a Triton sequence's step or moves its sessions. A
session lives on the replica its id names until Ray stops that replica, which then moves it
to another (moves.py) and SequenceDirectory records its new home. So a call that carries a
session id goes to the replica named in it while that one is in this router's view; when it
is not (Ray is stopping it, or it is gone, or not yet announced here), to the session's home
in the directory (cached here) once that is in the view; while the replica last known to
hold it still lives (draining, or moving its sessions), the call waits; once it is dead and
no home is known, to one live replica (the same one for the same id, from any proxy), which
answers NOT_FOUND saying so (AttentionReplica). Calls without a session spread by load: the
lower queue of two random replicas, as Ray's default router does, queues within one of
each other a tie.
"""

from __future__ import annotations

import asyncio
import logging
import random
import zlib
from collections.abc import Awaitable, Callable
from typing import Any

import ray
from ray.serve._private.common import DeploymentID
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from mha_serve.ray_app import leaving
from mha_serve.ray_app.ids import is_pinned, replica_of

log = logging.getLogger(__name__)

SERVE_NAMESPACE = "serve"  # the namespace of Ray Serve's actors
DIRECTORY = "SequenceDirectory"  # the deployment that records where moved sessions live
MAX_REMEMBERED = 4096  # replica ids kept (dead ones: to skip the actor lookup), homes cached
QUEUE_LEN_SLACK = 1  # queue lengths this close are a tie (SessionRouter._by_load)
LOOKUP_TIMEOUT_S = 30.0  # a directory lookup; past it the call is routed as if none answered

UNASKED = object()  # SessionRouter._look_up: the directory did not answer


class SessionRouter(RequestRouter):
    """Sends each session's calls to the replica holding it; spreads the rest by load."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._gone: dict[str, None] = {}  # replica ids known dead, oldest first
        self._view: set[str] = set()  # the replicas Ray last said run
        self._seen: dict[str, None] = {}  # replica ids once in the view, oldest first
        self._homes: dict[str, str] = {}  # moved session -> the replica holding it now
        self._home_of: Callable[[str], str | None] | None = None  # directory_lookup

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Ray's news of the running replicas; one that left (Ray is stopping it) is told to
        its watchers in this process (leaving.py)."""
        view = {replica.replica_id.unique_id for replica in replicas}
        self._seen.update(dict.fromkeys(view))
        _trim(self._seen)
        for unique_id in self._view - view:
            leaving.left(unique_id)
        leaving.running(view)
        self._view = view
        super().update_replicas(replicas)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        session_id = _session_id(pending_request)
        if not session_id:
            return self._by_load(candidate_replicas)
        # Wait between tries rather than spin while the holder is busy, moving or unknown.
        pending_request.routing_context.should_backoff = True
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        owner = replica_of(session_id)
        home = self._homes.get(session_id, owner)
        if home in by_id:
            return [[by_id[home]]]
        if owner is not None and not is_pinned(session_id):
            found = await self._look_up(session_id)
            if found is UNASKED:  # the directory restarting: it may know a home, so wait
                return []
            if found is not None:
                home = found
                if found != owner:
                    self._homes[session_id] = found
                    _trim(self._homes)
                if found in by_id:
                    return [[by_id[found]]]
        # A call for a replica rather than a session (pinned_to) waits only for one not yet
        # announced: a stopping replica takes no calls, and it holds no session of its own.
        left = is_pinned(session_id) and home in self._seen
        if home is not None and not left and await self._alive(home):
            return []  # draining, moving its sessions, or not announced yet: wait
        self._homes.pop(session_id, None)
        # Gone: one replica answers NOT_FOUND, the same for the same id (counted once).
        if not candidate_replicas:
            return []
        ranked = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        return [[ranked[zlib.crc32(session_id.encode()) % len(ranked)]]]

    async def _look_up(self, session_id: str) -> str | None | object:
        """The replica SequenceDirectory says holds a moved session (None: not moved;
        UNASKED: the directory did not answer). Off this loop: Ray's router loop cannot make
        or wait on a handle itself (making one waits on this very loop)."""
        try:
            if self._home_of is None:
                app = self._deployment_id.app_name
                self._home_of = await asyncio.to_thread(directory_lookup, app)
            return await asyncio.to_thread(self._home_of, session_id)
        except Exception as e:  # the directory restarting (it rebuilds its map)
            log.warning("SessionRouter: no answer from %s (%r)", DIRECTORY, e)
            return UNASKED

    def _by_load(self, candidates: list[RunningReplica]) -> list[list[RunningReplica]]:
        """Two random replicas, Ray taking the one with the shorter queue (its cache of the
        replicas' queue lengths); queues within QUEUE_LEN_SLACK of each other are a tie,
        the first of the two taken. Ray's cache can count a request that has ended (a
        replica reports its count as a request's completion crosses the report, and that
        one is never taken off): left to compare strictly, an idle replica can lose every
        call to another for the cache's lifetime (10 s)."""
        pair = random.sample(candidates, min(2, len(candidates)))
        if len(pair) == 2:
            lengths = [self._queue_len(r) for r in pair]
            if None not in lengths and abs(lengths[0] - lengths[1]) <= QUEUE_LEN_SLACK:
                return [[pair[0]], [pair[1]]]
        return [pair]

    def _queue_len(self, replica: RunningReplica) -> int | None:
        try:
            return self.replica_queue_len_cache.get(replica.replica_id)
        except AttributeError:  # no cache (a router not set up by Ray)
            return None

    async def _alive(self, unique_id: str) -> bool:
        """Whether the replica's actor still lives (a GCS lookup, off the event loop)."""
        if unique_id in self._gone:
            return False
        if await asyncio.to_thread(replica_alive, unique_id, self._deployment_id):
            return True
        self._forget(unique_id)
        return False

    def _forget(self, unique_id: str) -> None:
        if unique_id not in self._gone:
            self._gone[unique_id] = None
            _trim(self._gone)
            log.info("replica %s is gone; sessions last held there answer NOT_FOUND", unique_id)


def directory_lookup(app: str) -> Callable[[str], str | None]:
    """home_of(session id), a blocking call to that application's SequenceDirectory (made
    and called on a thread of its own, never on a router's loop)."""
    from ray import serve

    handle = serve.get_deployment_handle(DIRECTORY, app).options(method_name="home_of")

    def home_of(session_id: str) -> str | None:
        return handle.remote(session_id).result(timeout_s=LOOKUP_TIMEOUT_S)

    return home_of


def _trim(ids: dict[str, None]) -> None:
    while len(ids) > MAX_REMEMBERED:
        ids.pop(next(iter(ids)))


def liveness(handle: Any) -> Callable[[str], Awaitable[bool]]:
    """alive(replica unique id) for the replicas of the deployment `handle` calls."""
    deployment_id = DeploymentID(name=handle.deployment_name, app_name=handle.app_name)

    async def alive(unique_id: str) -> bool:
        return await asyncio.to_thread(replica_alive, unique_id, deployment_id)

    return alive


def replica_alive(unique_id: str, deployment_id: DeploymentID) -> bool:
    """Whether that replica's actor still lives: a GCS lookup (blocking; run it off the
    event loop). Ray names a replica's actor after its ids; a dead one's name is freed."""
    name = ReplicaID(unique_id, deployment_id).to_full_id_str()
    try:
        ray.get_actor(name, namespace=SERVE_NAMESPACE)
    except ValueError:  # no live actor of that name
        return False
    return True


def _session_id(pending_request: PendingRequest | None) -> str:
    if pending_request is None:
        return ""
    session_id = pending_request.metadata.session_id
    return session_id if isinstance(session_id, str) else ""
