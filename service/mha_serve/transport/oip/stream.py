"""A stream's requests answered concurrently, replies sent in arrival order.

Triton's ModelStreamInfer lets a client send many requests before the first answer; computing
them one after another would keep them out of each other's batches. Here each request runs as
soon as it arrives (up to MAX_IN_FLIGHT per stream, then reading waits), except that requests
with the same key (one sequence) run one after another, as a session takes one step at a time.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable
from typing import Any, TypeVar

from mha_client.api.inference import grpc_service_pb2 as pb
from mha_serve.engine import RequestError
from mha_serve.transport.handlers import Malformed
from mha_serve.transport.oip.sequences import sequence_of

R = TypeVar("R")

MAX_IN_FLIGHT = 64  # requests of one stream computing or waiting to be sent


async def pipelined(
    requests: AsyncIterator[Any],
    answer: Callable[[Any], Awaitable[R]],
    key: Callable[[Any], Hashable | None],
    *,
    max_in_flight: int = MAX_IN_FLIGHT,
) -> AsyncIterator[R]:
    """answer(request) for each request, yielded in the requests' order. `answer` must not
    raise but to cancel; requests of one non-None key start only once the previous is done."""
    pending: asyncio.Queue[asyncio.Task | None] = asyncio.Queue()  # None: no more requests
    slots = asyncio.Semaphore(max_in_flight)
    running: set[asyncio.Task] = set()
    last: dict[Hashable, asyncio.Task] = {}  # the latest task of each key

    async def after(previous: asyncio.Task | None, request: Any) -> R:
        if previous is not None:
            await asyncio.wait([previous])  # its outcome is its own reply
        return await answer(request)

    def done(k: Hashable | None, task: asyncio.Task) -> None:
        running.discard(task)
        if k is not None and last.get(k) is task:
            del last[k]

    async def read() -> None:
        try:
            async for request in requests:
                await slots.acquire()  # released once its reply is sent
                k = key(request)
                task = asyncio.create_task(after(None if k is None else last.get(k), request))
                running.add(task)
                if k is not None:
                    last[k] = task
                task.add_done_callback(functools.partial(done, k))
                pending.put_nowait(task)
        finally:
            pending.put_nowait(None)

    reader = asyncio.create_task(read())
    try:
        while (task := await pending.get()) is not None:
            try:
                yield await task
            finally:
                slots.release()
        await reader  # the reader's error, if reading failed
    finally:
        reader.cancel()
        for task in list(running):
            task.cancel()
        await asyncio.wait([reader])  # its outcome was raised above, or is moot now


def sequence_key(request: pb.ModelInferRequest | Malformed) -> Hashable | None:
    """Requests of one sequence run one after another on a stream (None: no sequence)."""
    if isinstance(request, Malformed):
        return None
    try:
        sequence = sequence_of(request.parameters)
    except RequestError:  # answered by its own reply
        return None
    return None if sequence is None else (request.model_name, sequence.id)


def stream_error(request: pb.ModelInferRequest, message: str) -> pb.ModelStreamInferResponse:
    """A request's error on the stream, with its id and model so that a client can match it."""
    return pb.ModelStreamInferResponse(
        error_message=message,
        infer_response=pb.ModelInferResponse(model_name=request.model_name, id=request.id),
    )
