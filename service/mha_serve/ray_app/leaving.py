"""Which replicas Ray is stopping, as the routers in this process see them (one leaves a
router's view when Ray stops it): a replica watches its own id, to end its open streams
(moves.py). Kept out of router.py on purpose: Ray pickles a deployment's request router
class by value (`RequestRouterConfig`: `cloudpickle.register_pickle_by_value` of its
module), so router.py's module state in a router is a copy, not this process's; modules it
imports are pickled by reference, and this one is shared."""

from __future__ import annotations

import time
from collections.abc import Callable

_watchers: dict[str, list[Callable[[], None]]] = {}
# The replicas the routers in this process last saw run (None: no news yet), and since when
# (monotonic): where a stopping replica's sessions could go. It holds no other replica when
# Ray stops every one (the application deleted), or when a replacement cannot start before
# the stopping replica is gone (no room for it on the cluster).
_running: frozenset[str] | None = None
_since = 0.0


def when_leaving(unique_id: str, callback: Callable[[], None]) -> None:
    """callback() once, the first time a router in this process sees that replica leave its
    view (called on the router's event loop: make it thread-safe)."""
    _watchers.setdefault(unique_id, []).append(callback)


def running(unique_ids: set[str]) -> None:
    """A router's news of the replicas that run (those Ray is stopping are not among them)."""
    global _running, _since
    if frozenset(unique_ids) != _running:
        _running, _since = frozenset(unique_ids), time.monotonic()


def none_stays(unique_id: str, grace_s: float) -> bool:
    """Whether the routers here have seen no replica but `unique_id` run for grace_s: no
    replica to move its sessions to, nor one starting in time. False before any news."""
    if _running is None or _running - {unique_id}:
        return False
    return time.monotonic() - _since >= grace_s


def left(unique_id: str) -> None:
    """A router saw that replica leave its view."""
    for callback in _watchers.pop(unique_id, ()):
        callback()
