"""Triton's sequences as mha-serve sessions: a client's sequence id -> the session id the
server made for it (per model, as Triton's sequence batcher keeps one set of ids per model)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mha_serve.engine import InvalidRequest

# Past this many ids the map drops those whose session is gone (expired, evicted, closed by
# mha.v1): clients that never send sequence_end cannot grow it without bound.
PRUNE_AT = 1024

SequenceKey = tuple[str, str, int | str]  # (model, the client's identity, its sequence id)


@dataclass(frozen=True)
class Sequence:
    """The sequence controls of one request (Triton's sequence_id/start/end parameters)."""

    id: int | str
    start: bool
    end: bool

    def describe(self, model: str) -> str:
        shown = repr(self.id) if isinstance(self.id, str) else str(self.id)  # as Triton: 42, 'a'
        return f"sequence {shown} to model '{model}'"

    def not_started(self, model: str) -> InvalidRequest:
        """Triton's refusal of a step whose sequence is not active (every door says it so)."""
        return InvalidRequest(
            f"inference request for {self.describe(model)} must specify the START flag on the "
            "first request of the sequence (no such sequence is active: it never started, "
            "or it ended)"
        )


def sequence_of(params: Any) -> Sequence | None:
    """The request's sequence, None for a stateless request (no id, 0 or "")."""
    raw = params.get("sequence_id")
    kind = None if raw is None else raw.WhichOneof("parameter_choice")
    if kind not in (None, "int64_param", "uint64_param", "string_param"):
        raise InvalidRequest(f"sequence_id must be an integer or a string, got {kind}")
    seq_id = None if kind is None else getattr(raw, kind)
    flags = {}
    for name in ("sequence_start", "sequence_end"):
        value = params.get(name)
        if value is not None and value.WhichOneof("parameter_choice") not in ("bool_param", None):
            raise InvalidRequest(f"{name} must be a bool")
        flags[name] = bool(value is not None and value.bool_param)
    if seq_id in (None, 0, ""):
        if any(flags.values()):
            raise InvalidRequest(
                "sequence_start/sequence_end are set but sequence_id is not: name the sequence"
            )
        return None
    return Sequence(seq_id, flags["sequence_start"], flags["sequence_end"])


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
