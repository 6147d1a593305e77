"""What a lane queues and hands back (batcher.py): its items, the BatchInfo of the batch that
computed one, the errors its callers get, and the types of its callbacks."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any


class QueueFull(Exception):
    """The queue is at its bound; the caller should answer RESOURCE_EXHAUSTED at once."""


class DeadlineExceeded(Exception):
    """The request's deadline passed before its batch started; it was never computed."""


class Closed(Exception):
    """The batcher is closed (the server is shutting down): answer UNAVAILABLE."""


@dataclass(eq=False)  # identity: the queue removes items by identity, never compares payloads
class Item:
    payload: Any
    sequences: int  # rows this item adds to a batch
    length: int  # its padded length: a batch costs sequences x longest length
    key: Hashable  # only items with equal keys share a batch
    deadline: float | None  # the batcher's clock (time.monotonic()) after which it is dropped
    future: asyncio.Future
    enqueued: float  # the batcher's clock at submit

    @property
    def tokens(self) -> int:
        return self.sequences * self.length


@dataclass(slots=True)  # (never written; not frozen: a frozen __init__ costs ~3x, every call)
class BatchInfo:
    """What a result's caller learns about the batch that computed it."""

    queue_s: float  # enqueue -> batch start
    compute_s: float  # the batch's run_batch call
    batch_size: int  # sequences in the batch
    num_requests: int


class Idle:
    """No batch (neither being formed nor running); never equal to a key, None included."""


IDLE = Idle()
RunBatch = Callable[[list[Any]], Sequence[Any]]
Observer = Callable[[BatchInfo], None]
