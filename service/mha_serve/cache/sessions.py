"""Session table: session id -> block table, over one BlockPool per model. Appends in
two phases (reserve, then commit or rollback), forks with copy-on-write, TTL expiry, LRU
eviction or spilling to disk (spill.py), and owners. Works with block ids; asks the KV
storage only to copy a block, and to export or load a session's K/V (a spill, a restore)."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .block_pool import BlockPool
from .errors import (
    CacheError,
    InvalidSessionArgument,
    SessionBusy,
    SessionFull,
    SessionNotFound,
    SessionSpilled,
)
from .moves import Moving
from .quota import OwnerQuota
from .room import RoomMaking
from .types import (
    IDENTIFIED,
    BlockStorage,
    ModelCache,
    ModelCacheStats,
    Reservation,
    Session,
    SessionStats,
)
from .window import first_needed_block, read_start, shortest_truncate

if TYPE_CHECKING:  # (spill.py brings torch; the table needs only its objects)
    from .record import Expected
    from .spill import SpillTier

log = logging.getLogger(__name__)

DEFAULT_MAX_REMEMBERED = 4096  # gone session ids kept to say why they are gone


class SessionTable(RoomMaking, Moving):
    """All sessions of one server, across models. Thread-safe (one lock)."""

    def __init__(
        self,
        *,
        evict: bool = False,
        default_ttl_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        max_remembered: int = DEFAULT_MAX_REMEMBERED,
        on_end: Callable[[str], None] | None = None,
        id_prefix: str = "",
    ) -> None:
        self.evict = evict
        # Starts every session id: a Ray Serve replica puts its own id here, so that a
        # session's id names the replica that holds it (mha_serve.ray_app routes by it).
        self.id_prefix = id_prefix
        # Called (under the table's lock) with the reason each time a session ends: "closed",
        # "expired" (by the sweeper, a lookup or making room) or "evicted".
        self.on_end = on_end
        self.default_ttl_s = _check_ttl(default_ttl_s)
        self._clock = clock
        self._wall = wall  # wall time: a record's idle time goes on across processes
        self._max_remembered = max_remembered
        self._models: dict[str, ModelCache] = {}
        self._sessions: dict[str, Session] = {}
        # Dropped while held (Holds.dropped), by id: a commit or release still finds them.
        self._zombies: dict[str, Session] = {}
        self._gone: OrderedDict[str, tuple[str, str]] = OrderedDict()  # id -> (reason, msg)
        # The spill tier (spill.py; None: off): a full cache moves its least recently used
        # idle sessions there instead of refusing or evicting. A spilled session keeps its
        # Session here (no blocks): its limits, owner and quota count stay until it is
        # brought back (adopt) or ends.
        self.spill: SpillTier | None = None
        # Called (under the lock) with (model, bytes written, reason: "room" or "shutdown")
        # each time a session is spilled.
        self.on_spill: Callable[[str, int, str], None] | None = None
        self._spilled: dict[str, Session] = {}
        # model -> what a record of its sessions must match here (engine.durable's
        # Expectations): spill files, sessions moved in (moves.py).
        self.expected: Mapping[str, Expected] = {}
        # (k, v) -> a session's Session.engine_state, for K/V that arrive whole (adopt,
        # receive): the engine's, computed from the tensors, off the lock.
        self.engine_state_of: Callable[[Any, Any], object] = _no_engine_state
        self._lock = threading.RLock()
        # Per-client limits (off until set_client_limits): sessions and bytes per owner.
        self.quota = OwnerQuota(lambda model: self._models[model].storage.bytes_per_block)

    def set_client_limits(self, *, max_sessions: int, max_bytes: int) -> None:
        """Live sessions and KV bytes each owner may hold (0: no limit)."""
        with self._lock:
            self.quota.set_limits(max_sessions=max_sessions, max_bytes=max_bytes)

    def add_model(
        self,
        name: str,
        storage: BlockStorage,
        *,
        max_len: int | None = None,
        window: int | None = None,
    ) -> None:
        """Give model `name` a pool of storage.num_blocks blocks; max_len caps every session;
        window: the model's sliding window (each session then keeps only the blocks its next
        step can see, and holds at most about window + a step's tokens, at any length)."""
        with self._lock:
            if name in self._models:
                raise ValueError(f"model {name!r} already has a KV cache")
            pool = BlockPool(storage.num_blocks)
            self._models[name] = ModelCache(storage, pool, max_len, window)

    def pool(self, model: str) -> BlockPool:
        return self._model(model).pool

    def num_blocks_out_of_window(self, model: str) -> int:
        """Blocks of the model freed so far because they fell out of a session's sliding
        window (cumulative, cheap: no per-session stats are built)."""
        with self._lock:
            return self._model(model).num_blocks_out_of_window

    def num_sessions(self, model: str) -> int:
        """Live sessions of one model (cheap: no per-session stats are built)."""
        with self._lock:
            return sum(1 for s in self._sessions.values() if s.model == model)

    def __len__(self) -> int:
        return len(self._sessions)

    def create(
        self,
        model: str,
        max_len: int | None = None,
        ttl_s: float | None = None,
        owner: str = "",
    ) -> Session:
        """A new empty session; max_len None takes the model's, ttl_s None the default;
        owner: the client whose per-client limits it counts against ("": none)."""
        with self._lock:
            m = self._model(model)
            if max_len is not None:
                if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
                    raise InvalidSessionArgument(f"max_len must be an int >= 1, got {max_len!r}")
                if m.max_len is not None and max_len > m.max_len:
                    raise InvalidSessionArgument(
                        f"max_len {max_len} is past the max_seq_len {m.max_len} of model {model!r}"
                    )
            ttl_s = self.default_ttl_s if ttl_s is None else _check_ttl(ttl_s)
            now = self._clock()
            self.quota.check_new_session(owner)
            s = Session(
                self.id_prefix + uuid.uuid4().hex,
                model,
                m.max_len if max_len is None else max_len,
                ttl_s,
                now,
                now,
            )
            s.owner = owner
            self._sessions[s.id] = s
            self.quota.add(s)
            return s

    def get(self, session_id: str, owner: str | None = None) -> Session:
        """The live session, or SessionNotFound saying why not (does not count as use).
        owner: the caller; a session made by another identified client is NOT_FOUND to it
        (owns), exactly as an id never made. None: unchecked (the engine's own calls)."""
        with self._lock:
            s = self._lookup(session_id, self._clock())
            self._check_owner(s, owner)
            return s

    def fork(
        self, session_id: str, *, ttl_s: float | None = None, owner: str | None = None
    ) -> Session:
        """A new session sharing all of the parent's committed blocks (no copy); the
        first append to a shared partial block copies it. Inherits max_len, ttl_s and its
        owner."""
        with self._lock:
            now = self._clock()
            parent = self._lookup(session_id, now)
            self._check_owner(parent, owner)
            m = self._models[parent.model]
            ttl_s = parent.ttl_s if ttl_s is None else _check_ttl(ttl_s)
            self.quota.check_new_session(parent.owner)  # a fork counts against the parent's
            held = _cdiv(parent.num_tokens, m.storage.block_size) - parent.first_block
            blocks = parent.block_table[:held]
            m.pool.incref(blocks)
            child = Session(
                self.id_prefix + uuid.uuid4().hex, parent.model, parent.max_len, ttl_s, now, now
            )
            child.block_table = list(blocks)
            child.first_block = parent.first_block
            child.num_tokens = parent.num_tokens
            child.engine_state = parent.engine_state  # (immutable: shared)
            child.owner = parent.owner
            parent.last_used_s = now
            self._sessions[child.id] = child
            self.quota.add(child)
            return child

    def truncate(self, session_id: str, num_tokens: int, owner: str | None = None) -> Session:
        """Keeps the session's first num_tokens tokens (a rewind) and frees the blocks past
        them at once; a fork sharing them keeps its own. A kept partial last block that a
        fork shares is copied before the next append writes into it, as after a fork."""
        with self._lock:
            s = self._lookup(session_id, self._clock())
            self._check_owner(s, owner)
            n = num_tokens
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise InvalidSessionArgument(f"num_tokens must be an int >= 0, got {n!r}")
            if n > s.num_tokens:
                raise InvalidSessionArgument(
                    f"session {session_id!r} holds {s.num_tokens} tokens: it cannot be "
                    f"truncated to {n}"
                )
            if s.holds.busy():
                raise SessionBusy(
                    f"session {session_id!r} has a step in flight; truncate it once the step "
                    "is answered"
                )
            m = self._models[s.model]
            bs = m.storage.block_size
            shortest = shortest_truncate(s.first_block, m.window, bs)
            if 0 < n < shortest:
                raise InvalidSessionArgument(
                    f"session {session_id!r} no longer holds its tokens before position "
                    f"{s.first_block * bs} (the sliding window of {m.window} of model {s.model!r} "
                    f"freed them): truncated to {n}, its next token would see tokens that are "
                    f"gone; truncate it to 0 or to {shortest}..{s.num_tokens} tokens"
                )
            keep = max(0, _cdiv(n, bs) - s.first_block) if n else 0
            m.pool.decref(s.block_table[keep:])
            del s.block_table[keep:]
            s.num_tokens = n
            if n == 0:  # else the engine's state stays: it holds for any prefix of the K/V
                s.engine_state = None
                s.first_block = 0
            s.last_used_s = self._clock()
            return s

    def close(self, session_id: str, owner: str | None = None) -> None:
        """Frees the session's blocks at once (at its last unpin if a step is in flight); a
        spilled one's file goes. owner: the caller (owner_of's rule), None: unchecked."""
        with self._lock:
            ghost = self._spilled.get(session_id)
            if ghost is not None:
                if not owns(owner, ghost.owner):  # as for an id never made
                    raise SessionNotFound(session_id, "unknown", unknown_message(session_id))
                self._forget_spilled(session_id, "closed", f"session {session_id!r} was closed")
                return
            s = self._lookup(session_id, self._clock())
            self._check_owner(s, owner)
            self._drop(s, "closed", f"session {session_id!r} was closed")

    def expire(self, now: float | None = None) -> list[str]:
        """Drop unpinned sessions idle longer than their TTL, spilled ones too; their ids."""
        with self._lock:
            now = self._clock() if now is None else now
            gone = [s for s in self._sessions.values() if _is_expired(s, now)]
            for s in gone:
                self._drop(s, "expired", _expired_message(s, now))
            ghosts = [s for s in self._spilled.values() if _is_expired(s, now)]
            for s in ghosts:
                self._forget_spilled(s.id, "expired", _expired_message(s, now))
            return [s.id for s in gone + ghosts]

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
            s = self._lookup(session_id, self._clock())
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
                reason, message = self._gone.get(s.id, ("closed", f"session {s.id!r} was closed"))
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

    def made_stats(self, s: Session) -> SessionStats:
        """The stats of a session create() or fork() just returned, as made: without the
        lookup, whose TTL check would drop a session of a TTL shorter than the call took
        (the answer to its making says it exists; its next call finds it expired)."""
        with self._lock:
            return self._session_stats(s)

    def session_stats(self, session_id: str, owner: str | None = None) -> SessionStats:
        with self._lock:
            s = self._lookup(session_id, self._clock())
            self._check_owner(s, owner)
            return self._session_stats(s)

    def stats(self) -> dict[str, ModelCacheStats]:
        """Per model: tokens, blocks, bytes per session and in total, fragmentation."""
        with self._lock:
            return {name: self._model_stats(name, m) for name, m in self._models.items()}

    def _check_owner(self, s: Session, owner: str | None) -> None:
        """NOT_FOUND, exactly as for an id never made, for a caller not its owner."""
        if not owns(owner, s.owner):
            raise SessionNotFound(s.id, "unknown", unknown_message(s.id))

    # --- internals ---------------------------------------------------------------------

    def _model(self, model: str) -> ModelCache:
        m = self._models.get(model)
        if m is None:
            raise InvalidSessionArgument(
                f"model {model!r} has no KV cache; models with one: {sorted(self._models)}"
            )
        return m

    def _lookup(self, session_id: str, now: float) -> Session:
        s = self._sessions.get(session_id)
        if s is not None and _is_expired(s, now):
            self._drop(s, "expired", _expired_message(s, now))
            s = None
        if s is None and session_id in self._spilled:
            ghost = self._spilled[session_id]
            if not _is_expired(ghost, now):
                raise SessionSpilled(session_id, ghost.owner)  # the engine brings it back
            self._forget_spilled(session_id, "expired", _expired_message(ghost, now))
        if s is None:
            reason, message = self._gone.get(session_id, ("unknown", unknown_message(session_id)))
            raise SessionNotFound(session_id, reason, message)
        return s

    def _pending_owner(self, res: Reservation) -> Session:
        s = self._sessions.get(res.session_id) or self._zombies.get(res.session_id)
        if s is None or s.holds.pending is not res:
            raise ValueError(
                f"reservation of {res.num_tokens} token(s) at {res.start} is not session "
                f"{res.session_id!r}'s pending step (already committed or rolled back?)"
            )
        return s

    def _drop(self, s: Session, reason: str, message: str) -> None:
        del self._sessions[s.id]
        self.quota.remove(s)
        self._remember_gone(s.id, reason, message)
        self._free_when_let_go(s)
        if self.on_end is not None:  # last: the table is whole whatever the hook does
            try:
                self.on_end(reason)
            except Exception:
                log.exception("on_end(%r) failed; the session ended all the same", reason)

    def _remember_gone(self, session_id: str, reason: str, message: str) -> None:
        """Why a session is gone, told to its later calls (the most recent kept)."""
        self._gone[session_id] = (reason, message)
        while len(self._gone) > self._max_remembered:
            self._gone.popitem(last=False)

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

    def _session_stats(self, s: Session, m: ModelCache | None = None) -> SessionStats:
        storage = (self._models[s.model] if m is None else m).storage
        num_blocks = len(s.block_table)
        return SessionStats(
            s.id,
            s.model,
            s.num_tokens,
            num_blocks,
            num_blocks * storage.bytes_per_block,
            s.max_len,
            s.ttl_s,
            s.first_block * storage.block_size,
        )

    def _model_stats(self, name: str, m: ModelCache) -> ModelCacheStats:
        bs, bpb, pool = m.storage.block_size, m.storage.bytes_per_block, m.pool
        live = [s for s in self._sessions.values() if s.model == name]
        filled: dict[int, int] = {}  # block id -> tokens it holds (forks share a prefix)
        for s in live + [z for z in self._zombies.values() if z.model == name]:
            for i, b in enumerate(s.block_table, start=s.first_block):
                held = min(bs, max(0, s.num_tokens - i * bs))
                filled[b] = max(filled.get(b, 0), held)
        stored = sum(filled.values())
        slots = pool.num_used * bs
        return ModelCacheStats(
            model=name,
            num_sessions=len(live),
            num_tokens=sum(s.num_tokens for s in live),
            num_tokens_stored=stored,
            num_blocks=pool.num_blocks,
            num_blocks_used=pool.num_used,
            num_blocks_free=pool.num_free,
            block_size=bs,
            bytes_per_block=bpb,
            budget_bytes=m.storage.budget_bytes,
            bytes_used=pool.num_used * bpb,
            fragmentation=(slots - stored) / slots if slots else 0.0,
            num_blocks_out_of_window=m.num_blocks_out_of_window,
            sessions=tuple(self._session_stats(s) for s in live),
        )


