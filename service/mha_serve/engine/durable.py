"""Sessions that outlive their place in the KV cache: the spill tier opened over the models
served here (each model's records must match its fingerprint), and a spilled session
brought back (its file read and checked off the table's lock, then adopted under its id).
The SessionTable does the rest (cache/room.py, cache/spill.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping

from mha_serve.cache import KVCache, SessionNotFound, SessionTable
from mha_serve.cache.record import BadRecord, Expected
from mha_serve.cache.sessions import owns, unknown_message
from mha_serve.cache.spill import SpillStore, SpillTier
from mha_serve.engine.fingerprint import model_fingerprint
from mha_serve.engine.types import HostedModel


class Expectations(Mapping[str, Expected]):
    """model -> what a record of its sessions must match here (the model's fingerprint,
    its cache's dtype and shape, its limits): for spill files and moved sessions alike.
    Each model's is computed on first use (hashing its weights) and kept."""

    def __init__(self, models: dict[str, HostedModel], caches: dict[str, KVCache]) -> None:
        self._models, self._caches = models, caches
        self._known: dict[str, Expected] = {}
        self._lock = threading.Lock()

    def __getitem__(self, model: str) -> Expected:
        with self._lock:
            known = self._known.get(model)
            if known is None:
                cache, hosted = self._caches[model], self._models[model]  # KeyError: none
                known = self._known[model] = Expected(
                    model=model,
                    fingerprint=model_fingerprint(hosted),
                    dtype=cache.dtype,
                    num_kv_heads=cache.num_kv_heads,
                    head_dim=cache.head_dim,
                    max_len=hosted.spec.max_seq_len,
                    max_bytes=cache.budget_bytes,
                    block_size=cache.block_size,
                    values_are_keys=cache.values_are_keys,
                )
            return known

    def __iter__(self) -> Iterator[str]:
        return iter(self._caches)

    def __len__(self) -> int:
        return len(self._caches)


def open_spill_tier(expected: Expectations, directory: str, budget_bytes: int) -> SpillTier:
    """The spill tier of the caches `expected` covers in `directory` (locked for this
    process's life)."""
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
    table.adopt(record, k, v)  # (its KeyBound recomputed from k and v: engine_state_of)
    return time.perf_counter() - started
