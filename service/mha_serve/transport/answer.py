"""How every gRPC door answers: a handler's result, or its error as a status (status.py),
counted once under the door's protocol before it is sent; a request that did not parse is
INVALID_ARGUMENT and a summary line (handlers.py). mha.v1 and the Open Inference Protocol
share this policy, so they cannot drift apart."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc

from mha_serve import metrics
from mha_serve.serving import EXPECTED
from mha_serve.transport.handlers import Malformed, MalformedLog
from mha_serve.transport.status import status_of

log = logging.getLogger(__name__)
T = TypeVar("T")


async def answer(
    method: str,
    model: str,
    context: grpc.aio.ServicerContext,
    handle: Callable[[], Awaitable[T]],
    *,
    protocol: str,
) -> T:
    """Runs a handler; expected errors become their status, anything else INTERNAL (logged).
    An error status is counted before it is sent: a client that has it finds it counted."""
    code, counted = grpc.StatusCode.OK, False
    try:
        return await handle()
    except EXPECTED as e:
        code = status_of(e)
        if over(context):  # its deadline passed: gRPC answers DEADLINE_EXCEEDED itself,
            raise asyncio.CancelledError from e  # and aborting a finished call logs an ERROR
        metrics.count_request(method, model, code.name, protocol)
        counted = True
        await context.abort(code, str(e))
    except asyncio.CancelledError:
        code = grpc.StatusCode.CANCELLED
        raise
    except Exception as e:
        if isinstance(e, grpc.aio.AbortError):
            raise
        code = grpc.StatusCode.INTERNAL
        log.exception("%s failed on model %s", method, model)
        metrics.count_request(method, model, code.name, protocol)
        counted = True
        await context.abort(code, f"internal error in {method}: {type(e).__name__}: {e}")
    finally:
        if not counted:
            metrics.count_request(method, model, code.name, protocol)


def note_malformed(
    method: str,
    request: Malformed,
    context: grpc.aio.ServicerContext,
    malformed_log: MalformedLog,
    *,
    protocol: str,
) -> None:
    """Counts and (summarised) logs a request whose bytes are no valid message."""
    metrics.count_request(method, "unknown", grpc.StatusCode.INVALID_ARGUMENT.name, protocol)
    malformed_log.note(method, context.peer(), request)


def parsed(method: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """A unary servicer method that first answers INVALID_ARGUMENT for a request whose bytes
    did not parse (the servicer has `malformed_log` and `PROTOCOL`)."""

    @functools.wraps(method)
    async def run(self: Any, request: Any, context: grpc.aio.ServicerContext) -> T:
        if isinstance(request, Malformed):
            note_malformed(
                method.__name__, request, context, self.malformed_log, protocol=self.PROTOCOL
            )
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return await method(self, request, context)

    return run


def over(context: grpc.aio.ServicerContext) -> bool:
    """Whether the call is over already: done() turns true only once a status was sent (grpcio
    1.85), so a passed deadline is read from the time remaining."""
    remaining = context.time_remaining()
    return context.done() or (remaining is not None and remaining <= 0)


def sync(fn: Callable[..., T], **kwargs: Any) -> Callable[[], Awaitable[T]]:
    """A quick synchronous handler (called with kwargs) as the coroutine function answer takes."""

    async def run() -> T:
        return fn(**kwargs)

    return run
