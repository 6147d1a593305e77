"""Triton's sequences as mha-serve sessions: a client's sequence id -> the session id the
server made for it (per model, as Triton's sequence batcher keeps one set of ids per model)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mha_serve.engine import InvalidRequest
from mha_serve.serving.sequences import PRUNE_AT, SequenceKey, SequenceMap

__all__ = [
    "PRUNE_AT",
    "Sequence",
    "SequenceKey",
    "SequenceMap",
    "sequence_of",
]


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