_BUSY = (
    "session {session_id!r} already has a step in flight (sent on another call or stream); "
    "send a session's steps one at a time, each after the last one's reply"
)


def owns(caller: str | None, owner: str) -> bool:
    """Whether a caller may use a session of `owner`: a session made by an identified client
    (a certificate or a bearer token: IDENTIFIED) answers that client only; one made
    without an identity (a peer address), anyone holding its id. caller None: unchecked
    (the engine's own calls)."""
    return caller is None or not owner.startswith(IDENTIFIED) or caller == owner


def unknown_message(session_id: str) -> str:
    return (
        f"session {session_id!r} does not exist here (never created on this server, or gone "
        "too long ago to remember why)"
    )


def _no_engine_state(k: Any, v: Any) -> None:
    return None


def _past(s: Session, n: int) -> str:
    """The start of a refusal's message: a step of n tokens would overfill session s."""
    total = s.num_tokens + n
    return f"session {s.id!r} holds {s.num_tokens} tokens; appending {n} would make {total}, past"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check_ttl(ttl_s: float | None) -> float | None:
    if ttl_s is None:
        return None
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, int | float) or not ttl_s > 0:
        raise InvalidSessionArgument(f"ttl_s must be a number of seconds > 0, got {ttl_s!r}")
    return float(ttl_s)


def _is_expired(s: Session, now: float) -> bool:
    return s.ttl_s is not None and s.in_use == 0 and now - s.last_used_s > s.ttl_s


def _expired_message(s: Session, now: float) -> str:
    return (
        f"session {s.id!r} expired: idle {now - s.last_used_s:.1f} s, past its TTL of {s.ttl_s:g} s"
    )
