"""The call's Ticket: what serving tracks about one call while it runs (deadline,
cancellation, claim, restore time), written by AsyncEngine, read by the engine."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Ticket:
    """What serving tracks about one call while it runs; the engine reads it (CallState),
    never writes it. Written on the event loop only."""

    received: float  # time.perf_counter() at receipt
    deadline: float | None  # time.monotonic() past which the caller no longer waits
    cancelled: bool = False  # the caller is gone: a step still computing is not kept
    claimed: bool = False  # the call holds its session's claim (Engine.claim)
    restore_s: float = 0.0  # bringing its session back from the spill tier first
