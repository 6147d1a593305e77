"""Errors the KV cache raises; plain exceptions whose messages carry the numbers.
The transport maps them to gRPC codes (suggested code on each class)."""

from __future__ import annotations


class CacheError(Exception):
    """Base class of every cache error."""


class SessionNotFound(CacheError):
    """Unknown, closed, expired or evicted session (NOT_FOUND). `reason` is one of
    "unknown", "closed", "expired", "evicted"; the message says which and why."""

    def __init__(self, session_id: str, reason: str, message: str) -> None:
        super().__init__(message)
        self.session_id = session_id
        self.reason = reason


class SessionSpilled(CacheError):
    """The session lives in the spill directory, not the cache: the engine brings it back
    (and asks again) before any call on it is answered; no client ever sees this one."""

    def __init__(self, session_id: str, owner: str) -> None:
        super().__init__(
            f"session {session_id!r} is in the spill directory; it is being brought back"
        )
        self.session_id = session_id
        self.owner = owner


class SessionExists(CacheError):
    """A session moved in under an id this server already holds (ALREADY_EXISTS)."""


class SpillFull(CacheError):
    """A session alone is larger than the whole spill budget: it cannot be spilled."""


class SessionFull(CacheError):
    """Appending would pass the session's or the model's max_len (OUT_OF_RANGE)."""


class CacheExhausted(CacheError):
    """Not enough free KV blocks, even after any allowed eviction (RESOURCE_EXHAUSTED).
    in_flight: other sessions of the model that held blocks and could not be spilled or
    evicted because a call held them (a step in flight or waiting for its batch): room may
    come when they are answered."""

    def __init__(
        self,
        message: str,
        *,
        num_needed: int,
        num_free: int,
        num_blocks: int,
        in_flight: int = 0,
    ) -> None:
        super().__init__(message)
        self.num_needed = num_needed
        self.num_free = num_free
        self.num_blocks = num_blocks
        self.in_flight = in_flight


class ClientQuotaExceeded(CacheError):
    """One client's sessions hold its limit of sessions or KV-cache bytes
    (RESOURCE_EXHAUSTED); the message names the limit."""


class SessionBusy(CacheError):
    """The session already has a step in flight; steps on one session run one at a
    time (ABORTED: the client may retry once the step is answered)."""


class InvalidSessionArgument(CacheError, ValueError):
    """A bad argument: max_len, ttl_s, a truncate's num_tokens, a model without a KV
    cache (INVALID_ARGUMENT)."""
