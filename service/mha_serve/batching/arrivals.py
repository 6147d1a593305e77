"""Whether a batch waits for company (ArrivalStats): what the batcher remembers of arrivals,
the gap between them and, per batch key, how often they found others of their key in the lane.
Pure: no asyncio, no clock of its own."""

from __future__ import annotations

from collections.abc import Hashable

# A batch waits for company only when at least about one arrival in ten of its key lately
# found the lane busy with that key (ArrivalStats): other clients are sending
# concurrently requests that could share its batch.
OVERLAP_TO_WAIT = 0.1
_MAX_TRACKED_KEYS = 64  # batch keys whose overlap is remembered (head masks can vary freely)


class ArrivalStats:
    """What the batcher remembers of arrivals to decide whether a batch waits for company:
    the smoothed gap between arrivals, and per batch key the smoothed share of its arrivals
    that found the lane busy with that key (such items queued, or a batch of that key being
    formed or running). A closed-loop client (a decode stream: each step waits for its
    answer) never does, however close together its requests come and whatever other
    traffic shares the lane: nobody can join its batch. Pure: times come from the caller."""

    def __init__(self) -> None:
        self.last_arrival: float | None = None
        self.gap_ewma: float | None = None  # seconds
        self.overlap: dict[Hashable, float] = {}

    def note(self, key: Hashable, now: float, busy: bool) -> None:
        """An arrival of `key` at `now`; busy: it found the lane busy with its key."""
        if self.last_arrival is not None:
            gap = now - self.last_arrival
            self.gap_ewma = gap if self.gap_ewma is None else 0.8 * self.gap_ewma + 0.2 * gap
        self.last_arrival = now
        share = 0.8 * self.overlap.pop(key, 0.0) + 0.2 * busy
        self.overlap[key] = share  # re-inserted: the dict runs from least to most recent
        if len(self.overlap) > _MAX_TRACKED_KEYS:
            del self.overlap[next(iter(self.overlap))]

    def keeps_company(self, key: Hashable) -> bool:
        """Whether requests of `key` lately came while others of it were in the lane."""
        return self.overlap.get(key, 0.0) >= OVERLAP_TO_WAIT

    def company_wait(self, key: Hashable, max_queue_delay_s: float) -> float:
        """How long a batch of `key` waits for company: the delay while requests arrive
        closer together than it and its key keeps company, else not at all."""
        close = self.gap_ewma is not None and self.gap_ewma < max_queue_delay_s
        return max_queue_delay_s if close and self.keeps_company(key) else 0.0
