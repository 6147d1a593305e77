"""The engine behind its batch queues: what a front door calls to serve one request.

Every protocol and host (the gRPC server, its Open Inference Protocol door, a Ray Serve
replica) converts its messages to engine calls and hands them here: one ModelLanes per
model, the one-step-at-a-time claim of a session, deadlines and cancellation, timing and
the request metrics. No gRPC and no torch here; errors are the engine's and the batcher's.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from mha_serve import metrics
from mha_serve.batching import Closed, DeadlineExceeded, ModelLanes, QueueFull
from mha_serve.cache import CacheError, SessionStats
from mha_serve.engine import AttendCall, AttendResult, Engine, HostedModel, RequestError
from mha_serve.engine.faults import isolate_failures, out_of_memory_is_exhausted
from mha_serve.engine.heads import analyze as analyze_heads
from mha_serve.engine.threads import ComputeThreads
from mha_serve.engine.types import CacheInfo
from mha_serve.serving.sequences import SequenceKey, SequenceMap

log = logging.getLogger(__name__)
T = TypeVar("T")

SESSION_SWEEP_S = 1.0  # how often idle sessions are checked against their TTL
# Payloads above this are validated and encoded on a worker thread so that the event loop
# keeps answering health checks and other calls (a 64 MiB reply takes ~0.5 s to encode).
OFFLOAD_BYTES = 1 << 20


# Errors a request can cause; anything else is a bug (INTERNAL, logged with its traceback):
# every door's status mapping (transport/status.py) and the engine process's link (remote.py).
EXPECTED = (RequestError, CacheError, QueueFull, Closed, DeadlineExceeded)


class Unavailable(RequestError):
    """The server cannot take requests now (UNAVAILABLE): warming up or draining."""


@dataclass(frozen=True)
class Timing:
    queue_ms: float  # receipt to start of compute: decoding, validation, waiting
    compute_ms: float  # the batch's forward (and weights, when asked)
    total_ms: float  # receipt to encoded reply
    batch_size: int  # sequences computed in that forward


async def offload(fn: Callable[..., T], *args: Any, nbytes: int) -> T:
    """fn(*args) here for small payloads, on a worker thread for large ones."""
    if nbytes < OFFLOAD_BYTES:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


class AsyncEngine:
    """The warm engine, its lanes and its session sweeper, shared by every front door."""

    def __init__(
        self,
        engine: Engine,
        compute: ComputeThreads,
        *,
        session_sweep_s: float = SESSION_SWEEP_S,
    ) -> None:
        self.engine = engine
        self.session_sweep_s = session_sweep_s
        self.lanes = {
            name: lanes_for(engine, hosted, compute) for name, hosted in engine.models.items()
        }
        for name in engine.models:
            if engine.cache_info(name) is not None:
                metrics.watch_kv_cache(name, functools.partial(engine.cache_info, name))
        engine.on_session_end(metrics.count_session_end)
        self._sweeper: asyncio.Task | None = None
        # Triton's sequences (the Open Inference Protocol door) -> this engine's sessions.
        self.sequences = SequenceMap()

    def start(self) -> None:
        """Starts the sweeper of idle sessions (on the running loop)."""
        if self._sweeper is None:
            self._sweeper = asyncio.create_task(self._expire_sessions(), name="session-expiry")

    async def close(self) -> None:
        """Stops the sweeper; queued requests get Closed (UNAVAILABLE)."""
        if self._sweeper is not None:
            self._sweeper.cancel()
        for lanes in self.lanes.values():
            await lanes.close()

    async def _expire_sessions(self) -> None:
        while True:
            await asyncio.sleep(self.session_sweep_s)
            expired = self.engine.expire_sessions()  # counted by the on_session_end hook
            if expired:
                log.info("expired %d idle session(s)", len(expired))

    def _alive(self, session_id: str) -> bool:
        try:
            self.engine.get_session(session_id)
        except (CacheError, RequestError):
            return False
        return True

    # --- labels ------------------------------------------------------------------------

    def model_label(self, name: str) -> str:
        """Metric label: the model name when hosted, so unknown names cannot grow the label set."""
        return name if name in self.engine.models else "unknown"

    async def session_label(self, session_id: str) -> str:
        """The model label of a session's RPC: its model, or "unknown" for no live session."""
        name = ""
        if session_id:
            with contextlib.suppress(CacheError, RequestError):  # the RPC itself answers
                name = self.engine.session_model(session_id)
        return self.model_label(name)

    # --- attention ---------------------------------------------------------------------

    async def attend(
        self,
        call: AttendCall,
        encode: Callable[[AttendResult], T],
        *,
        received: float,
        deadline: float | None,
    ) -> tuple[T, Timing]:
        """Validates, queues and computes one Attend or session step, then encodes its
        result with `encode` (off the loop when large). received: time.perf_counter() at
        receipt; deadline: time.monotonic() by which the caller stops waiting. A session
        step may leave call.model empty: it is set to its session's model."""
        computed = await self.compute(call, received=received, deadline=deadline)
        return await finish(call, computed, encode, received)

    async def compute(
        self, call: AttendCall, *, received: float, deadline: float | None
    ) -> Computed:
        """attend without the encoding and the request metrics: what a frontend worker asks
        of the engine process (serving/remote.py), which then encodes and counts itself."""
        if call.session_id and not call.model:  # a step may leave the model to its session
            call.model = self.engine.session_model(call.session_id)
        if not call.session_id:
            return await self._compute(call, received, deadline)
        with self.engine.stepping(call.session_id):  # until answered
            call.claimed = True
            return await self._compute(call, received, deadline)

    async def _compute(self, call: AttendCall, received: float, deadline: float | None) -> Computed:
        # Validation scans the input (NaN/Inf): off the event loop when it is large.
        hosted = await offload(self.engine.validate, call, nbytes=call.inputs.nbytes)
        batch, seq_len, _ = call.inputs.shape
        call.deadline = deadline
        submitted = time.perf_counter()
        try:
            result, info = await self.lanes[call.model].submit(
                call,
                need_weights=call.need_weights,
                sequences=batch,
                length=seq_len,
                key=self.engine.batch_key(hosted, call),
                deadline=deadline,
            )
        except asyncio.CancelledError:  # the client is gone: a session step still running
            call.cancelled = True  # is then rolled back, not kept (Sessions._settle)
            raise
        # Queue time includes decoding and validation before the request was queued.
        queue_ms = (submitted - received + info.queue_s) * 1e3
        return Computed(result, queue_ms, info.compute_s * 1e3)

    async def analyze_heads(self, call: AttendCall, include_weights: bool) -> tuple[Any, float]:
        """(HeadAnalysis, compute_ms): 2H + 1 forwards off the event loop, beside (not
        inside) the batched lanes."""
        return await asyncio.to_thread(
            analyze_heads, self.engine, call, include_weights=include_weights
        )

    # --- Triton's sequences (the Open Inference Protocol door) -----------------------------
    # Each change is one call with no await inside: a caller cancelled between two round
    # trips (a frontend worker's) can never leave a session made and not mapped, or unmapped
    # and not closed.

    async def sequence_session(self, key: SequenceKey) -> str | None:
        """The session a sequence steps now, None when it is not active."""
        return self.sequences.get(key)

    async def start_sequence(self, key: SequenceKey, model: str, owner: str) -> str:
        """A new session for the sequence; a live one of the same key is closed."""
        session_id = self.engine.create_session(model, None, None, owner).session_id
        previous = self.sequences.start(key, session_id, live=self._alive)
        if previous is not None:
            with contextlib.suppress(CacheError, RequestError):  # gone already: fine
                self.engine.close_session(previous)
        return session_id

    async def end_sequence(self, key: SequenceKey, session_id: str, close: bool) -> None:
        """Forgets the sequence's session, and closes it when `close`."""
        self.sequences.end(key, session_id)
        if close:
            with contextlib.suppress(CacheError, RequestError):
                self.engine.close_session(session_id)

    # --- sessions and models -----------------------------------------------------------
    # Coroutines, so that a front door awaits them alike here and in a frontend worker,
    # where they are a round trip to the engine process (serving/remote.py).

    async def create_session(
        self, model: str, max_len: int | None, ttl_s: float | None, owner: str = ""
    ) -> SessionStats:
        return self.engine.create_session(model, max_len, ttl_s, owner)

    async def get_session(self, session_id: str) -> SessionStats:
        return self.engine.get_session(session_id)

    async def fork_session(self, session_id: str, ttl_s: float | None) -> SessionStats:
        return self.engine.fork_session(session_id, ttl_s)

    async def truncate_session(self, session_id: str, num_tokens: int) -> SessionStats:
        return self.engine.truncate_session(session_id, num_tokens)

    async def close_session(self, session_id: str) -> None:
        self.engine.close_session(session_id)

    async def cache_info(self, model: str) -> CacheInfo | None:
        return self.engine.cache_info(model)

    @property
    def max_response_bytes(self) -> int:
        return self.engine.max_response_bytes

    def models(self) -> list[HostedModel]:
        return list(self.engine.models.values())

    def model(self, name: str) -> HostedModel:
        return self.engine.get(name)


