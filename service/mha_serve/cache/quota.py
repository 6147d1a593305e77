"""Per-client limits on the session table: live sessions and KV-cache bytes per owner.

An owner is a plain string the front door names (a certificate, a token's hash, a peer
address); "" is nobody's and never limited. A hostile client then fills at most its own
share of a cache that every client shares.
"""

from __future__ import annotations

from collections.abc import Callable

from .errors import ClientQuotaExceeded
from .types import Session


class OwnerQuota:
    """Sessions by owner, and the checks before one more session or one more block.
    Called under the SessionTable's lock. max_*: 0 is no limit."""

    def __init__(self, bytes_per_block: Callable[[str], int]) -> None:
        self.max_sessions = 0
        self.max_bytes = 0
        self._bytes_per_block = bytes_per_block  # model name -> bytes of one of its blocks
        self._sessions: dict[str, set[Session]] = {}

    def set_limits(self, *, max_sessions: int, max_bytes: int) -> None:
        if max_sessions < 0 or max_bytes < 0:
            raise ValueError(
                f"per-client limits must be 0 (none) or more, got sessions {max_sessions}, "
                f"bytes {max_bytes}"
            )
        self.max_sessions, self.max_bytes = max_sessions, max_bytes

    def bytes_held(self, owner: str) -> int:
        """KV bytes of the owner's sessions (a block shared by forks counts in each)."""
        return sum(
            s.num_blocks * self._bytes_per_block(s.model) for s in self._sessions.get(owner, ())
        )

    def num_sessions(self, owner: str) -> int:
        return len(self._sessions.get(owner, ()))

    def check_new_session(self, owner: str) -> None:
        if not owner or not self.max_sessions:
            return
        held = self.num_sessions(owner)
        if held >= self.max_sessions:
            raise ClientQuotaExceeded(
                f"client {owner} holds {held} live sessions, its limit "
                f"(max_sessions_per_client {self.max_sessions}); close one first"
            )

    def check_growth(self, s: Session, num_new_blocks: int) -> None:
        """Before a step of `s` allocates num_new_blocks more blocks."""
        if not s.owner or not self.max_bytes or num_new_blocks <= 0:
            return
        held = self.bytes_held(s.owner)
        more = num_new_blocks * self._bytes_per_block(s.model)
        if held + more > self.max_bytes:
            raise ClientQuotaExceeded(
                f"client {s.owner} holds {held} bytes of KV cache; this step needs {more} "
                f"more, past its limit (max_cache_bytes_per_client {self.max_bytes}); close "
                "or truncate one of its sessions first"
            )

    def add(self, s: Session) -> None:
        if s.owner:
            self._sessions.setdefault(s.owner, set()).add(s)

    def remove(self, s: Session) -> None:
        held = self._sessions.get(s.owner)
        if held is not None:
            held.discard(s)
            if not held:
                del self._sessions[s.owner]
