"""The engine in this process behind its batch queues: the EngineClient a standalone server,
the engine process of frontend workers and a Ray Serve replica serve from.

One ModelLanes per model, the one-step-at-a-time claim of a session, deadlines and
cancellation (the call's Ticket), timing and the request metrics. No gRPC here, and no
torch of its own: the engine's errors and the batcher's pass through.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from mha_serve import metrics
from mha_serve.batching import ModelLanes
from mha_serve.cache import CacheError, CacheExhausted, SessionSpilled, SessionStats
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
from mha_serve.engine.session_api import RESTORE_TRIES
from mha_serve.engine.threads import ComputeThreads
from mha_serve.serving.finish import OFFLOAD_BYTES, Computed, finish, finish_here
from mha_serve.serving.protocol import Served
from mha_serve.serving.sequences import SequenceKey, SequenceMap

log = logging.getLogger(__name__)
T = TypeVar("T")

SESSION_SWEEP_S = 1.0  # how often idle sessions are checked against their TTL
# A session call refused for KV-cache room that other calls in flight hold waits for them at
# most this long (or to its deadline), then answers RESOURCE_EXHAUSTED.
ROOM_WAIT_S = 30.0


@dataclass(slots=True)
class Ticket:
    """What serving tracks about one call while it runs; the engine reads it (CallState),
    never writes it. Written on the event loop only."""

    received: float  # time.perf_counter() at receipt
    deadline: float | None  # time.monotonic() past which the caller no longer waits
    cancelled: bool = False  # the caller is gone: a step still computing is not kept
    claimed: bool = False  # the call holds its session's claim (Engine.claim)
    restore_s: float = 0.0  # bringing its session back from the spill tier first


class AsyncEngine:
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
        for name in engine.models:
            if engine.cache_info(name) is not None:
                metrics.watch_kv_cache(name, functools.partial(engine.cache_info, name))
        engine.on_session_end(metrics.count_session_end)
        if engine.spills:
            engine.on_session_spill(metrics.count_spilled)
            metrics.watch_spill("", engine.spill_info)
        self._sweeper: asyncio.Task | None = None
        # Triton's sequences (the Open Inference Protocol door) -> this engine's sessions.
        self.sequences = SequenceMap()
        # Session calls answered so far, and the calls waiting for one (room in a full KV
        # cache may come with it): see _room_may_come.
        self._answered = 0
        self._room_waiters: list[asyncio.Future] = []
        self._room_turn = asyncio.Lock()

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

    def _alive(self, session_id: str) -> bool:
        try:
            self.engine.get_session(session_id)
        except (CacheError, RequestError):
            return False
        return True

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
        for batches, queues and waits). None, nothing done, for any other step: _compute
        takes it. A claim refused (the session unknown, another's, or stepping) raises as
        _compute's would."""
        session_id = request.session_id
        engine = self.engine
        try:
            model = request.model or engine.session_model(session_id)
        except (CacheError, RequestError):  # _compute answers why
            return None
        lanes = self.lanes.get(model)
        if lanes is None:
            return None
        fast = lanes.fast
        now = fast.alone_now(PLAIN_STEP_KEY, deadline)
        if now is None:
            return None
        try:
            engine.claim(session_id, caller)
        except SessionSpilled:  # brought back by _compute's path
            return None
        ticket = Ticket(received, deadline, claimed=True)
        started = time.perf_counter()
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

    async def _session_call(
        self, request: AttendRequest, ticket: Ticket, caller: str | None
    ) -> Computed:
        """A session step, tried again while room for it in a full KV cache may come."""
        seen, started = self._answered, time.monotonic()
        try:  # most steps: answered (or refused) at the first try
            return await self._compute(request, ticket, caller)
        except CacheExhausted as e:
            refused = e
        return await self._room_retries(request, ticket, caller, refused, seen, started)

    async def _room_retries(
        self,
        request: AttendRequest,
        ticket: Ticket,
        caller: str | None,
        refused: CacheExhausted,
        seen: int,
        started: float,
    ) -> Computed:
        """A session step refused for room at its first try (`refused`; `seen`: calls
        answered before it, `started`: time.monotonic() then), tried again while room may
        come."""
        give_up = started + ROOM_WAIT_S
        if ticket.deadline is not None:
            give_up = min(give_up, ticket.deadline)
        while True:
            # Others answered since: not this try's own release (refused bringing its
            # session back, it never held the claim).
            others = self._answered - seen - ticket.claimed
            if not await self._room_may_come(refused, others, give_up):
                raise refused
            seen = self._answered
            ticket.claimed = False  # (until this try holds the session's claim)
            try:
                # Tries again one at a time: calls refused together (one batch whose
                # sessions held the room each needed) would otherwise batch together again.
                async with self._room_turn:
                    return await self._compute(request, ticket, caller)
            except CacheExhausted as e:
                refused = e

    def _session_answered(self) -> None:
        """A session call let go of its session: calls waiting for room try again."""
        self._answered += 1
        if not self._room_waiters:  # (most steps: none waits, no list made)
            return
        waiters, self._room_waiters = self._room_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def _room_may_come(self, refused: CacheExhausted, others: int, give_up: float) -> bool:
        """A session call refused for room (bringing its session back, or its step) while
        other calls in flight held sessions that could not be spilled or evicted: True once
        another session call has let go since (`others` already had, or one does now: try
        again), False when none held any or
        none lets go before give_up (the refusal stands). A full cache thus queues such
        calls instead of refusing them; the call waits without its claim, so that its own
        session may be spilled to make room for the others meanwhile."""
        if not refused.in_flight:
            return False
        if others > 0:
            return True
        left = give_up - time.monotonic()
        if left <= 0:
            return False
        waiter = asyncio.get_running_loop().create_future()
        self._room_waiters.append(waiter)
        try:
            await asyncio.wait_for(waiter, left)
        except TimeoutError:
            return False
        finally:
            with contextlib.suppress(ValueError):
                self._room_waiters.remove(waiter)
        return True

    async def _live(
        self, session_id: str, caller: str | None, call: Callable[[], T]
    ) -> tuple[T, float]:
        """(call(), seconds spent bringing the session back from the spill tier): a spilled
        session's file is read and adopted off the event loop, then call() runs here. (The
        engine's own session calls restore too, should it be spilled again in between:
        rare, and then on this thread.)"""
        restore_s = 0.0
        if self.engine.is_spilled(session_id):
            restore_s = await self._restore(session_id, caller)
        for attempt in range(RESTORE_TRIES + 1):
            try:
                value = call()
            except SessionSpilled:  # (spilled again meanwhile, to make room: once more)
                if attempt == RESTORE_TRIES:
                    raise
            else:
                if restore_s:
                    metrics.observe_restore(self.engine.session_model(session_id), restore_s)
                return value, restore_s
            restore_s += await self._restore(session_id, caller)
        raise AssertionError("unreachable")

    async def _restore(self, session_id: str, caller: str | None) -> float:
        """On the compute thread: torch ops on another thread would start a team of their
        own (engine/threads.py); a restore is rare and short."""
        return await self._on_compute(self.engine.restore_session, session_id, caller)

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

    async def analyze_heads(self, request: AttendRequest, include_weights: bool) -> HeadReport:
        """2H + 1 forwards off the event loop, beside (not inside) the batched lanes."""
        return await asyncio.to_thread(
            analyze_heads, self.engine, request, include_weights=include_weights
        )

    # --- Triton's sequences (the Open Inference Protocol door) -----------------------------
    # Each change is one call with no await inside: a caller cancelled between two round
    # trips (a frontend worker's) can never leave a session made and not mapped, or unmapped
    # and not closed.

    async def sequence_session(self, key: SequenceKey) -> str | None:
        return self.sequences.get(key)

    async def start_sequence(self, key: SequenceKey, model: str, owner: str) -> str:
        session_id = self.engine.create_session(model, None, None, owner).session_id
        previous = self.sequences.start(key, session_id, live=self._alive)
        if previous is not None:
            with contextlib.suppress(CacheError, RequestError):  # gone already: fine
                self.engine.close_session(previous)
        return session_id

    async def end_sequence(self, key: SequenceKey, session_id: str, *, close: bool) -> None:
        self.sequences.end(key, session_id)
        if close:
            with contextlib.suppress(CacheError, RequestError):
                self.engine.close_session(session_id)

    # --- sessions ------------------------------------------------------------------------
    # Coroutines, so that a front door awaits them alike here and in a frontend worker,
    # where they are a round trip to the engine process (serving/remote.py).

    async def create_session(
        self, model: str, max_len: int | None, ttl_s: float | None, owner: str = ""
    ) -> SessionStats:
        return self.engine.create_session(model, max_len, ttl_s, owner)

    async def get_session(self, session_id: str, caller: str | None = None) -> SessionStats:
        get = self.engine.get_session
        return (await self._live(session_id, caller, lambda: get(session_id, caller)))[0]

    async def fork_session(
        self, session_id: str, ttl_s: float | None, caller: str | None = None
    ) -> SessionStats:
        fork = self.engine.fork_session
        return (await self._live(session_id, caller, lambda: fork(session_id, ttl_s, caller)))[0]

    async def truncate_session(
        self, session_id: str, num_tokens: int, caller: str | None = None
    ) -> SessionStats:
        truncate = self.engine.truncate_session
        live = await self._live(
            session_id, caller, lambda: truncate(session_id, num_tokens, caller)
        )
        return live[0]

    async def close_session(self, session_id: str, caller: str | None = None) -> None:
        self.engine.close_session(session_id, caller)

    # --- moves (a Ray replica that Ray stops sends its sessions to another) -------------
    # On the compute thread: they read or write the KV cache (engine/threads.py).

    async def session_ids(self) -> list[str]:
        """Every session held here, live or spilled, the least recently used first."""
        return self.engine.session_ids()

    async def pack_session(self, session_id: str) -> bytes:
        """The session as one record's bytes; it stays here until session_moved."""
        return await self._on_compute(self.engine.pack_session, session_id)

    async def session_moved(self, session_id: str, where: str) -> None:
        """Received elsewhere: freed here, its later calls told where it went."""
        self.engine.session_moved(session_id, where)

    async def receive_session(self, data: bytes, source: str) -> SessionStats:
        """Adopts a session another engine packed, under its id (Engine.receive_session)."""
        return await self._on_compute(self.engine.receive_session, data, source)

    async def _on_compute(self, fn: Callable[..., T], *args) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.threads.main, fn, *args)


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
        # A lone small request on the event loop's thread: no crossing (batcher.py).
        inline=engine.runs_inline if inline else None,
        run_inline=compute.on_caller(run_batch),
    )
    for lane, batcher in (("fast", lanes.fast), ("weights", lanes.weights)):
        metrics.watch_queue(spec.name, lane, lambda b=batcher: b.queued_requests)
    return lanes
