"""The two lanes of one model: batched fast path, and attention weights one request at a time.

Requests that ask for weights take the slower explicit path; giving them their own queue
and thread means they never hold up, or share a forward with, the requests that do not.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Hashable
from concurrent.futures import Executor
from typing import Any

from mha_serve.batching.batcher import Batcher, BatchInfo, BatchPolicy, RunBatch


class ModelLanes:
    def __init__(
        self,
        name: str,
        *,
        run_batch: RunBatch,
        run_one: Callable[[Any], Any],
        policy: BatchPolicy,
        on_batch: Callable[[str], Callable[[BatchInfo], None]] | None = None,
        fast_executor: Executor | None = None,
        weights_executor: Executor | None = None,
        inline: Callable[[Any], bool] | None = None,
        run_inline: RunBatch | None = None,
    ) -> None:
        """The executors run each lane's batches (None: a thread of the lane's own);
        on_batch(lane): the observer of that lane's batches ("fast" or "weights");
        inline/run_inline: the fast lane's lone small items on the caller's thread
        (Batcher)."""

        def observer(lane: str) -> Callable[[BatchInfo], None] | None:
            return None if on_batch is None else on_batch(lane)

        self.fast = Batcher(
            name,
            run_batch,
            policy,
            on_batch=observer("fast"),
            executor=fast_executor,
            inline=inline,
            run_inline=run_inline,
        )

        # max_batch_size 1: the first item of a batch is always taken, so one request per batch.
        def run_each(payloads: list[Any]) -> list[Any]:
            results = []
            for payload in payloads:  # one failure is that request's alone
                try:
                    results.append(run_one(payload))
                except Exception as e:
                    results.append(e)
            return results

        self.weights = Batcher(
            f"{name}/weights",
            run_each,
            dataclasses.replace(policy, max_batch_size=1, max_queue_delay_s=0.0),
            on_batch=observer("weights"),
            executor=weights_executor,
        )

    def running_end(self, *, need_weights: bool) -> asyncio.Future | None:
        """The end of the batch running in the lane a request goes to (Batcher.running_end)."""
        return (self.weights if need_weights else self.fast).running_end()

    def submit(
        self,
        payload: Any,
        *,
        need_weights: bool,
        sequences: int,
        length: int,
        key: Hashable,
        deadline: float | None,
    ) -> Awaitable[tuple[Any, BatchInfo]]:
        """The lane's Batcher.submit (not a coroutine of its own: one frame less a call)."""
        lane = self.weights if need_weights else self.fast
        return lane.submit(payload, sequences=sequences, length=length, key=key, deadline=deadline)

    async def close(self) -> None:
        await self.fast.close()
        await self.weights.close()
