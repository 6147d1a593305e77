"""Sessions that outlive their place in the KV cache: the spill tier opened over the models
served here (each model's records must match its fingerprint), and a spilled session
brought back (its file read and checked off the table's lock, then adopted under its id).
The SessionTable does the rest (cache/room.py, cache/spill.py)."""

from __future__ import annotations

import time

from mha_serve.cache import KVCache, SessionNotFound, SessionTable
from mha_serve.cache.record import BadRecord, Expected, key_bound
from mha_serve.cache.sessions import owns, unknown_message
from mha_serve.cache.spill import SpillStore, SpillTier
from mha_serve.engine.fingerprint import model_fingerprint
from mha_serve.engine.types import HostedModel


def open_spill_tier(
    models: dict[str, HostedModel], caches: dict[str, KVCache], directory: str, budget_bytes: int
) -> SpillTier:
    """The spill tier of these caches in `directory` (locked for this process's life)."""
    expected = {}
    for name, cache in caches.items():
        hosted = models[name]
        expected[name] = Expected(
            model=name,
            fingerprint=model_fingerprint(hosted),
            dtype=cache.dtype,
            num_kv_heads=cache.num_kv_heads,
            head_dim=cache.head_dim,
            max_len=hosted.spec.max_seq_len,
            max_bytes=cache.budget_bytes,
        )
    return SpillTier(SpillStore(directory, budget_bytes), expected)


def restore(table: SessionTable, session_id: str, owner: str | None) -> float:
    """Brings a spilled session back; the seconds it took (0: it was not spilled, or another
    call brought it back meanwhile). A caller that does not own it gets NOT_FOUND as for an
    unknown id; a file that cannot be adopted ends the session NOT_FOUND, saying why."""
    started = time.perf_counter()
    spilled = table.spilled(session_id)
    if spilled is None:
        return 0.0
    if not owns(owner, spilled.record.owner):  # as for an id never made: nothing to tell
        raise SessionNotFound(session_id, "unknown", unknown_message(session_id))
    try:
        record, k, v = table.spill.read(spilled)  # the I/O: off the table's lock
    except BadRecord as e:
        if table.spilled(session_id) is None:  # another call brought it back meanwhile
            return 0.0
        message = (
            f"session {session_id!r} could not be brought back from the spill directory ({e}); "
            "create a new session and send its tokens again"
        )
        table.forget_spilled(session_id, "bad_file", message)
        raise SessionNotFound(session_id, "lost", message) from None
    table.adopt(record, k, v, key_absmax=key_bound(k, v))
    return time.perf_counter() - started
