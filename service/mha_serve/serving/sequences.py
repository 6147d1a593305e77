"""Triton's sequences as sessions of the engine: a client's sequence key -> the session the
engine made for it. Kept beside the engine (AsyncEngine.sequences), not in a front door, so
that every frontend worker of a server finds every sequence (serving/remote.py)."""

from __future__ import annotations

from collections.abc import Callable

# Past this many ids the map drops those whose session is gone (expired, evicted, closed by
# mha.v1): clients that never send sequence_end cannot grow it without bound.
PRUNE_AT = 1024

SequenceKey = tuple[str, str, int | str]  # (model, the client's identity, its sequence id)


class SequenceMap:
    """Sequence id -> session id, on the event loop (no lock: every call is synchronous)."""

    def __init__(self, prune_at: int = PRUNE_AT) -> None:
        self._sessions: dict[SequenceKey, str] = {}
        self._min_prune_at = self._prune_at = prune_at

    def __len__(self) -> int:
        return len(self._sessions)

    def get(self, key: SequenceKey) -> str | None:
        return self._sessions.get(key)

    @property
    def prune_due(self) -> bool:
        """Whether the next start prunes (its `live` is asked about every session held)."""
        return len(self._sessions) >= self._prune_at

    def session_ids(self) -> set[str]:
        return set(self._sessions.values())

    def start(self, key: SequenceKey, session_id: str, live: Callable[[str], bool]) -> str | None:
        """Maps key to a new session; returns the session it held before (to close), if any."""
        previous = self._sessions.pop(key, None)
        if len(self._sessions) >= self._prune_at:
            self._sessions = {k: s for k, s in self._sessions.items() if live(s)}
            self._prune_at = max(self._min_prune_at, 2 * len(self._sessions))
        self._sessions[key] = session_id
        return previous

    def end(self, key: SequenceKey, session_id: str) -> None:
        """Forgets key if it still names session_id (a new start may have replaced it)."""
        if self._sessions.get(key) == session_id:
            del self._sessions[key]
