"""Which replicas Ray is stopping, as the routers in this process see them (one leaves a
router's view when Ray stops it): a replica watches its own id, to end its open streams
(moves.py). Kept out of router.py on purpose: Ray pickles a deployment's request router
class by value (`RequestRouterConfig`: `cloudpickle.register_pickle_by_value` of its
module), so router.py's module state in a router is a copy, not this process's; modules it
imports are pickled by reference, and this one is shared."""

from __future__ import annotations

from collections.abc import Callable

_watchers: dict[str, list[Callable[[], None]]] = {}


def when_leaving(unique_id: str, callback: Callable[[], None]) -> None:
    """callback() once, the first time a router in this process sees that replica leave its
    view (called on the router's event loop: make it thread-safe)."""
    _watchers.setdefault(unique_id, []).append(callback)


def left(unique_id: str) -> None:
    """A router saw that replica leave its view."""
    for callback in _watchers.pop(unique_id, ()):
        callback()
