"""The request router of AttentionReplica: a session's calls go to the replica its id names.

Ray Serve runs one router per handle owner: each gRPC proxy (the proxy calls AttentionReplica
directly; proxy.py puts the call's session into the `session_id` metadata that reaches the
router), and each replica that forwards a Triton sequence's step. A call that carries a
session id goes to exactly the replica named in it, never elsewhere while that replica
lives: if this router does not know the replica yet (just started, not yet announced here),
the call waits for the next replica update. When the replica is gone (its actor is dead), or
has left this router's view after being in it (Ray is stopping it: scaled down, or
replaced), the call goes to any live replica, which answers NOT_FOUND saying so
(AttentionReplica): Ray never routes to a stopping replica, so waiting for it would only
delay that answer by its drain. Calls without a session spread by load: the lower queue of
two random replicas, as Ray's default router does, queues within one of each other a tie.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from typing import Any

import ray
from ray.serve._private.common import DeploymentID
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from mha_serve.ray_app.ids import replica_of

log = logging.getLogger(__name__)

SERVE_NAMESPACE = "serve"  # the namespace of Ray Serve's actors
MAX_REMEMBERED = 4096  # replica ids kept (dead ones: to skip the actor lookup)
QUEUE_LEN_SLACK = 1  # queue lengths this close are a tie (SessionRouter._by_load)


class SessionRouter(RequestRouter):
    """Pins each session to the replica its id names; spreads the rest by load."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._gone: dict[str, None] = {}  # replica ids known dead, oldest first
        self._seen: dict[str, None] = {}  # replica ids once in this router's view

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Ray's news of the running replicas; remembered, so that one leaving the view is
        known to be stopping rather than not yet announced."""
        for replica in replicas:
            self._seen[replica.replica_id.unique_id] = None
        _trim(self._seen)
        super().update_replicas(replicas)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        session_id = _session_id(pending_request)
        if not session_id:
            return self._by_load(candidate_replicas)
        # Wait between tries rather than spin while the owner is busy or not yet known.
        pending_request.routing_context.should_backoff = True
        owner = replica_of(session_id)
        for replica in candidate_replicas:
            if replica.replica_id.unique_id == owner:
                return [[replica]]
        if owner in self._seen:  # it left the view: stopping or stopped, never coming back
            self._forget(owner)
        elif owner is not None and await self._alive(owner):
            return []  # alive but not in this router's view yet: wait for the update
        # Gone (or no replica at all in the id): any replica answers NOT_FOUND.
        return [candidate_replicas]

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
            log.info("replica %s is gone or stopping; its sessions answer NOT_FOUND", unique_id)


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
