"""The engine in this process behind its batch queues: the EngineClient a standalone server,
the engine process of frontend workers and a Ray Serve replica serve from.

One ModelLanes per model, the one-step-at-a-time claim of a session, deadlines and
cancellation (the call's Ticket), timing and the request metrics. No gRPC here, and no
torch of its own: the engine's errors and the batcher's pass through.

A session call tried again (room in a full KV cache, a spilled session brought back) is in
retries.py; the calls on sessions other than their steps (Triton's sequences, sessions,
moves) in session_calls.py; the Ticket in ticket.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from mha_serve import metrics
from mha_serve.batching import ModelLanes
from mha_serve.cache import CacheError, CacheExhausted, SessionSpilled
from mha_serve.engine import (
    AttendOutcome,
    AttendRequest,
    CacheInfo,
    Engine,
    HeadReport,
    HostedModel,
    ModelView,
    RequestError,
)
from mha_serve.engine.faults import isolate_failures, out_of_memory_is_exhausted
from mha_serve.engine.heads import analyze as analyze_heads
from mha_serve.engine.prepare import PLAIN_STEP_KEY
from mha_serve.engine.threads import ComputeThreads
from mha_serve.serving.finish import OFFLOAD_BYTES, Computed, finish, finish_here
from mha_serve.serving.protocol import Served
from mha_serve.serving.retries import Retrying
from mha_serve.serving.sequences import SequenceMap
from mha_serve.serving.session_calls import SessionCalls
from mha_serve.serving.ticket import Ticket

log = logging.getLogger(__name__)
T = TypeVar("T")

SESSION_SWEEP_S = 1.0  # how often idle sessions are checked against their TTL


class AsyncEngine(Retrying, SessionCalls):
    """The warm engine, its lanes and its session sweeper (EngineClient, in process)."""

    def __init__(
        self,
        engine: Engine,
        compute: ComputeThreads,
        *,
        session_sweep_s: float = SESSION_SWEEP_S,
        inline: bool = True,
    ) -> None:
        """inline: lone small requests run on the event loop's thread when their lane is
        idle (ServerConfig.inline_lone_requests)."""
        self.engine = engine
        self.threads = compute  # (restores run on its main thread)
        self.session_sweep_s = session_sweep_s
        self.lanes = {
            name: lanes_for(engine, hosted, compute, inline=inline)
            for name, hosted in engine.models.items()
        }
        self._views = {name: hosted.view() for name, hosted in engine.models.items()}
        # A plain decode step on the event loop's thread (_step_now): as the lanes run a lone
        # step inline (lanes_for), single-threaded, a device out-of-memory RESOURCE_EXHAUSTED.
        self._decode_now = compute.on_caller(out_of_memory_is_exhausted(engine.decode_now))
        # The models whose plain decode steps decode_now may take (the others': the lanes').
        self._steps_now = {m for m in self.lanes if inline and engine.decodes_now(m)}
        for name in engine.models:
            if engine.cache_info(name) is not None:
                metrics.watch_kv_cache(name, functools.partial(engine.cache_info, name))
        engine.on_session_end(metrics.count_session_end)
        if engine.spills:
            engine.on_session_spill(metrics.count_spilled)
            metrics.watch_spill("", engine.spill_info)
        self._sweeper: asyncio.Task | None = None
        # Triton's sequences (the Open Inference Protocol door) -> this engine's sessions,
        # those of sessions adopted from the spill directory (a restart) among them.
        self.sequences = SequenceMap()
        self.link_adopted_sequences()
        # Session calls answered so far, and the calls waiting for one (room in a full KV
        # cache may come with it): see _room_may_come.
        self._answered = 0
        self._room_waiters: list[asyncio.Future] = []
        self._room_turn = asyncio.Lock()
        # Sessions whose step was cancelled while its batch computed -> that batch's end:
        # their next step waits for it (the cancelled step's rollback) rather than finding
        # the session still stepping (SessionBusy) in the other lane.
        self._abandoned: dict[str, asyncio.Future] = {}

    @property
    def max_response_bytes(self) -> int:
        return self.engine.max_response_bytes

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

    # --- models and labels -------------------------------------------------------------

    def models(self) -> list[ModelView]:
        return list(self._views.values())

    def model(self, name: str) -> ModelView:
        return self.engine.get(name).view() if name not in self._views else self._views[name]

    def hosted(self, name: str) -> HostedModel:
        """The loaded model itself (its module): for what runs in this process only."""
        return self.engine.get(name)

    def model_label(self, name: str) -> str:
        """Metric label: the model name when hosted, so unknown names cannot grow the label set."""
        return name if name in self._views else "unknown"

    async def session_label(self, session_id: str) -> str:
        """The model label of a session's RPC: its model, or "unknown" for no live session."""
        name = ""
        if session_id:
            with contextlib.suppress(CacheError, RequestError):  # the RPC itself answers
                name = self.engine.session_model(session_id)
        return self.model_label(name)

    async def cache_info(self, model: str) -> CacheInfo | None:
        return self.engine.cache_info(model)

    # --- attention ---------------------------------------------------------------------

    async def attend(
        self,
        request: AttendRequest,
        encode: Callable[[AttendOutcome], T],
        *,
        received: float,
        deadline: float | None,
        caller: str | None = None,
    ) -> Served[T]:
        if request.session_id:  # a plain decode step that finds its lane idle: here, now
            computed = self._step_now(request, received, deadline, caller)
            if computed is not None:
                served = finish_here(computed, encode, received)
                return await finish(computed, encode, received) if served is None else served
        ticket = Ticket(received, deadline)
        if not request.session_id:
            computed = await self._compute(request, ticket)
        else:  # _session_call's first try written out: one coroutine less a step
            seen, started = self._answered, time.monotonic()
            try:
                computed = await self._compute(request, ticket, caller)
            except CacheExhausted as e:
                refused = e  # (retried outside the handler: its wait is not in its context)
            else:
                refused = None
            if refused is not None:
                computed = await self._room_retries(request, ticket, caller, refused, seen, started)
        # (finish's coroutine only for a large reply: a small one is encoded here)
        served = finish_here(computed, encode, received)
        return await finish(computed, encode, received) if served is None else served

    def compute(
        self,
        request: AttendRequest,
        *,
        received: float,
        deadline: float | None,
        caller: str | None = None,
    ) -> Awaitable[Computed]:
        """attend without the encoding and the request metrics: what a frontend worker asks
        of the engine process (serving/host.py), which then encodes and counts itself. (Not
        a coroutine of its own: one frame less a call.)"""
        ticket = Ticket(received, deadline)
        if not request.session_id:
            return self._compute(request, ticket)
        computed = self._step_now(request, received, deadline, caller)
        if computed is not None:
            done = asyncio.get_running_loop().create_future()
            done.set_result(computed)
            return done
        return self._session_call(request, ticket, caller)

    def _step_now(
        self, request: AttendRequest, received: float, deadline: float | None, caller: str | None
    ) -> Computed | None:
        """A session step as one call here and now, when it is a plain decode step (one
        token, no weights: Engine.decode_now) of a live session and its lane is idle, as the
        lane would run it inline (Batcher.alone_now): the same claim, outcome, errors and
        metrics as _compute's path, without its records and calls between (that path is
        for batches, queues and waits). None, nothing kept, for any other step (it may have
        claimed and released the session, or reserved and rolled back, as _compute's path
        then does again): _compute takes it. A claim refused (the session another's, or
        stepping) raises as _compute's would. Its timing: queue_ms from receipt to the lane's
        answer, compute_ms the rest (its validation too, which _compute's path counts in
        queue_ms: microseconds)."""
        if (
            not self._steps_now
            or request.need_weights
            or request.head_mask is not None
            or request.inputs.ndim != 3  # (prepare refuses it, with its reason)
            or request.inputs.shape[1] != 1
        ):
            return None  # (a prompt, or a step with weights: no claim made for nothing)
        session_id = request.session_id
        engine = self.engine
        try:
            model = request.model or engine.session_model(session_id)
        except (CacheError, RequestError):  # _compute answers why
            return None
        lanes = self.lanes.get(model)
        if lanes is None or model not in self._steps_now:
            return None
        if self._abandoned and session_id in self._abandoned:
            return None  # (its last step, cancelled, still computes: _compute waits for it)
        fast = lanes.fast
        now = fast.alone_now(PLAIN_STEP_KEY, deadline)
        if now is None:
            return None
        started = time.perf_counter()
        try:
            engine.claim(session_id, caller)
        except SessionSpilled:  # brought back by _compute's path
            return None
        ticket = Ticket(received, deadline, claimed=True)
        answered = True  # (an error raised is its answer)
        try:
            outcome = self._decode_now(request, model, ticket)
            answered = outcome is not None
        finally:
            engine.release(session_id)
            if answered:  # counted as the lane counts a batch of one run inline
                self._session_answered()
                info = fast.ran_alone(PLAIN_STEP_KEY, now, 1)
        if outcome is None:
            return None
        queue_ms = (started - received) * 1e3
        return Computed(request, model, outcome, queue_ms, info.compute_s * 1e3)

    async def _compute(
        self, request: AttendRequest, ticket: Ticket, caller: str | None = None
    ) -> Computed:
        """Prepares, queues and computes one call; a session step (ticket of a session call)
        holds its session's claim (Engine.claim) from before it is prepared to its answer."""
        session_id = request.session_id
        if session_id:
            claim = self.engine.claim
            try:  # a live session (most steps): claimed at once, without a restore's machinery
                claim(session_id, caller)
            except SessionSpilled:  # in the spill tier: brought back first
                _, restore_s = await self._live(
                    session_id, caller, lambda: claim(session_id, caller)
                )
                ticket.restore_s += restore_s
            ticket.claimed = True
        try:  # until answered
            if self._abandoned and session_id:
                await self._after_abandoned(session_id)
            # Validation scans the input (NaN/Inf): off the event loop when it is large
            # (offload's test written out: its coroutine would cost every small call a frame).
            inputs = request.inputs
            if inputs.nbytes < OFFLOAD_BYTES:
                prepared = self.engine.prepare(request, ticket)
            else:
                prepared = await asyncio.to_thread(self.engine.prepare, request, ticket)
            batch, seq_len, _ = inputs.shape
            model = prepared.hosted.spec.name  # a step's session's, when the request left it empty
            submitted = time.perf_counter()
            try:
                outcome, info = await self.lanes[model].submit(
                    prepared,
                    need_weights=request.need_weights,
                    sequences=batch,
                    length=seq_len,
                    key=prepared.key,
                    deadline=ticket.deadline,
                )
            except asyncio.CancelledError:  # the client is gone: a session step still running
                ticket.cancelled = True  # is then rolled back, not kept (Sessions._settle)
                if session_id:
                    self._abandon(session_id, self.lanes[model], request.need_weights)
                raise
        finally:
            if session_id:
                self.engine.release(session_id)
                self._session_answered()
        # Queue time includes decoding, validation and a restore before the request queued.
        queue_ms = (submitted - ticket.received + info.queue_s) * 1e3
        return Computed(
            request, model, outcome, queue_ms, info.compute_s * 1e3, ticket.restore_s * 1e3
        )

    def _abandon(self, session_id: str, lanes: ModelLanes, need_weights: bool) -> None:
        """A step of session_id cancelled: if its lane runs a batch (it may hold the step),
        the session's next step waits for that batch's end (_after_abandoned)."""
        end = lanes.running_end(need_weights=need_weights)
        if end is None or end.done():
            return
        self._abandoned[session_id] = end

        def forget(_: asyncio.Future) -> None:
            if self._abandoned.get(session_id) is end:
                del self._abandoned[session_id]

        end.add_done_callback(forget)

    async def _after_abandoned(self, session_id: str) -> None:
        """Waits (holding the session's claim) for the end of the batch that may still hold
        the session's cancelled last step: its rollback, then this step."""
        end = self._abandoned.get(session_id)
        if end is not None:
            await asyncio.shield(end)

    async def analyze_heads(self, request: AttendRequest, include_weights: bool) -> HeadReport:
        """2H + 1 forwards off the event loop, beside (not inside) the batched lanes, on the
        analysis thread: one at a time, the others queued there (on the default executor, a
        flood of them took every thread that large calls' parsing and encoding use, each a
        torch thread team of its own)."""
        run = functools.partial(
            analyze_heads, self.engine, request, include_weights=include_weights
        )
        return await asyncio.get_running_loop().run_in_executor(self.threads.analysis, run)


def lanes_for(
    engine: Engine, hosted: HostedModel, compute: ComputeThreads, *, inline: bool = True
) -> ModelLanes:
    """A model's batch queues, bound to the engine; its limits come from the model's spec.
    inline: lone small requests may run on the event loop's thread (False: never)."""
    spec = hosted.spec
    # A failed batch runs again call by call (engine/faults.py, docs/RELIABILITY.md).
    run_batch = isolate_failures(functools.partial(engine.run_batch, hosted))
    lanes = ModelLanes(
        spec.name,
        run_batch=run_batch,
        run_one=out_of_memory_is_exhausted(engine.run),
        policy=spec.batch_policy(),
        on_batch=functools.partial(metrics.batch_observer, spec.name),
        fast_executor=compute.main,
        weights_executor=compute.weights,
        # A lone small request on the event loop's thread: no crossing (batching/inline.py).
        inline=engine.runs_inline if inline else None,
        run_inline=compute.on_caller(run_batch),
    )
    for lane, batcher in (("fast", lanes.fast), ("weights", lanes.weights)):
        metrics.watch_queue(spec.name, lane, lambda b=batcher: b.queued_requests)
    return lanes
