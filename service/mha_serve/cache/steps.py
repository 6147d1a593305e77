"""A step's hold on the session table: claims and pins, then the step's two phases, reserve
(room for its tokens: blocks allocated, a shared partial block copied, room made) and commit
or rollback; a session freed with its last hold. Part of SessionTable (sessions.py), kept in
a file of its own; every method runs under the table's lock."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from .errors import CacheError, InvalidSessionArgument, SessionBusy, SessionFull, SessionNotFound
from .types import ModelCache, Reservation, Session, SessionStats
from .window import first_needed_block, read_start


class Stepping:
    """SessionTable's steps and holds (mixed into it; its state is the table's)."""

    def pin(self, session_id: str) -> Session:
        """Keep the session from eviction and expiry until unpin()."""
        with self._lock:
            s = self._lookup(session_id, self._clock())
            s.holds.pins += 1
            return s

    def unpin(self, session_id: str) -> None:
        with self._lock:
            s = self._sessions.get(session_id) or self._zombies.get(session_id)
            if s is None:
                raise ValueError(f"unpin of session {session_id!r}, which is not pinned")
            self._unpin(s)

    def claim(self, session_id: str, owner: str | None = None) -> None:
        """Claims the session for one step, from its receipt to its answer: another step
        of it meanwhile (on another call or stream) is refused with SessionBusy at once,
        whether the first still queues or computes, and so is a truncate. The claim pins the
        session: a step waiting in the queue never finds it expired or evicted."""
        with self._lock:
            s = self._lookup(session_id, self._clock(), owner)
            self._check_owner(s, owner)
            if s.holds.busy(claiming=True):
                raise SessionBusy(_BUSY.format(session_id=session_id))
            s.holds.claimed = True

    def release(self, session_id: str) -> None:
        """The claimed step is answered (or failed): unclaimed and unpinned. A session closed
        meanwhile is freed now (its last pin)."""
        with self._lock:
            s = self._sessions.get(session_id) or self._zombies.get(session_id)
            if s is not None and s.holds.claimed:
                s.holds.claimed = False
                self._let_go(s)

    def reserve(
        self, session_id: str, num_new_tokens: int, *, claimed: bool = False
    ) -> Reservation:
        """Room for num_new_tokens more tokens: checks max_len, allocates blocks (evicting
        if allowed), copies a shared partial last block first. Pins the session until
        commit() or rollback(); num_tokens is unchanged until commit(). claimed: the caller
        holds the session's claim (claim()); unclaimed, a claimed session is busy."""
        with self._lock:
            now = self._clock()
            return self._reserve(self._lookup(session_id, now), num_new_tokens, claimed, now)

    def _reserve(self, s: Session, num_new_tokens: int, claimed: bool, now: float) -> Reservation:
        """reserve() of the live session s (looked up at `now`), under the lock."""
        session_id = s.id  # (every step: the common case reads each value once)
        n = num_new_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InvalidSessionArgument(f"num_new_tokens must be an int >= 1, got {n!r}")
        holds = s.holds
        if holds.pending is not None or (holds.claimed and not claimed):
            raise SessionBusy(_BUSY.format(session_id=session_id))
        m = self._models[s.model]
        bs, pool = m.storage.block_size, m.pool
        past, first = s.num_tokens, s.first_block
        total = past + n
        if s.max_len is not None and total > s.max_len:  # never above the model's
            whose = " (the model's)" if s.max_len == m.max_len else ""
            raise SessionFull(f"{_past(s, n)} its max_len {s.max_len}{whose}")
        needed = -(-total // bs) - first  # blocks the session holds with the step
        if needed > pool.num_blocks:  # no eviction ever makes room
            raise SessionFull(
                f"{_past(s, n)} all that the KV cache of model {s.model!r} holds: "
                f"{pool.num_blocks} blocks of {bs} tokens ({m.storage.budget_bytes} bytes, "
                "kv_cache_bytes)"
            )
        table = s.block_table
        num_new_blocks = needed - len(table)
        shared_last = (  # a partial last block that a fork shares: copied before writing
            table[-1] if past % bs and table and pool.refcount(table[-1]) > 1 else None
        )
        if num_new_blocks or shared_last is not None:  # (most decode steps: neither)
            self._grow(s, m, num_new_blocks, shared_last, now)
            table = s.block_table
        if n == 1:  # (a decode step)
            slots = (table[past // bs - first] * bs + past % bs,)
        else:
            slots = tuple(table[p // bs - first] * bs + p % bs for p in range(past, total))
        window = m.window
        res = Reservation(
            session_id,
            s.model,
            past,
            n,
            tuple(table),
            slots,
            num_new_blocks,
            first,
            0 if window is None else read_start(past, window),
            s.engine_state,
        )
        holds.pending = res
        s.last_used_s = now
        return res

    def _grow(
        self,
        s: Session,
        m: ModelCache,
        num_new_blocks: int,
        shared_last: int | None,
        now: float,
    ) -> None:
        """reserve's new blocks for session s (after a shared partial last block's private
        copy): within its owner's quota, making room first (evicting if allowed)."""
        pool = m.pool
        self.quota.check_growth(s, num_new_blocks)
        self._make_room(m, num_new_blocks, shared_last, s, now)
        cow = shared_last is not None and pool.refcount(shared_last) > 1  # (if not evicted)
        # New blocks follow the session's last one where they can (attention reads a
        # session with consecutive blocks in place); a private copy of a shared last
        # block takes that block's place, so it follows the one before.
        table = s.block_table
        after = table[len(table) - cow - 1] if len(table) > cow else None
        ids = pool.allocate(num_new_blocks + cow, after=after)
        if cow:  # the other holder must never see this write
            shared, private = s.block_table[-1], ids[0]
            try:
                m.storage.copy_block(shared, private)
            except BaseException:  # (a device error): the new blocks are nobody's
                pool.decref(ids)
                raise
            ids.pop(0)
            s.block_table[-1] = private
            pool.decref([shared])
        s.block_table.extend(ids)

    def reserve_many(
        self, requests: Sequence[tuple[str, int] | tuple[str, int, bool]]
    ) -> list[Reservation | CacheError]:
        """reserve() for each (session_id, num_new_tokens[, claimed]) of one batch, with all
        of the batch's sessions held first so that making room for one never evicts another
        (pinned; a claimed one is held by its claim already).
        Returns a Reservation or the CacheError for each, in order. Any other error (a
        device error copying a block) rolls back the batch's reservations and is raised."""
        with self._lock:
            if len(requests) == 1:  # no other session of the batch to keep from eviction
                session_id, n, *claimed = requests[0]
                try:
                    return [self.reserve(session_id, n, claimed=bool(claimed and claimed[0]))]
                except CacheError as e:
                    return [e]
            pinned = []
            results: list[Reservation | CacheError] = []
            clock, lookup, sessions = self._clock, self._lookup, self._sessions
            try:
                held: list[Session | None] = []  # each request's session as pinned here
                for session_id, _, *claimed in requests:
                    s = None
                    # Its claim holds it (served steps: every one); released early only when
                    # its caller is gone. A failed lookup is raised again below, in place.
                    if not (claimed and claimed[0]):
                        with contextlib.suppress(CacheError):
                            s = self.pin(session_id)
                            pinned.append(s)
                    held.append(s)
                for (session_id, n, *claimed), s in zip(requests, held, strict=True):
                    try:
                        now = clock()
                        # A session pinned here is still the live one (held: never dropped
                        # meanwhile), and unexpired: its lookup (reserve()'s) is skipped.
                        if s is None or sessions.get(session_id) is not s:
                            s = lookup(session_id, now)
                        results.append(self._reserve(s, n, bool(claimed and claimed[0]), now))
                    except CacheError as e:
                        results.append(e)
            except BaseException:
                for r in results:
                    if isinstance(r, Reservation):
                        self.rollback(r)
                raise
            finally:
                for s in pinned:
                    self._unpin(s)
            return results

    def commit(self, res: Reservation, *, engine_state: object = None) -> SessionStats:
        """The step's K/V are written: count its tokens and unpin, and return the session's
        stats (one transaction). engine_state: the engine's state of the session with the
        step's K/V (Session.engine_state; None: as it was). SessionNotFound when the
        session was closed while the step ran (its cache went with it)."""
        with self._lock:
            s = self._pending_owner(res)
            s.num_tokens = res.start + res.num_tokens
            if engine_state is not None:
                s.engine_state = engine_state
            s.holds.pending = None
            m = self._models[s.model]
            if m.window is not None:
                self._slide(s)
            s.last_used_s = self._clock()
            self._let_go(s)
            if s.id not in self._sessions:
                reason, message, _ = self._gone.get(
                    s.id, ("closed", f"session {s.id!r} was closed", s.owner)
                )
                raise SessionNotFound(s.id, reason, message)
            return self._session_stats(s, m)

    def rollback(self, res: Reservation) -> None:
        """The step failed: free the blocks it appended and unpin. (A copy-on-write copy
        is kept: it holds the same tokens as the block it replaced.)"""
        with self._lock:
            s = self._pending_owner(res)
            if res.num_new_blocks:
                dropped = s.block_table[-res.num_new_blocks :]
                del s.block_table[-res.num_new_blocks :]
                self._models[s.model].pool.decref(dropped)
            s.holds.pending = None
            self._let_go(s)

    def _pending_owner(self, res: Reservation) -> Session:
        s = self._sessions.get(res.session_id) or self._zombies.get(res.session_id)
        if s is None or s.holds.pending is not res:
            raise ValueError(
                f"reservation of {res.num_tokens} token(s) at {res.start} is not session "
                f"{res.session_id!r}'s pending step (already committed or rolled back?)"
            )
        return s

    def _unpin(self, s: Session) -> None:
        if s.holds.pins < 1:
            raise ValueError(f"unpin of session {s.id!r}, which is not pinned")
        s.holds.pins -= 1
        self._let_go(s)

    def _let_go(self, s: Session) -> None:
        """One hold of the session went (a pin, its claim, its pending step): when it was
        the last, the session is idle from now, or freed if it was dropped meanwhile."""
        if s.holds.count:
            return
        # Idle from now: a step that ran long (then kept or rolled back) is no idle time
        # towards the TTL; a retry after its error finds the session.
        s.last_used_s = self._clock()
        if s.holds.dropped:
            s.holds.dropped = False
            del self._zombies[s.id]
            self._release(s)

    def _free_when_let_go(self, s: Session) -> None:
        """A session out of the table (dropped or moved out): its blocks go now, or with
        its last hold (until then a commit or release still finds it, in _zombies)."""
        if s.holds.count:
            s.holds.dropped = True
            self._zombies[s.id] = s
        else:
            self._release(s)

    def _release(self, s: Session) -> None:
        self._models[s.model].pool.decref(s.block_table)
        s.block_table = []

    def _slide(self, s: Session) -> None:
        """Frees the session's blocks that lie wholly before its next step's window (a
        sliding-window model's only): none of its steps can see them again."""
        m = self._models[s.model]
        first = first_needed_block(s.num_tokens, m.window, m.storage.block_size)
        if first <= s.first_block:
            return
        gone = s.block_table[: first - s.first_block]
        del s.block_table[: first - s.first_block]
        s.first_block = first
        m.num_blocks_out_of_window += len(m.pool.decref(gone))  # a fork's shared ones stay


_BUSY = (
    "session {session_id!r} already has a step in flight (sent on another call or stream); "
    "send a session's steps one at a time, each after the last one's reply"
)


def _past(s: Session, n: int) -> str:
    """The start of a refusal's message: a step of n tokens would overfill session s."""
    total = s.num_tokens + n
    return f"session {s.id!r} holds {s.num_tokens} tokens; appending {n} would make {total}, past"
