"""Batcher's inline path: a lone small item run on the event loop's thread.

A lone small item pays no thread crossing: when the lane is idle (nothing queued, forming
or running), waiting for company would not pay, and the event loop itself is idle (at most
LOOP_READY_MAX other callbacks ready: more mean other calls in progress, which could join a
batch and which the loop must keep serving while the lane's thread computes), an item that
`inline(payload)` calls small runs as a batch of one on the caller's thread, the event
loop's (`run_inline`). Calls that come together queue and batch as before.

Part of Batcher (batcher.py), kept in a file of its own.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Hashable
from typing import Any

from mha_serve.batching.items import IDLE, BatchInfo, DeadlineExceeded

log = logging.getLogger(__name__)

# An item runs inline only while the event loop has at most this many other callbacks ready.
# Measured here (2 cores): one decode stream saw 0 or 1 at 99% of its steps; 32 clients
# sending 16-token requests saw 2 or more at 96% of theirs (other calls' reads and writes).
LOOP_READY_MAX = 1
# The ready queue of a loop without one (another implementation): busy, so items cross.
_BUSY = range(LOOP_READY_MAX + 1)


class RunningInline:
    """Batcher's inline path (mixed into it; its state is Batcher's: name, policy, arrivals,
    _clock, _closed, the queue, the keys forming and running, _inline, _run_inline, _on_batch,
    num_inline)."""

    def _idle_for(self, key: Hashable) -> bool:
        """Whether an item of `key` would start alone at once, so may run inline: the lane
        is idle (nothing queued, forming or running, and no reason to wait for company), the
        loop too (at most LOOP_READY_MAX other callbacks ready in asyncio's queue), and the
        lane runs items inline at all. (Whether the item is small enough is its own test.)"""
        return (
            self._inline is not None
            and not self._pending
            and self._forming_key is IDLE
            and self._running_key is IDLE
            and self.arrivals.company_wait(key, self.policy.max_queue_delay_s) == 0.0
            and len(getattr(asyncio.get_running_loop(), "_ready", _BUSY)) <= LOOP_READY_MAX
        )

    def alone_now(self, key: Hashable, deadline: float | None) -> float | None:
        """For a caller that runs a lone small item of `key` itself, in one call with its
        preparation (serving's plain decode step, Engine.decode_now): the clock's time now
        when the item may run here and now as submit would run it inline; None when it must
        be submitted instead (the lane busy or closed, inline off, or its deadline passed:
        submit refuses it). Then ran_alone(key, now, ...) counts it as submit would have."""
        if self._closed or not self._idle_for(key):
            return None
        now = self._clock()
        if deadline is not None and now >= deadline:
            return None
        return now

    def ran_alone(self, key: Hashable, now: float, sequences: int) -> BatchInfo:
        """An item a caller ran itself after alone_now gave it `now`: counted as a batch of
        one run inline (its arrival, num_inline, the batch observer); its BatchInfo."""
        self.arrivals.note(key, now, False)
        return self._ran_inline(BatchInfo(0.0, self._clock() - now, sequences, 1))

    def _ran_inline(self, info: BatchInfo) -> BatchInfo:
        self.num_inline += 1
        if self._on_batch is not None:
            try:
                self._on_batch(info)
            except Exception:
                log.exception("%s: delivering a batch's results failed", self.name)
        return info

    def _run_alone(
        self, payload: Any, sequences: int, key: Hashable, deadline: float | None, now: float
    ) -> tuple[Any, BatchInfo]:
        """One item as a batch of one, here and now (the lane is idle): no thread crossing.
        The same outcome, errors and metrics as through the lane's thread."""
        self.arrivals.note(key, now, False)
        if deadline is not None and now >= deadline:
            raise DeadlineExceeded(
                f"{self.name}: the deadline passed before compute started; raise the client "
                "timeout or reduce load"
            )
        try:
            outcome = self._run_inline([payload])
            if len(outcome) != 1:
                raise RuntimeError(f"run_batch returned {len(outcome)} results for 1 item")
        except Exception as e:  # the whole batch failed, as _finish reports it
            log.error("%s: batch of 1 requests failed", self.name, exc_info=e)
            raise
        info = self._ran_inline(BatchInfo(0.0, self._clock() - now, sequences, 1))
        (result,) = outcome
        if isinstance(result, BaseException):
            raise result
        return result, info
