"""Session ids that name their replica: "<replica unique_id>-<32 hex digits>".

The replica's engine starts every session id with `session_prefix(its id)` (forks too), so
a router anywhere reads a session's replica from its id alone: no table to share.
"""

from __future__ import annotations

HEX_DIGITS = 32  # uuid4().hex, what the session table appends to the prefix
SEPARATOR = "-"


def session_prefix(replica_unique_id: str) -> str:
    """The start of every session id made on that replica."""
    if not replica_unique_id or SEPARATOR in replica_unique_id:
        raise ValueError(f"replica id {replica_unique_id!r} is empty or holds {SEPARATOR!r}")
    return replica_unique_id + SEPARATOR


def replica_of(session_id: str) -> str | None:
    """The unique id of the replica a session id names, or None when it names none."""
    cut = len(session_id) - HEX_DIGITS - 1
    if cut < 1 or session_id[cut] != SEPARATOR:
        return None
    return session_id[:cut]


def pinned_to(replica_unique_id: str) -> str:
    """A session id naming that replica and no session: a call carrying it reaches the
    replica through SessionRouter (or, once it is gone, any replica)."""
    return session_prefix(replica_unique_id) + "0" * HEX_DIGITS


def is_pinned(session_id: str) -> bool:
    """Whether the id is a `pinned_to` one: it names a replica, not a session."""
    return replica_of(session_id) is not None and session_id.endswith("0" * HEX_DIGITS)