@dataclass(frozen=True, slots=True)
class Computed:
    """A computed Attend or step, before its encoding (AsyncEngine.compute)."""

    result: AttendResult
    queue_ms: float
    compute_ms: float


async def finish(
    call: AttendCall, computed: Computed, encode: Callable[[AttendResult], T], received: float
) -> tuple[T, Timing]:
    """Encodes a computed call (off the loop when large) and counts it in the request
    metrics: the part of attend that runs where the reply is sent."""
    result = computed.result
    batch, seq_len, _ = call.inputs.shape
    weights_bytes = 0 if result.weights is None else result.weights.nbytes
    reply = await offload(encode, result, nbytes=result.output.nbytes + weights_bytes)
    total_s = time.perf_counter() - received
    metrics.observe_attend(
        call.model,
        tokens=batch * seq_len,
        queue_s=computed.queue_ms / 1e3,
        total_s=total_s,
        weights_bytes=weights_bytes,
    )
    # batch_size: computed sequences (steps refused at reserve are not)
    timing = Timing(computed.queue_ms, computed.compute_ms, total_s * 1e3, result.batch_size)
    return reply, timing


def lanes_for(engine: Engine, hosted: HostedModel, compute: ComputeThreads) -> ModelLanes:
    """A model's batch queues, bound to the engine; its limits come from the model's spec."""
    spec = hosted.spec
    lanes = ModelLanes(
        spec.name,
        # A failed batch runs again call by call (engine/faults.py, docs/RELIABILITY.md).
        run_batch=isolate_failures(functools.partial(engine.run_batch, hosted)),
        run_one=out_of_memory_is_exhausted(functools.partial(engine.run, hosted)),
        policy=spec.batch_policy(),
        on_batch=functools.partial(metrics.observe_batch, spec.name),
        fast_executor=compute.main,
        weights_executor=compute.weights,
    )
    for lane, batcher in (("fast", lanes.fast), ("weights", lanes.weights)):
        metrics.watch_queue(spec.name, lane, lambda b=batcher: b.queued_requests)
    return lanes
