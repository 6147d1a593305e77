"""The one engine interface every front door calls (gRPC servicers of both protocols, the
frontend workers, the Ray replica): `EngineClient`, a typed Protocol with two
implementations, the engine in this process (async_engine.AsyncEngine) and the engine in
another (remote.RemoteEngine, a frontend worker's link). No torch here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from mha_serve.batching import Closed, DeadlineExceeded, QueueFull
from mha_serve.cache.errors import CacheError
from mha_serve.cache.types import SessionStats
from mha_serve.engine.errors import RequestError
from mha_serve.engine.requests import (
    AttendOutcome,
    AttendRequest,
    CacheInfo,
    HeadReport,
    ModelView,
)
from mha_serve.serving.sequences import SequenceKey

T = TypeVar("T")


class Unavailable(RequestError):
    """The server cannot take requests now (UNAVAILABLE): warming up or draining."""


# Errors a request can cause; anything else is a bug (INTERNAL, logged with its traceback):
# every door's status mapping (transport/status.py) and the engine process's link.
EXPECTED = (RequestError, CacheError, QueueFull, Closed, DeadlineExceeded)


@dataclass(slots=True)  # never written; not frozen: a frozen __init__ costs ~3x
class Timing:
    queue_ms: float  # receipt to start of compute: decoding, validation, waiting
    # the batch's forward (and weights, when asked); a decode step run at once in one call
    # (AsyncEngine._step_now) counts its validation here
    compute_ms: float
    total_ms: float  # receipt to encoded reply
    batch_size: int  # sequences computed in that forward
    restore_ms: float = 0.0  # its session brought back from the spill tier (in queue_ms too)


@dataclass(slots=True)  # never written; not frozen: a frozen __init__ costs ~3x
class Served(Generic[T]):
    """An Attend or session step, answered: the encoded reply, its timing, and the model
    that computed it (a step that left the model empty gets its session's)."""

    reply: T
    timing: Timing
    model: str


class EngineClient(Protocol):
    """What a front door calls; every method but the model lookups is a coroutine, so that
    a door awaits it alike in process and across the frontend workers' link."""

    @property
    def max_response_bytes(self) -> int: ...

    def start(self) -> None:
        """Starts background work (the session sweeper) on the running loop."""

    async def close(self) -> None:
        """Stops serving; calls still queued or waiting get UNAVAILABLE."""

    # --- models (no I/O: a frontend keeps their descriptions) -----------------------------

    def models(self) -> list[ModelView]: ...

    def model(self, name: str) -> ModelView:
        """The hosted model, or ModelNotFound naming those there are."""

    def model_label(self, name: str) -> str:
        """Metric label: the name when hosted, "unknown" otherwise (a bounded label set)."""

    async def session_label(self, session_id: str) -> str:
        """The model label of a session's call: its model, "unknown" for no live session."""

    async def cache_info(self, model: str) -> CacheInfo | None: ...

    # --- attention ------------------------------------------------------------------------

    async def attend(
        self,
        request: AttendRequest,
        encode: Callable[[AttendOutcome], T],
        *,
        received: float,
        deadline: float | None,
        caller: str | None = None,
    ) -> Served[T]:
        """Validates, queues and computes one Attend or session step, and encodes its
        outcome with `encode` (off the event loop when large). received:
        time.perf_counter() at receipt; deadline: time.monotonic() by which the caller
        stops waiting; caller: who asks (a session made by an identified client answers it
        alone). Cancelling the call withdraws it (a session step is rolled back)."""

    async def analyze_heads(self, request: AttendRequest, include_weights: bool) -> HeadReport: ...

    # --- sessions -------------------------------------------------------------------------

    async def create_session(
        self, model: str, max_len: int | None, ttl_s: float | None, owner: str = ""
    ) -> SessionStats: ...

    # caller: who asks (the client's identity, transport/auth.py); a session made by an
    # identified client is NOT_FOUND to another, as an id never made. None: unchecked. A
    # session in the spill tier comes back first, transparently.

    async def get_session(self, session_id: str, caller: str | None = None) -> SessionStats: ...

    async def fork_session(
        self, session_id: str, ttl_s: float | None, caller: str | None = None
    ) -> SessionStats: ...

    async def truncate_session(
        self, session_id: str, num_tokens: int, caller: str | None = None
    ) -> SessionStats: ...

    async def close_session(self, session_id: str, caller: str | None = None) -> None: ...

    # --- Triton's sequences (the Open Inference Protocol door) -----------------------------
    # Each change is one call: a caller cancelled between two round trips can never leave a
    # session made and not mapped, or unmapped and not closed.

    async def sequence_session(self, key: SequenceKey) -> str | None:
        """The session a sequence steps now, None when it is not active."""

    async def start_sequence(self, key: SequenceKey, model: str, owner: str) -> str:
        """A new session for the sequence; a live one of the same key is closed."""

    async def end_sequence(self, key: SequenceKey, session_id: str, *, close: bool) -> None:
        """Forgets the sequence's session, and closes it when `close`."""
