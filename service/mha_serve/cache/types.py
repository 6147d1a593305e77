"""The small dataclasses the cache hands to the engine: sessions, reservations, stats;
and the one thing the session table needs from a model's K/V storage."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

# Client identities that prove who a client is (transport/auth.py client_identity makes
# them: a certificate's name, a bearer token's hash): a session made by one answers it alone.
# A peer address proves nothing (NAT, a new connection): such sessions answer any holder of
# their id, as before owners existed.
IDENTIFIED = ("cert:", "token:")


class BlockStorage(Protocol):
    """What the table needs from a model's KV storage (KVCache satisfies it)."""

    num_blocks: int
    block_size: int
    bytes_per_block: int
    budget_bytes: int

    def copy_block(self, src: int, dst: int) -> None: ...

    def export(self, block_table: Sequence[int], num_tokens: int, first_block: int = 0) -> tuple:
        """A session's K and V as host copies (a spill)."""

    def load(
        self, block_ids: Sequence[int], first_block: int, first_position: int, k: Any, v: Any
    ) -> None:
        """Writes a spilled session's K and V into its new blocks (a restore)."""


@dataclass(slots=True)
class Reservation:
    """Room for one step's new tokens; hand back to commit() or rollback(). Never written
    once made (not frozen: a step makes one, see engine.requests.AttendOutcome)."""

    session_id: str
    model: str
    start: int  # tokens cached before this step: the step's past length
    num_tokens: int  # new tokens this step appends
    block_table: tuple[int, ...]  # the session's blocks, covering start + num_tokens
    slots: tuple[int, ...]  # (num_tokens,) block_id * block_size + offset per new token
    num_new_blocks: int  # blocks appended by this reservation; rollback frees them
    # block_table[0] is the session's logical block first_block: the blocks before it fell
    # wholly out of its sliding window and were freed (0 without a window).
    first_block: int = 0
    # The first position the step attends to (its first token's window; 0 without one):
    # read the session's K/V from here (KVCache.read's start).
    read_start: int = 0
    # Session.engine_state as the step found it: only the step's own commit changes it
    # while the step is pending (a truncate waits for it; one adopted is a new session).
    engine_state: object = None


@dataclass(slots=True)
class Holds:
    """Everything that holds a session, in one place: whether it is busy, idle, or freed
    when the last hold goes is read off this alone (SessionTable). A held session is never
    evicted, spilled, expired or moved."""

    pins: int = 0  # short holds: a batch keeping its sessions, a restore or a move under way
    claimed: bool = False  # a step of it was received and is not yet answered
    pending: Reservation | None = None  # a step reserved and not yet committed or rolled back
    # Dropped (closed, expired, evicted, moved out) while held: its blocks are freed when the
    # last hold goes, and until then a commit or release still finds it.
    dropped: bool = False

    @property
    def count(self) -> int:
        return self.pins + self.claimed + (self.pending is not None)

    def busy(self, *, claiming: bool = False) -> bool:
        """The one rule of one step at a time: a step received and not answered (claimed),
        or one reserved and not committed or rolled back (pending). A new step's claim
        (claiming) waits only for the first: a step whose caller left (cancelled, or past
        its deadline) released its claim and is rolled back once its batch ends, before the
        new step, queued behind it, reserves."""
        return self.claimed or (not claiming and self.pending is not None)


@dataclass(eq=False)
class Session:
    """One session's state. Owned by the SessionTable: read it, never write it."""

    id: str
    model: str
    max_len: int | None  # tokens this session may hold; None: only the cache bounds it
    ttl_s: float | None  # idle seconds before expiry; None: never expires
    created_s: float  # time.monotonic() (the table's clock)
    last_used_s: float
    # The blocks it holds, in order: block_table[i] is its logical block first_block + i,
    # holding positions (first_block + i) * block_size onwards.
    block_table: list[int] = field(default_factory=list)
    # Blocks before this one fell wholly out of the model's sliding window and were freed
    # (SessionTable._slide); 0 without a window.
    first_block: int = 0
    num_tokens: int = 0  # committed tokens: their K/V are written
    holds: Holds = field(default_factory=Holds)  # what keeps it busy or in place
    # What the engine keeps about the K/V the session holds (mha_serve.engine's KeyBound),
    # carried and never read here: immutable (a fork shares its parent's), valid for any
    # prefix of those K/V (a truncate keeps it), None while none are held. Set with the step
    # that adds K/V (commit), and by SessionTable.engine_state_of where a session's K/V
    # arrive whole (adopt, receive): recomputed from them, never read from a file.
    engine_state: object = None
    owner: str = ""  # the client whose per-client limits it counts against ("": none)
    # When it last came back from the spill tier (the table's clock): making room spares it
    # as if used then, so that the call that brought it back runs before it can be sent back;
    # its TTL runs on from last_used_s (a restore is not a use).
    restored_s: float = -math.inf
    # The client's sequence id it steps (a Triton sequence of the Open Inference Protocol,
    # serving/sequences.py), None for none: kept with it through spills and restarts, so
    # that the server that adopts it links the sequence to it again.
    sequence_id: int | str | None = None

    @property
    def spared_since(self) -> float:
        """When making room last had reason to spare it: its last use, or its restore."""
        return max(self.last_used_s, self.restored_s)

    @property
    def num_blocks(self) -> int:
        return len(self.block_table)

    @property
    def in_use(self) -> int:
        """Holds of any kind (0: idle)."""
        return self.holds.count

    @property
    def pending(self) -> Reservation | None:
        return self.holds.pending


@dataclass(slots=True)
class SessionStats:
    """A session as a call leaves it; never written once made (not frozen: every step
    makes one, see engine.requests.AttendOutcome)."""

    session_id: str
    model: str
    num_tokens: int
    num_blocks: int
    bytes_held: int  # num_blocks x bytes_per_block; a block shared by forks counts in each
    max_len: int | None = None  # as the session was created (Session.max_len)
    ttl_s: float | None = None
    # The first position whose K/V it still holds: a sliding window freed those before
    # (0 without one); it can be truncated to 0, or back to what its window still sees.
    first_position: int = 0


@dataclass(frozen=True)
class ModelCacheStats:
    model: str
    num_sessions: int
    num_tokens: int  # sum over sessions; a forked prefix counts once per session
    num_tokens_stored: int  # distinct slots holding K/V; a forked prefix counts once
    num_blocks: int
    num_blocks_used: int
    num_blocks_free: int
    block_size: int
    bytes_per_block: int
    budget_bytes: int
    bytes_used: int  # num_blocks_used x bytes_per_block
    fragmentation: float  # allocated slots not holding a token / allocated slots
    sessions: tuple[SessionStats, ...]
    # Blocks freed so far (since start) because they fell out of a session's sliding window.
    num_blocks_out_of_window: int = 0


@dataclass(frozen=True)
class SpillInfo:
    """The spill tier as metrics read it at every scrape (in memory, no disk read)."""

    num_sessions: int
    nbytes: int
    budget_bytes: int


@dataclass
class ModelCache:
    """One model's part of the session table: its storage, block pool and limits."""

    storage: BlockStorage
    pool: Any  # its BlockPool
    max_len: int | None
    window: int | None = None  # the model's sliding window: older blocks are freed
    num_blocks_out_of_window: int = 0  # blocks freed so far because no step could see them
