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


@dataclass(frozen=True, slots=True)
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


async def finish(
    computed: Computed, encode: Callable[[AttendOutcome], T], received: float
) -> Served[T]:
    """Encodes a computed call (off the loop when large) and counts it in the request
    metrics."""
    outcome, request = computed.outcome, computed.request
    batch, seq_len, _ = request.inputs.shape
    weights_bytes = 0 if outcome.weights is None else outcome.weights.nbytes
    # (offload's test written out: its coroutine would cost every small reply a frame)
    if outcome.output.nbytes + weights_bytes < OFFLOAD_BYTES:
        reply = encode(outcome)
    else:
        reply = await asyncio.to_thread(encode, outcome)
    total_s = time.perf_counter() - received
    metrics.observe_attend(
        computed.model,
        tokens=batch * seq_len,
        queue_s=computed.queue_ms / 1e3,
        total_s=total_s,
        weights_bytes=weights_bytes,
    )
    # batch_size: computed sequences (steps refused at reserve are not)
    timing = Timing(
        computed.queue_ms,
        computed.compute_ms,
        total_s * 1e3,
        outcome.batch_size,
        computed.restore_ms,
    )
    return Served(reply, timing, computed.model)
