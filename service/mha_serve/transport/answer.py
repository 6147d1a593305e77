"""How every gRPC door answers: a handler's result, or its error as a status (status.py),
counted once under the door's protocol before it is sent; a request that did not parse is
INVALID_ARGUMENT and a summary line (handlers.py). mha.v1 and the Open Inference Protocol
share this policy, so they cannot drift apart."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from mha_serve import metrics
from mha_serve.serving import EXPECTED
from mha_serve.transport import tracing
from mha_serve.transport.handlers import Malformed, MalformedLog
from mha_serve.transport.status import status_of

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Refused:
    """A call's error as its status: what a door answers instead of a response."""

    code: grpc.StatusCode
    details: str


async def settle(
    method: str,
    model: str,
    handle: Callable[..., Awaitable[T]],
    *args: Any,
    protocol: str,
    over: Callable[[], bool] = lambda: False,
    in_flight: bool = False,
    count: Callable[[str], None] | None = None,
    expired: Callable[[], bool] = lambda: False,
    context: Any = None,
) -> T | Refused:
    """Runs a handler, handle(*args): its result, or its error as Refused (expected errors
    their status, anything else INTERNAL, logged), counted once under the door's protocol
    before it is returned: a client that has it finds it counted. over(): the call is over
    already (its deadline passed; gRPC answers DEADLINE_EXCEEDED itself): an error is then
    counted and raised as CancelledError, not answered. in_flight: counted in IN_FLIGHT
    meanwhile (a computation, not a lookup). count(code): the request counter of method,
    model and protocol, bound once (metrics.request_counts: a stream's, for its every
    message); None: looked up here. expired(): the call's deadline has passed (see
    deadline_passed): a call cancelled then (gRPC cancels its handler at the deadline, while
    it computes) is counted DEADLINE_EXCEEDED, as its client is answered, not CANCELLED.
    context: the call's (what a door reads of it), whose metadata may name the trace its
    span belongs to, when tracing is on (tracing.py)."""
    code = "OK"  # (the status's name: an enum's .name costs two Python calls a request)
    details = None  # a refusal's, for the call's span
    spans = tracing.SPANS
    span = None if spans is None else spans.start(method, model, protocol, context)
    if in_flight:
        metrics.in_flight(1)
    try:
        return await handle(*args)
    except EXPECTED as e:
        status = status_of(e)
        code, details = status.name, str(e)
        if over():  # and answering a finished call logs an ERROR in grpcio
            raise asyncio.CancelledError from e
        return Refused(status, details)
    except asyncio.CancelledError:
        code = "DEADLINE_EXCEEDED" if expired() else "CANCELLED"
        details = "the call ended before its answer"
        raise
    except Exception as e:
        if isinstance(e, grpc.aio.AbortError):
            raise
        code = "INTERNAL"
        log.exception("%s failed on model %s", method, model)
        details = f"internal error in {method}: {type(e).__name__}: {e}"
        return Refused(grpc.StatusCode.INTERNAL, details)
    finally:
        if in_flight:
            metrics.in_flight(-1)
        if count is None:
            metrics.count_request(method, model, code, protocol)
        else:
            count(code)
        if span is not None:
            spans.end(span, grpc.StatusCode[code].value[0], code, details)


async def sent(context: grpc.aio.ServicerContext, result: T | Refused) -> T:
    """A door's result as gRPC sends it: a Refused aborts the call with its status."""
    if isinstance(result, Refused):
        await context.abort(result.code, result.details)
    return result  # type: ignore[return-value]


async def answer(
    method: str,
    model: str,
    context: grpc.aio.ServicerContext,
    handle: Callable[[], Awaitable[T]],
    *,
    protocol: str,
) -> T:
    """settle, sent as gRPC does: a Refused aborts the call with its status."""
    settled = await settle(
        method,
        model,
        handle,
        protocol=protocol,
        over=lambda: over(context),
        expired=lambda: deadline_passed(context),
        context=context,
    )
    return await sent(context, settled)


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


def over(context: grpc.aio.ServicerContext) -> bool:
    """Whether the call is over already: done() turns true only once a status was sent (grpcio
    1.85), so a passed deadline is read from the time remaining."""
    remaining = context.time_remaining()
    return context.done() or (remaining is not None and remaining <= 0)


def deadline_passed(context: Any) -> bool:
    """Whether the call's deadline has passed (a client that cancelled before it has time
    remaining). context: a grpc.aio.ServicerContext, or what a door reads of one."""
    remaining = context.time_remaining()
    return remaining is not None and remaining <= 0
