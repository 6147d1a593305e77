"""A computed call's last part, where its reply is sent: the encoding (off the event loop
when large) and the request metrics. Shared by both EngineClients: in process it follows
the compute; with frontend workers it runs in the frontend, after the engine's answer."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from mha_serve import metrics
from mha_serve.engine.requests import AttendOutcome, AttendRequest
from mha_serve.serving.protocol import Served, Timing

T = TypeVar("T")

# Payloads above this are validated and encoded on a worker thread so that the event loop
# keeps answering health checks and other calls (a 64 MiB reply takes ~0.5 s to encode).
OFFLOAD_BYTES = 1 << 20


async def offload(fn: Callable[..., T], *args: Any, nbytes: int) -> T:
    """fn(*args) here for small payloads, on a worker thread for large ones."""
    if nbytes < OFFLOAD_BYTES:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


@dataclass(slots=True)  # never written; not frozen: a frozen __init__ costs ~3x
class Computed:
    """A computed Attend or step, before its encoding: the request, the model that computed
    it (a step's session's, when the request left it empty), the engine's outcome, and
    serving's timing of it."""

    request: AttendRequest
    model: str
    outcome: AttendOutcome
    queue_ms: float
    compute_ms: float
    restore_ms: float = 0.0  # its session brought back from the spill tier first


def computed_reply(computed: Computed) -> tuple:
    """What the engine process sends back of a Computed: all but the request, which the
    frontend that asked holds (its inputs would cross the link twice); Computed(request,
    *reply) there."""
    return (
        computed.model,
        computed.outcome,
        computed.queue_ms,
        computed.compute_ms,
        computed.restore_ms,
    )


async def finish(
    computed: Computed, encode: Callable[[AttendOutcome], T], received: float
) -> Served[T]:
    """Encodes a computed call (off the loop when large) and counts it in the request
    metrics."""
    served = finish_here(computed, encode, received)
    if served is None:
        served = answered(computed, await asyncio.to_thread(encode, computed.outcome), received)
    return served


def finish_here(
    computed: Computed, encode: Callable[[AttendOutcome], T], received: float
) -> Served[T] | None:
    """finish without a coroutine of its own, for a small reply (most: a decode step's):
    encoded and counted here; None for a large one, which finish encodes off the loop."""
    outcome = computed.outcome
    weights = outcome.weights
    nbytes = outcome.output.nbytes
    if weights is not None:
        nbytes += weights.nbytes
    if nbytes >= OFFLOAD_BYTES:
        return None
    return answered(computed, encode(outcome), received)


def answered(computed: Computed, reply: T, received: float) -> Served[T]:
    """A computed call's encoded reply, counted in the request metrics, with its timing."""
    outcome, model, queue_ms = computed.outcome, computed.model, computed.queue_ms
    batch, seq_len, _ = computed.request.inputs.shape
    weights = outcome.weights
    total_s = time.perf_counter() - received
    metrics.attend_observer(model)(
        batch * seq_len, queue_ms / 1e3, total_s, 0 if weights is None else weights.nbytes
    )
    # batch_size: computed sequences (steps refused at reserve are not)
    timing = Timing(
        queue_ms, computed.compute_ms, total_s * 1e3, outcome.batch_size, computed.restore_ms
    )
    return Served(reply, timing, model)
