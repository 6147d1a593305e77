"""How the session table makes room in a full KV cache: expiry, then spilling least recently
used idle sessions to the spill tier (spill.py) or evicting them; and how a spilled session
comes back (adopt). Part of SessionTable (sessions.py), kept in a file of its own; every
method runs under the table's lock."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from .errors import CacheExhausted, SpillFull
from .types import ModelCache, Session, SessionStats, SpillInfo

if TYPE_CHECKING:  # (spill.py brings torch; the table needs only its objects)
    from .record import SessionRecord
    from .spill import Spilled, SpillTier

log = logging.getLogger(__name__)


class RoomMaking:
    """SessionTable's room making and spill tier (mixed into it; its state is the table's)."""

    def set_spill(self, tier: SpillTier) -> None:
        with self._lock:
            self.spill = tier

    def spilled(self, session_id: str) -> Spilled | None:
        """The spill tier's entry of a spilled session (None: not spilled)."""
        with self._lock:
            if session_id not in self._spilled or self.spill is None:
                return None
            return self.spill.get(session_id)

    def spill_idle(self) -> list[str]:
        """Writes every idle session to the spill tier (at shutdown, once drained); the ids
        written. A session that cannot be written stays (it is lost with the process)."""
        with self._lock:
            now = self._clock()
            idle = [s for s in self._sessions.values() if s.in_use == 0]
            idle.sort(key=lambda s: s.last_used_s)  # the most recent last: kept if it fills
            return [s.id for s in idle if self._spill_one(s, now, reason="shutdown")]

    def adopt_spilled(self) -> tuple[list[str], list[tuple[str, str]]]:
        """At start: takes over the sessions the spill directory holds (their tensors stay
        on disk until each comes back), TTLs continuing: one whose TTL ran out while no
        server held it expires now (its file goes; its next call says so). (adopted ids,
        refused (file, reason))."""
        with self._lock:
            if self.spill is None:
                return [], []
            found, refused = self.spill.scan()
            now = self._clock()
            for entry in found:
                r = entry.record
                ghost = Session(r.session_id, r.model, r.max_len, r.ttl_s, now, now)
                ghost.last_used_s = now - self.spill.idle_s(entry)
                ghost.num_tokens, ghost.owner = r.num_tokens, r.owner
                ghost.sequence_id = r.sequence_id
                self._spilled[r.session_id] = ghost
                self.quota.add(ghost)
            for _, why, r in refused:  # its owner's next call says why, not "never here"
                if r is not None and r.session_id not in self._spilled:
                    self._remember_gone(
                        r.session_id,
                        "lost",
                        f"session {r.session_id!r} is lost: its spill file was refused when "
                        f"this server started ({why})",
                        r.owner,
                    )
            self._forget_expired(self.spill.trim())  # a smaller budget than it was written to
            self.expire(now)
            adopted = [e.session_id for e in found if e.session_id in self._spilled]
            return adopted, [(str(p), why) for p, why, _ in refused]

    def adopt(self, record: SessionRecord, k: Any, v: Any) -> SessionStats:
        """Brings a spilled session back under its id: blocks for the K/V it held (making
        room as for a step: other idle sessions may be spilled), its tokens, limits, owner,
        idle time, and the engine's state recomputed from its K/V (engine_state_of); its
        file goes. Already back (another call restored it): its stats."""
        engine_state = self.engine_state_of(k, v)  # (a pass over the K/V: off the lock)
        with self._lock:
            now = self._clock()
            live = self._sessions.get(record.session_id)
            if live is not None:
                return self._session_stats(live)
            ghost = self._spilled.get(record.session_id)
            if ghost is None:  # closed or expired meanwhile: as any lookup says
                self._lookup(record.session_id, now)
            m = self._model(record.model)
            bs = m.storage.block_size
            s = Session(record.session_id, record.model, record.max_len, record.ttl_s, now, now)
            # Brought back for a call: spared by making room as if used now, so that it is
            # never sent straight back before its call runs; its TTL runs on (GetSession
            # reads it, and reading a session is no use).
            s.last_used_s, s.restored_s, s.owner = ghost.last_used_s, now, record.owner
            s.sequence_id = record.sequence_id
            s.first_block = record.first_position // bs
            s.engine_state = engine_state
            num_blocks = -(-record.num_tokens // bs) - s.first_block
            # Its blocks count against its owner's bytes again (a spilled session holds none
            # meanwhile, so the owner may have filled its share since).
            self.quota.check_growth(s, num_blocks)
            s.holds.pins = 1  # making room never picks it
            # Out of the tier's index while room is made: spilling others may expire the
            # oldest spilled, never this one. Its file stays until it is back.
            entry = self.spill.detach(s.id)
            try:
                self._make_room(m, num_blocks, None, s, now)
                self._load(m, s, num_blocks, record, k, v)
            except BaseException:  # no room: it stays spilled, as it was
                if entry is not None:
                    self.spill.attach(entry)
                raise
            s.num_tokens, s.holds.pins = record.num_tokens, 0
            del self._spilled[s.id]
            self.quota.remove(ghost)
            self.quota.add(s)
            self._sessions[s.id] = s
            if entry is not None:
                self.spill.delete(entry)
            return self._session_stats(s)

    @staticmethod
    def _load(m: ModelCache, s: Session, num_blocks: int, record: SessionRecord, k, v) -> None:
        """Blocks for a session coming back or moved in, holding the record's K/V."""
        s.block_table = m.pool.allocate(num_blocks)
        try:
            m.storage.load(s.block_table, s.first_block, record.first_position, k, v)
        except BaseException:
            m.pool.decref(s.block_table)
            s.block_table = []
            raise

    def forget_spilled(self, session_id: str, reason: str, message: str) -> None:
        """A spilled session that cannot come back (its file refused): gone, saying why."""
        with self._lock:
            if session_id in self._spilled:
                self._forget_spilled(session_id, reason, message)

    def spill_info(self) -> SpillInfo:
        """The spill tier's sessions, bytes and budget; zeros when there is none."""
        with self._lock:
            if self.spill is None:
                return SpillInfo(0, 0, 0)
            return SpillInfo(len(self._spilled), self.spill.nbytes, self.spill.budget_bytes)

    def _spill_all_of(self, victims: list[Session], now: float) -> bool:
        """Spills the victims (making room); False, with nothing dropped, if one fails."""
        return all(self._spill_one(s, now) for s in victims)

    def _spill_one(self, s: Session, now: float, reason: str = "room") -> bool:
        """Writes one idle session to the spill tier and frees its blocks; False (and it
        stays) when it cannot be written: the tier refuses its size, or the disk fails."""
        m = self._models[s.model]
        try:
            k, v = m.storage.export(s.block_table, s.num_tokens, s.first_block)
            expired = self.spill.put(
                s,
                k,
                v,
                idle_s=now - s.last_used_s,
                first_position=s.first_block * m.storage.block_size,
            )
        except (SpillFull, OSError) as e:
            log.warning("session %s not spilled (%s); kept in the cache", s.id, e)
            return False
        self._forget_expired(expired)
        del self._sessions[s.id]
        self._release(s)
        self._spilled[s.id] = s  # (still counted by the quota: its owner's session)
        if self.on_spill is not None:
            try:
                self.on_spill(s.model, self.spill.get(s.id).nbytes, reason)
            except Exception:
                log.exception("on_spill failed; the session was spilled all the same")
        return True

    def _forget_expired(self, expired: list[Spilled]) -> None:
        """The oldest spilled sessions, expired to keep the tier within its budget: lost."""
        for entry in expired:
            self._forget_spilled(
                entry.session_id,
                "expired",
                f"session {entry.session_id!r} was spilled to disk to make room and has since "
                f"expired from the full spill tier (session_spill_bytes "
                f"{self.spill.budget_bytes}: its oldest sessions go first); create a new "
                "session and send its tokens again",
                lost=True,
            )

    def _forget_spilled(
        self, session_id: str, reason: str, message: str, *, lost: bool = False
    ) -> None:
        ghost = self._spilled.pop(session_id)
        self.quota.remove(ghost)
        if self.spill is not None:
            self.spill.remove(session_id)
        self._remember_gone(session_id, reason, message, ghost.owner)
        if self.on_end is not None:
            try:
                self.on_end("spill_full" if lost else reason)
            except Exception:
                log.exception("on_end(%r) failed; the session ended all the same", reason)

    def _make_room(
        self,
        m: ModelCache,
        new_blocks: int,
        shared_last: int | None,
        requester: Session,
        now: float,
    ) -> None:
        """Frees blocks until the requester's step fits: `new_blocks`, plus a private copy of
        its partial last block `shared_last` while another session still holds that. Expired
        sessions go first, then (if evict) least recently used idle sessions, only those
        needed; or raises CacheExhausted having evicted nothing."""
        pool = m.pool

        def fits(free: int, shared_holders_gone: int = 0) -> bool:
            copy = shared_last is not None and pool.refcount(shared_last) - shared_holders_gone > 1
            return new_blocks + copy <= free

        if fits(pool.num_free):
            return
        self.expire(now)
        if fits(pool.num_free):
            return
        if self.spill is not None:
            victims = self._victims(m, requester, shared_last, fits)
            if victims is not None and self._spill_all_of(victims, now):
                return
        if self.evict:
            victims = self._victims(m, requester, shared_last, fits)
            if victims is not None:
                for s in victims:
                    self._drop(
                        s,
                        "evicted",
                        f"session {s.id!r} was evicted to free KV-cache memory for model "
                        f"{s.model!r} (least recently used: idle {now - s.last_used_s:.1f} s, "
                        f"{s.num_tokens} tokens); create a new session",
                    )
                return
        needed = new_blocks + (shared_last is not None and pool.refcount(shared_last) > 1)
        hint = (
            "eviction cannot free enough: the rest is held by sessions with a step in flight "
            "or by this session"
            if self.evict
            else "eviction is off: close idle sessions, shorten their TTL or raise the budget"
        )
        if self.spill is not None:
            hint = (
                "spilling idle sessions to disk cannot free enough: the rest is held by "
                "sessions with a step in flight or by this session"
            )
        st = m.storage
        raise CacheExhausted(
            f"KV cache of model {requester.model!r} is full: session {requester.id!r} needs "
            f"{needed} more block(s) of {st.block_size} tokens but {pool.num_free} of "
            f"{pool.num_blocks} are free (budget {st.budget_bytes} bytes, "
            f"{st.bytes_per_block} bytes per block); {hint}",
            num_needed=needed,
            num_free=pool.num_free,
            num_blocks=pool.num_blocks,
            # (Only spilling or eviction frees another session's blocks once it is idle.)
            in_flight=sum(
                1
                for s in self._sessions.values()
                if s.model == requester.model
                and s is not requester
                and s.in_use > 0
                and s.block_table
            )
            if self.spill is not None or self.evict
            else 0,
        )

    def _victims(
        self, m: ModelCache, requester: Session, shared_last: int | None, fits
    ) -> list[Session] | None:
        """The idle sessions to evict so that fits(free blocks, holders of the requester's
        shared last block among them) holds: the least recently used first, then those the
        rest make unneeded dropped again (an empty session, or a fork whose blocks its
        parent still holds, frees nothing alone). None if all of them would not do."""
        pool = m.pool
        candidates = sorted(
            (
                s
                for s in self._sessions.values()
                if s.model == requester.model and s.in_use == 0 and s is not requester
            ),
            key=lambda s: s.spared_since,
        )
        holders: dict[int, int] = {}  # block -> chosen sessions holding it
        freed = sharing = 0  # blocks every holder of which is chosen; chosen holders of shared_last
        chosen: list[Session] = []
        for s in candidates:
            chosen.append(s)
            for b in s.block_table:
                holders[b] = holders.get(b, 0) + 1
                freed += holders[b] == pool.refcount(b)
                sharing += b == shared_last
            if fits(pool.num_free + freed, sharing):
                break
        else:
            return None
        for s in reversed(chosen[:-1]):  # the most recently used first: spare what can be
            lost = sum(holders[b] == pool.refcount(b) for b in s.block_table)
            gone = sum(b == shared_last for b in s.block_table)
            if fits(pool.num_free + freed - lost, sharing - gone):
                chosen.remove(s)
                freed, sharing = freed - lost, sharing - gone
                for b in s.block_table:
                    holders[b] -= 1
        return chosen
