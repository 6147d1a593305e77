"""How a session leaves this table for another server and comes into one, whole: packed as
one record's bytes (record.py, the form of a spill file), received under the same id by the
table of another process with the same model, released here once it is there. A Ray Serve
replica that Ray stops moves its sessions this way (mha_serve.ray_app). Part of
SessionTable (sessions.py), kept in a file of its own; every method runs under the table's
lock, but for reading and checking a record, which takes none."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from .errors import CacheExhausted, SessionBusy, SessionExists, SessionNotFound
from .types import Session, SessionStats

if TYPE_CHECKING:  # (record.py brings torch; the table needs only its objects)
    from .record import SessionRecord

log = logging.getLogger(__name__)


class Moving:
    """SessionTable's moves (mixed into it; its state is the table's)."""

    def session_ids(self) -> list[str]:
        """Every session held, live or spilled, the least recently used first."""
        with self._lock:
            held = list(self._sessions.values()) + list(self._spilled.values())
            return [s.id for s in sorted(held, key=lambda s: s.spared_since)]

    def pack(self, session_id: str) -> bytes:
        """The session as one record's bytes, to be received elsewhere; it stays here, as it
        was, until released (moved_out). SessionBusy while a step of it is in flight or a
        call pins it; SessionNotFound as for any lookup."""
        from .record import encode, record_of

        with self._lock:
            now = self._clock()
            spilled = self.spilled(session_id)
            if spilled is not None:  # its file is already the record
                return spilled.path.read_bytes()
            s = self._lookup(session_id, now)
            if s.holds.count:
                raise SessionBusy(
                    f"session {session_id!r} has a step or call in flight; it moves once idle"
                )
            m = self._models[s.model]
            k, v = m.storage.export(s.block_table, s.num_tokens, s.first_block)
            record = record_of(
                s,
                self.expected[s.model],
                first_position=s.first_block * m.storage.block_size,
                idle_s=now - s.last_used_s,
                written_at=self._wall(),
            )
        return encode(record, k, v)  # (host copies: no lock needed)

    def moved_out(self, session_id: str, where: str) -> None:
        """The session lives on elsewhere (received there): its blocks or file go here, and a
        call that still reaches this table is told NOT_FOUND saying where it went. Not an
        end: no on_end hook (the session did not end)."""
        message = (
            f"session {session_id!r} moved to {where}; its calls go there (this server "
            "no longer holds it)"
        )
        with self._lock:
            ghost = self._spilled.pop(session_id, None)
            if ghost is not None:
                owner = ghost.owner
                self.quota.remove(ghost)
                self.spill.remove(session_id)
            else:
                s = self._sessions.pop(session_id, None)
                if s is None:
                    return
                owner = s.owner
                self.quota.remove(s)
                self._free_when_let_go(s)  # (a hold taken since it was packed: freed with it)
            self._remember_gone(session_id, "moved", message, owner)

    def receive(self, data: bytes, source: str) -> SessionStats:
        """Adopts a session packed elsewhere, under its id, owner, limits and idle time (its
        TTL goes on): into the KV cache, making room as a step does; when that cannot be
        done, into the spill tier if there is one. BadRecord (a file that is not a session
        of a model served here, say why), SessionExists, SessionNotFound (expired on the
        way), CacheExhausted or SpillFull (no room anywhere)."""
        from .record import BadRecord, decode, read_header

        header = read_header(data, source)
        expected = self.expected.get(header.model)
        if expected is None:
            raise BadRecord(f"{source}: a session of model {header.model!r}, not served here")
        record, k, v = decode(data, source, expected)  # checked whole, off the lock
        engine_state = self.engine_state_of(k, v)  # recomputed, never read from the bytes
        with self._lock:
            if record.session_id in self._sessions or record.session_id in self._spilled:
                raise SessionExists(f"session {record.session_id!r} is already held here")
            now = self._clock()
            idle_s = record.idle_s + max(0.0, self._wall() - record.written_at)
            if record.ttl_s is not None and idle_s > record.ttl_s:
                raise SessionNotFound(
                    record.session_id,
                    "expired",
                    f"session {record.session_id!r} expired while it moved (idle "
                    f"{idle_s:.1f} s, TTL {record.ttl_s:g} s); create a new session",
                )
            m = self._model(record.model)
            bs = m.storage.block_size
            s = Session(record.session_id, record.model, record.max_len, record.ttl_s, now, now)
            s.last_used_s, s.owner = now - idle_s, record.owner
            s.sequence_id = record.sequence_id
            s.first_block = record.first_position // bs
            s.engine_state = engine_state
            num_blocks = -(-record.num_tokens // bs) - s.first_block
            s.holds.pins = 1  # making room never picks it
            try:
                self._make_room(m, num_blocks, None, s, now)
            except CacheExhausted:
                if self.spill is None:
                    raise
                self._receive_spilled(s, record, k, v)
                return self._session_stats(s)
            self._load(m, s, num_blocks, record, k, v)
            s.num_tokens, s.holds.pins = record.num_tokens, 0
            self._gone.pop(s.id, None)
            self._sessions[s.id] = s
            self.quota.add(s)
            return self._session_stats(s)

    def _receive_spilled(self, s: Session, record: SessionRecord, k, v) -> None:
        """A received session straight into the spill tier (no room in the cache)."""
        expired = self.spill.store.put(record, k, v)  # SpillFull: alone over the budget
        self._forget_expired(expired)
        s.num_tokens, s.holds.pins, s.block_table = record.num_tokens, 0, []
        self._gone.pop(s.id, None)
        self._spilled[s.id] = s
        self.quota.add(s)
