"""asyncio queue -> batches: size and delay limits, deadlines, cancellation, backpressure.

Knows nothing of torch or gRPC: items are opaque payloads with a cost in tokens, and a
synchronous `run_batch(payloads) -> results` runs each batch on the batcher's executor (a
thread of its own unless one is given; the server shares one between lanes).

A lone small item runs on the caller's thread instead (inline.py); whether a batch waits for
company is ArrivalStats' to say (arrivals.py); the items, BatchInfo and errors are in items.py.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable, Hashable
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any

from mha_serve.batching.arrivals import ArrivalStats
from mha_serve.batching.inline import RunningInline
from mha_serve.batching.items import (
    IDLE,
    BatchInfo,
    Closed,
    DeadlineExceeded,
    Idle,
    Item,
    Observer,
    QueueFull,
    RunBatch,
)
from mha_serve.spec import BatchPolicy

log = logging.getLogger(__name__)

# Batches on the batchers' threads now, in this process (computing()).
_computing = 0


def computing() -> int:
    """How many batches this process's batchers have on their threads now. An event loop
    that busy-polls (transport/busy_poll.py) sleeps instead while one does: it would spin
    a core (and take the interpreter lock) that its own compute thread needs."""
    return _computing


class Batcher(RunningInline):
    """One lane: a bounded queue and one compute thread. `submit` returns (result, BatchInfo).

    A result that is an Exception instance is raised to that item's caller only.
    """

    def __init__(
        self,
        name: str,
        run_batch: RunBatch,
        policy: BatchPolicy,
        *,
        on_batch: Observer | None = None,
        executor: Executor | None = None,
        clock: Callable[[], float] = time.monotonic,
        inline: Callable[[Any], bool] | None = None,
        run_inline: RunBatch | None = None,
    ) -> None:
        """clock: seconds, for deadlines, queue times and the wait for company (tests give
        a fake one: a frozen clock never ends a wait for company). inline(payload): whether
        a lone item may run on the event loop's thread when the lane is idle, by
        run_inline([payload]) (run_batch made fit for that thread); None: never."""
        self.name = name
        self.policy = policy
        self._clock = clock
        self._run_batch = run_batch
        self._on_batch = on_batch
        self._pending: collections.deque[Item] = collections.deque()
        self._queued_tokens = 0
        self._wakeup = asyncio.Event()
        self._own_executor = executor is None  # shut down on close only when it is ours
        self._executor = executor or ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"batch-{name}"
        )
        self._task: asyncio.Task | None = None
        self._closed = False
        # Smoothed gap between arrivals: waiting for company only pays when others come soon.
        self.arrivals = ArrivalStats()  # decides whether a batch waits for company
        self._forming_key: Hashable | Idle = IDLE
        self._running_key: Hashable | Idle = IDLE
        self._running_end: asyncio.Future | None = None  # done when the running batch ends
        self._inline = inline if run_inline is not None else None
        self._run_inline = run_inline
        self.num_inline = 0  # items run on the caller's thread (a lone small item, idle lane)

    def running_end(self) -> asyncio.Future | None:
        """The running batch's end (done once its callers have their results), or None
        when none runs. A caller cancelled while its item computes learns here when that
        work is over (its result dropped), which a cancelled submit does not wait for."""
        return self._running_end

    @property
    def queued_requests(self) -> int:
        return len(self._pending)

    @property
    def queued_tokens(self) -> int:
        return self._queued_tokens

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._loop(), name=f"batcher-{self.name}"
            )

    async def submit(
        self,
        payload: Any,
        *,
        sequences: int,
        length: int,
        key: Hashable = None,
        deadline: float | None = None,
    ) -> tuple[Any, BatchInfo]:
        """Queues one item and waits for its result; cancelling the wait withdraws the item.

        Items of equal (hashable) `key` may share a batch."""
        if self._closed:
            raise Closed(f"{self.name}: the server is shutting down; retry on another replica")
        p = self.policy
        tokens = sequences * length
        if len(self._pending) >= p.max_queue_requests:
            raise QueueFull(
                f"{self.name}: {len(self._pending)} requests are queued (limit {p.max_queue_requests}); "
                "retry with backoff or add replicas"
            )
        if self._queued_tokens + tokens > p.max_queue_tokens:
            raise QueueFull(
                f"{self.name}: {self._queued_tokens} tokens are queued and this request adds {tokens} "
                f"(limit {p.max_queue_tokens}); retry with backoff or send smaller requests"
            )
        now = self._clock()
        if self._idle_for(key) and self._inline(payload):  # (small: inline)
            return self._run_alone(payload, sequences, key, deadline, now)
        future = asyncio.get_running_loop().create_future()
        item = Item(payload, sequences, length, key, deadline, future, now)
        self.arrivals.note(key, item.enqueued, self._busy_with(key))
        self._pending.append(item)
        self._queued_tokens += tokens
        self._wakeup.set()
        self.start()
        try:
            return await future
        except asyncio.CancelledError:
            self._withdraw(item)
            raise

    def _busy_with(self, key: Hashable) -> bool:
        """Whether the lane holds requests of `key`: queued, or a batch forming or running."""
        return (
            key == self._forming_key
            or key == self._running_key
            or any(item.key == key for item in self._pending)
        )

    def _withdraw(self, item: Item) -> None:
        """A cancelled caller leaves the queue (if its batch has not started)."""
        try:
            self._pending.remove(item)
        except ValueError:
            return  # already taken into a batch; its result will be dropped
        self._queued_tokens -= item.tokens

    async def _loop(self) -> None:
        """Runs batches until closed; a bug in one round must not stop the lane for good."""
        while not self._closed:
            try:
                await self._round()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("%s: batcher round failed; the lane keeps serving", self.name)

    async def _round(self) -> None:
        """Forms one batch, runs it on the lane's thread, hands each caller its result."""
        loop = asyncio.get_running_loop()
        if not self._pending:
            self._wakeup.clear()
            await self._wakeup.wait()
            return
        try:
            batch = await self._form_batch()
        finally:
            self._forming_key = IDLE
        if not batch:
            return
        payloads = [item.payload for item in batch]
        done = loop.create_future()

        def run() -> None:  # on the executor's thread; hands the outcome to the loop once
            started = self._clock()  # not at submit: the thread may be busy with others
            try:
                outcome: list[Any] | BaseException = list(self._run_batch(payloads))
                if len(outcome) != len(batch):
                    raise RuntimeError(
                        f"run_batch returned {len(outcome)} results for {len(batch)} items"
                    )
            except BaseException as e:  # the whole batch failed: every caller hears why
                outcome = e
            loop.call_soon_threadsafe(
                self._finish, batch, outcome, started, self._clock() - started, done
            )

        global _computing
        self._running_key = batch[0].key
        self._running_end = done
        _computing += 1
        try:
            try:
                self._executor.submit(run)
            except RuntimeError as e:  # the executor was shut down
                self._finish(batch, e, self._clock(), 0.0, done)
            await done
        finally:
            _computing -= 1
            self._running_end = None

    def _finish(
        self,
        batch: list[Item],
        outcome: list[Any] | BaseException,
        started: float,
        compute_s: float,
        done: asyncio.Future,
    ) -> None:
        """On the loop: each caller gets its result at once (no extra hop through _round)."""
        self._running_key = IDLE
        if isinstance(outcome, BaseException):
            log.error(
                "%s: batch of %d requests failed",
                self.name,
                len(batch),
                exc_info=(type(outcome), outcome, outcome.__traceback__),
            )
            outcome = [outcome] * len(batch)
        sequences = sum(item.sequences for item in batch)
        try:
            for item, result in zip(batch, outcome, strict=True):
                if item.future.done():
                    continue  # cancelled while computing
                info = BatchInfo(started - item.enqueued, compute_s, sequences, len(batch))
                if isinstance(result, BaseException):
                    item.future.set_exception(result)
                else:
                    item.future.set_result((result, info))
            if self._on_batch is not None:  # queue_s of a batch: its oldest item's wait
                info = BatchInfo(started - batch[0].enqueued, compute_s, sequences, len(batch))
                self._on_batch(info)
        except Exception:
            log.exception("%s: delivering a batch's results failed", self.name)
        finally:
            if not done.done():
                done.set_result(None)

    async def _form_batch(self) -> list[Item]:
        """The oldest item plus compatible ones, waiting up to max_queue_delay for more.

        The wait applies only while requests arrive closer together than the delay and
        some of the first item's key lately found others of that key queued, forming or
        running: a lone client (one request at a time, however fast, whatever other keys
        share the lane) would wait for nobody, so its requests go at once. Nor is it held
        up by another key's wait: a batch stops waiting as soon as such a request queues.
        """
        p = self.policy
        first = self._take_first()
        if first is None:
            return []
        self._forming_key = first.key  # an arrival of this key now is company: it may join
        batch, sequences, longest = [first], first.sequences, first.length
        real = first.tokens
        flush_at = self._clock() + self.arrivals.company_wait(first.key, p.max_queue_delay_s)
        while True:
            lone_waits = False  # a request of another key that will never get company
            for item in list(self._pending):
                if item.key != first.key:
                    lone_waits = lone_waits or not self.arrivals.keeps_company(item.key)
                    continue
                if self._expired(item):
                    continue
                if not p.admits(sequences, real, longest, item):
                    continue
                self._pending.remove(item)
                self._queued_tokens -= item.tokens
                batch.append(item)
                sequences, longest = sequences + item.sequences, max(longest, item.length)
                real += item.tokens
            remaining = flush_at - self._clock()
            if sequences >= p.max_batch_size or remaining <= 0 or lone_waits:
                break
            self._wakeup.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), remaining)
        return [item for item in batch if not item.future.done()]

    def _take_first(self) -> Item | None:
        while self._pending:
            item = self._pending.popleft()
            self._queued_tokens -= item.tokens
            if not item.future.done() and not self._expired(item):
                return item
        return None

    def _expired(self, item: Item) -> bool:
        """Drops an item whose deadline has passed; its caller gets DeadlineExceeded."""
        if item.deadline is None or self._clock() < item.deadline:
            return False
        if item in self._pending:
            self._pending.remove(item)
            self._queued_tokens -= item.tokens
        if not item.future.done():
            waited = self._clock() - item.enqueued
            item.future.set_exception(
                DeadlineExceeded(
                    f"{self.name}: the deadline passed after {waited * 1e3:.0f} ms in the queue, "
                    "before compute started; raise the client timeout or reduce load"
                )
            )
        return True

    async def close(self) -> None:
        """Stops taking items; the batch being formed or computed finishes, the rest fail.

        The server drains its RPCs (the grace period) before closing, so normally the
        queue is already empty here.
        """
        self._closed = True
        self._wakeup.set()
        if self._task is not None:
            await self._task
        for item in self._pending:
            if not item.future.done():
                item.future.set_exception(
                    Closed(f"{self.name}: the server is shutting down; retry on another replica")
                )
        self._pending.clear()
        self._queued_tokens = 0
        if self._own_executor:
            self._executor.shutdown(wait=True)
