"""Session table: session id -> block table, over one BlockPool per model. Appends in
two phases (reserve, then commit or rollback), forks with copy-on-write, TTL expiry, LRU
eviction or spilling to disk (spill.py), and owners. Works with block ids; asks the KV
storage only to copy a block, and to export or load a session's K/V (a spill, a restore).
A step's claim, reservation and commit are in steps.py, the table's stats in reports.py."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from .block_pool import BlockPool
from .errors import InvalidSessionArgument, SessionBusy, SessionNotFound, SessionSpilled
from .moves import Moving
from .quota import OwnerQuota
from .reports import Reporting
from .room import RoomMaking
from .steps import Stepping
from .types import IDENTIFIED, BlockStorage, ModelCache, Session
from .window import shortest_truncate

if TYPE_CHECKING:  # (spill.py brings torch; the table needs only its objects)
    from .record import Expected
    from .spill import SpillTier

log = logging.getLogger(__name__)

DEFAULT_MAX_REMEMBERED = 4096  # gone session ids kept to say why they are gone


class SessionTable(RoomMaking, Moving, Stepping, Reporting):
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
        # id -> (reason, message, owner): the message only to whom the session answered (owns)
        self._gone: OrderedDict[str, tuple[str, str, str]] = OrderedDict()
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

    def link_sequence(self, session_id: str, sequence_id: int | str | None) -> None:
        """Names the client's sequence the session steps (None: none), kept with it through
        spills and restarts (Session.sequence_id). A spilled session's file keeps the name it
        was written with."""
        with self._lock:
            s = self._sessions.get(session_id) or self._spilled.get(session_id)
            if s is not None:
                s.sequence_id = sequence_id

    def sequence_links(self) -> list[tuple[str, str, str, int | str]]:
        """(session id, model, owner, sequence id) of every session, live or spilled, that
        steps a sequence: what a server that adopted them links again."""
        with self._lock:
            held = list(self._sessions.values()) + list(self._spilled.values())
            return [(s.id, s.model, s.owner, s.sequence_id) for s in held if s.sequence_id]

    def get(self, session_id: str, owner: str | None = None) -> Session:
        """The live session, or SessionNotFound saying why not (does not count as use).
        owner: the caller; a session made by another identified client is NOT_FOUND to it
        (owns), exactly as an id never made. None: unchecked (the engine's own calls)."""
        with self._lock:
            s = self._lookup(session_id, self._clock(), owner)
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
            parent = self._lookup(session_id, now, owner)
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
            s = self._lookup(session_id, self._clock(), owner)
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
            s = self._lookup(session_id, self._clock(), owner)
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

    def _lookup(self, session_id: str, now: float, owner: str | None = None) -> Session:
        """The live session; SessionNotFound saying why there is none, to a caller that
        owned it (owner: the caller, None: unchecked; others are told as for an id never
        made). A live one's owner is the caller's to check (_check_owner)."""
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
            reason, message, was_owner = self._gone.get(session_id, ("unknown", "", ""))
            if reason == "unknown" or not owns(owner, was_owner):  # nothing to tell
                reason, message = "unknown", unknown_message(session_id)
            raise SessionNotFound(session_id, reason, message)
        return s

    def _drop(self, s: Session, reason: str, message: str) -> None:
        del self._sessions[s.id]
        self.quota.remove(s)
        self._remember_gone(s.id, reason, message, s.owner)
        self._free_when_let_go(s)
        if self.on_end is not None:  # last: the table is whole whatever the hook does
            try:
                self.on_end(reason)
            except Exception:
                log.exception("on_end(%r) failed; the session ended all the same", reason)

    def _remember_gone(self, session_id: str, reason: str, message: str, owner: str = "") -> None:
        """Why a session is gone, told to its later calls by its owner's clients (the most
        recent kept)."""
        self._gone[session_id] = (reason, message, owner)
        while len(self._gone) > self._max_remembered:
            self._gone.popitem(last=False)


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
