"""Counting sessions' ends and the durable-session series (issue 24: the spill tier,
restarts, moves between Ray replicas): the label values checked, the per-model children
looked up once."""

from __future__ import annotations

import functools

from .definitions import (
    LOST_REASONS,
    RESTORE_LATENCY,
    SESSION_RESTORES,
    SESSIONS_ADOPTED,
    SESSIONS_ENDED,
    SESSIONS_LOST,
    SESSIONS_MOVED,
    SESSIONS_SPILLED,
    SPILL_REASONS,
    SPILLED_BYTES,
)


@functools.cache
def _ended(reason: str):
    return SESSIONS_ENDED.labels(reason)


def count_session_end(reason: str) -> None:
    """SessionTable.on_end: runs under the table's lock, so it only counts. A reason of
    LOST_REASONS (the spill tier's) is a session lost, counted so too."""
    if reason in LOST_REASONS:
        count_lost(reason)
        reason = "lost"
    _ended(reason).inc()


@functools.cache
def _durable(model: str) -> tuple:
    children = (
        SPILLED_BYTES.labels(model),
        SESSION_RESTORES.labels(model),
        RESTORE_LATENCY.labels(model),
        SESSIONS_ADOPTED.labels(model),
    )
    for reason in SPILL_REASONS:
        SESSIONS_SPILLED.labels(model, reason)
    return children


def count_spilled(model: str, nbytes: int, reason: str) -> None:
    """One session of `model` written to the spill directory, its file `nbytes` long;
    reason: "room" (moved out of a full KV cache) or "shutdown" (written after draining)."""
    if reason not in SPILL_REASONS:
        raise ValueError(f"spill reason {reason!r} is not one of {SPILL_REASONS}")
    SESSIONS_SPILLED.labels(model, reason).inc()
    _durable(model)[0].inc(nbytes)


def observe_restore(model: str, seconds: float) -> None:
    """One spilled session of `model` read back into the KV cache, in `seconds`."""
    _, restores, latency, _ = _durable(model)
    restores.inc()
    latency.observe(seconds)


def count_adopted(model: str, n: int) -> None:
    """`n` sessions of `model` taken over from the spill directory at start-up. Counted
    before the first scrape, it shows Prometheus no increase: the dashboard shows the value
    itself (what this process adopted when it started)."""
    if n:
        _durable(model)[3].inc(n)


def count_lost(reason: str, n: int = 1) -> None:
    """`n` sessions lost, reason one of LOST_REASONS: "spill_full" (the spill tier expired
    its oldest to make room), "replica_killed" (their Ray replica died without moving them),
    "move_failed" (their Ray replica stopped gracefully but could not move them: it told
    SequenceDirectory, which the replica answering NOT_FOUND asks), "bad_file" (a spill file
    refused at adoption or restore). MhaServeSessionsLost fires."""
    if reason not in LOST_REASONS:
        raise ValueError(f"lost reason {reason!r} is not one of {LOST_REASONS}")
    if n:
        SESSIONS_LOST.labels(reason).inc(n)


def count_moved(n: int = 1) -> None:
    """`n` sessions moved to this Ray replica from one Ray stopped (counted here, where they
    live on: the stopping replica exits before Prometheus would scrape its count)."""
    if n:
        SESSIONS_MOVED.inc(n)
