"""KV-cache sessions of the hosted models: the cache layer bound to the attention modules.

A step reserves cache slots, projects the whole batch's new tokens, writes their K/V, lets
each session attend over its own cached K/V (engine/attend.py: padded groups in one kernel
each, or one kernel per session over its blocks in place), projects the outputs as one
batch and commits; any failure rolls every reservation back, so a session never counts
tokens whose K/V were not written.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from mha_serve.cache import (
    CacheError,
    KVCache,
    Reservation,
    SessionSpilled,
    SessionStats,
    SessionTable,
)
from mha_serve.engine.attend import (
    FlashDecodeFailed,
    FlashKernel,
    attend_steps,
    batched_by_default,
    flash_decode_unsupported,
    flash_varlen,
)
from mha_serve.engine.bounds import (
    KeyBound,
    clearance,
    cleared,
    clears,
    gate_absmax,
    key_absmax,
)
from mha_serve.engine.checks import require_finite, scores_overflow_error
from mha_serve.engine.durable import Expectations, open_spill_tier, restore
from mha_serve.engine.errors import Abandoned, DeadlinePassed, InvalidRequest, RequestError
from mha_serve.engine.graphs import StaticDecode
from mha_serve.engine.requests import Array, AttendOutcome, AttendRequest, CallState
from mha_serve.engine.types import (
    DTYPES,
    HostedModel,
    Prepared,
    array_of,
    on_host,
    output_dtype,
    repeat_heads,
)
from mha_serve.model import AttentionOutput
from mha_serve.model.overflow import (
    bound_crossed,
    row_absmax_tensor,
    score_limit,
    scores_overflow,
    weight_bounds,
)
from mha_serve.transfer import host_buffer, list_tensor, to_device

log = logging.getLogger(__name__)

# Batches of at least this many sessions, each reading at most this much K/V, run with one
# torch thread (_one_thread_is_enough).
SMALL_STEP_MIN_SESSIONS = 4
SMALL_STEP_MAX_KV_BYTES = 1 << 20
# torch.inference_mode()'s own guard (torch/autograd/grad_mode.py enters it, behind three
# Python calls of its own): a lone step enters it directly, as torch.inference_mode() where
# a torch lacks it.
_INFERENCE_MODE = getattr(torch._C, "_InferenceMode", None)
# How plain decode steps run (Sessions' static_decode): as any step; in fixed shapes
# (engine/graphs.py); replayed from CUDA graphs of those shapes.
STATIC_DECODE_MODES = ("off", "eager", "graphs")


class _FixedShapeFailed(Exception):
    """StaticDecode.step failed (a graph that could not be captured, its memory): the
    batch runs as any step instead (Sessions._forward_fixed)."""


@dataclass(slots=True)
class StepForward:
    """What one batched forward of session steps leaves for Sessions._settle to keep or
    refuse, row by row (row b is the b-th step that reserved room)."""

    out: AttentionOutput
    heads: list[int]  # the query heads whose weights were asked (all steps ask the same)
    overflowed: set[int]  # rows whose K/V did not fit the cache's dtype (refused)
    too_large: set[int]  # rows whose scores overflow (refused)
    # Each row's session's bound on max |k| and |v| with the step's K/V (measured, or
    # proven), kept as its KeyBound: a later step's output averages the cached values too.
    key_bounds: list[float]
    finite: list[bool]  # whether each row's output is


class Sessions:
    """The session table and one KV cache per model that has a cache budget: the one API
    through which the engine creates, steps, forks, truncates and closes sessions."""

    def __init__(
        self,
        models: dict[str, HostedModel],
        *,
        evict: bool,
        default_ttl_s: float | None,
        clock: Callable[[], float] = time.monotonic,
        id_prefix: str = "",
        max_sessions_per_client: int = 0,
        max_cache_bytes_per_client: int = 0,
        spill_dir: str = "",
        spill_bytes: int = 0,
        batched_attention: bool | None = None,
        static_decode: str = "off",
        flash_decode: bool = False,
    ) -> None:
        """id_prefix starts every session id (a Ray Serve replica's own id); the per-client
        limits bound each owner's live sessions and KV bytes (0: none); spill_dir: a full
        cache moves idle sessions there, up to spill_bytes ("": no spill tier);
        batched_attention: whether a batch of steps without weights attends in padded
        groups (engine/attend.py), None: by each model's device (batched_by_default);
        static_decode: how plain decode steps (one token each, no weights, no head mask)
        run: "off" as any step, "eager" in fixed shapes (engine/graphs.py, any device),
        "graphs" replayed from CUDA graphs of those shapes (models on CUDA; the others as
        "off"); flash_decode: batched plain decode steps of a model flash attention can run
        read each session's K/V in place, one kernel (engine/attend.py; the other models
        as without it, with a warning that says why)."""
        if static_decode not in STATIC_DECODE_MODES:
            raise ValueError(
                f"static_decode {static_decode!r} is not one of {', '.join(STATIC_DECODE_MODES)}"
            )
        self.static_decode = static_decode
        # Per model, made on its first plain decode batch (None: the model cannot run so),
        # with a lock: one step at a time uses its static buffers; a step that finds it
        # taken runs as any step.
        self._static: dict[str, tuple[StaticDecode, threading.Lock] | None] = {}
        self._static_made = threading.Lock()  # one StaticDecode (and graph pool) per model
        self.table = SessionTable(
            evict=evict, default_ttl_s=default_ttl_s, clock=clock, id_prefix=id_prefix
        )
        self.table.set_client_limits(
            max_sessions=max_sessions_per_client, max_bytes=max_cache_bytes_per_client
        )
        self.caches: dict[str, KVCache] = {}
        # Per model: steps without weights attend batched (a plain dict: tests flip it).
        self.batched_attention = {
            name: batched_by_default(hosted.device)
            if batched_attention is None
            else batched_attention
            for name, hosted in models.items()
        }
        # Per model with a cache: the kernel batched decode steps read their K/V in place
        # with (flash_decode; absent: gathered). A plain dict: tests put a reference in.
        self.flash_kernels: dict[str, FlashKernel] = {}
        for name, hosted in models.items():
            spec = hosted.spec
            if spec.kv_cache_bytes == 0:
                continue
            dtype = hosted.dtype if spec.kv_cache_dtype == "auto" else DTYPES[spec.kv_cache_dtype]
            if dtype != hosted.dtype and dtype.itemsize >= hosted.dtype.itemsize:
                raise ValueError(
                    f"model {name!r}: kv_cache_dtype {spec.kv_cache_dtype} is not narrower than "
                    f"the model's dtype {str(hosted.dtype).removeprefix('torch.')}: it would "
                    "hold K/V computed in the model's dtype in as many or more bytes, and round "
                    "them; use auto, or a narrower dtype"
                )
            try:
                cache = KVCache.from_config(
                    spec.attention,
                    budget_bytes=spec.kv_cache_bytes,
                    block_size=spec.kv_block_size,
                    dtype=dtype,
                    device=hosted.device,
                )
            except ValueError as e:
                raise ValueError(f"model {name!r}: kv_cache_bytes: {e}") from None
            self.caches[name] = cache
            if flash_decode:
                why = flash_decode_unsupported(spec.attention, hosted.device, hosted.dtype, dtype)
                if why is None:
                    self.flash_kernels[name] = flash_varlen
                else:
                    log.warning("flash_decode is on, but not for model %r: %s", name, why)
            window = spec.attention.sliding_window  # sessions then keep their window only
            self.table.add_model(name, cache, max_len=spec.max_seq_len, window=window)
        # What a session's record must match here: spill files, and sessions moved in.
        self.table.expected = Expectations(models, self.caches)
        self.table.engine_state_of = KeyBound.of  # K/V that arrive whole: bound recomputed
        if spill_dir and self.caches:
            self.table.set_spill(open_spill_tier(self.table.expected, spill_dir, spill_bytes))

    def cache(self, model: str) -> KVCache:
        cache = self.caches.get(model)
        if cache is None:
            raise InvalidRequest(
                f"model {model!r} serves no sessions (its kv_cache_bytes is 0); "
                f"models with sessions: {', '.join(self.caches) or 'none'}"
            )
        return cache

    def num_sessions(self, model: str) -> int:
        return self.table.num_sessions(model)

    def num_blocks_used(self, model: str) -> int:
        return self.table.pool(model).num_used

    def num_blocks_out_of_window(self, model: str) -> int:
        """Blocks freed so far because they fell out of a session's sliding window."""
        return self.table.num_blocks_out_of_window(model)

    @property
    def evicts(self) -> bool:
        """Whether a full cache evicts idle sessions (else it refuses new tokens)."""
        return self.table.evict

    def on_end(self, hook: Callable[[str], None]) -> None:
        """hook(reason) each time a session ends: "closed", "expired" or "evicted"."""
        self.table.on_end = hook

    def create(
        self, model: str, max_len: int | None, ttl_s: float | None, owner: str = ""
    ) -> SessionStats:
        self.cache(model)
        return self.table.made_stats(
            self.table.create(model, max_len=max_len, ttl_s=ttl_s, owner=owner)
        )

    def stats(self, session_id: str, owner: str | None = None) -> SessionStats:
        return self.table.session_stats(session_id, owner)

    def key_bound(self, session_id: str) -> float:
        """The live session's bound on max |k| and |v| of the K/V it holds (its KeyBound, 0.0
        while it holds none): what its next step's overflow check counts them as."""
        return key_absmax(self.table.get(session_id).engine_state)

    def model_of(self, session_id: str) -> str:
        """The model of a session, live or spilled (SessionNotFound says why there is none)."""
        try:
            return self.table.get(session_id).model
        except SessionSpilled:
            spilled = self.table.spilled(session_id)
            if spilled is None:  # brought back meanwhile
                return self.table.get(session_id).model
            return spilled.record.model

    def fork(self, session_id: str, ttl_s: float | None, owner: str | None = None) -> SessionStats:
        """A new session sharing the parent's tokens (copy-on-write); ttl_s None: the parent's."""
        return self.table.made_stats(self.table.fork(session_id, ttl_s=ttl_s, owner=owner))

    def close(self, session_id: str, owner: str | None = None) -> None:
        self.table.close(session_id, owner)

    # --- the spill tier (engine/durable.py) -------------------------------------------------

    def restore(self, session_id: str, owner: str | None = None) -> float:
        """Brings a spilled session back (reading its file); seconds taken, 0 if it was not
        spilled. NOT_FOUND for a caller not its owner, or a file that cannot be adopted."""
        return restore(self.table, session_id, owner)

    def spill_idle(self) -> list[str]:
        """Every idle session written to the spill tier (at shutdown); the ids written."""
        return self.table.spill_idle() if self.table.spill is not None else []

    def adopt_spilled(self) -> tuple[list[str], list[tuple[str, str]]]:
        """At start: the sessions the spill directory holds, taken over (adopted ids, refused
        (file, reason))."""
        return self.table.adopt_spilled()

    def close_spill(self) -> None:
        """Lets the spill directory go (its lock): after spill_idle, at exit."""
        if self.table.spill is not None:
            self.table.spill.close()

    def expire(self) -> list[str]:
        """Frees idle sessions past their TTL; returns their ids."""
        return self.table.expire()

    def claim(self, session_id: str, owner: str | None = None) -> None:
        """Claims the session for one step, from its receipt until its answer (release):
        another step meanwhile is refused with SessionBusy (SessionTable.claim)."""
        self.table.claim(session_id, owner)

    def release(self, session_id: str) -> None:
        """The claimed step is answered, or failed."""
        self.table.release(session_id)

    @contextlib.contextmanager
    def stepping(self, session_id: str, owner: str | None = None) -> Iterator[None]:
        """claim, and release when the block ends."""
        self.claim(session_id, owner)
        try:
            yield
        finally:
            self.release(session_id)

    def truncate(self, session_id: str, num_tokens: int, owner: str | None = None) -> SessionStats:
        """SessionTable.truncate: refused (SessionBusy) while a step of the session is
        unanswered, queued or computing."""
        return self.table.session_stats(self.table.truncate(session_id, num_tokens, owner).id)

    def validate_step(self, hosted: HostedModel, call: AttendRequest) -> int:
        """Session-specific checks, before the step queues (the table re-checks at reserve);
        the tokens the session holds."""
        session = self.table.get(call.session_id)
        if session.model != hosted.spec.name:
            raise InvalidRequest(
                f"session {call.session_id!r} belongs to model {session.model!r}, not "
                f"{hosted.spec.name!r}; leave model empty or name {session.model!r}"
            )
        batch, seq_len, _ = call.inputs.shape
        if batch != 1:
            raise InvalidRequest(
                f"a session step takes one sequence, (T, embed_dim) or (1, T, embed_dim); got batch {batch}"
            )
        if call.lengths is not None and tuple(call.lengths) != (seq_len,):
            raise InvalidRequest("a session step's tokens are all real: leave lengths empty")
        if call.causal is False:
            raise InvalidRequest(
                "session steps are causal (cached keys are exact only for causal attention); "
                "leave causal unset or true"
            )
        return session.num_tokens

    def run_steps(
        self,
        hosted: HostedModel,
        calls: list[Prepared],
        check_weights: Callable[[HostedModel, AttendRequest, int], None] | None = None,
    ) -> list[AttendOutcome | Exception]:
        """One batched forward for steps of different sessions of one model.

        Steps with weights arrive one at a time (their own lane); steps without share a batch.
        check_weights(hosted, call, num_keys) raises for weights over the limits: validation
        checked them against the session then, and a step of the same session kept since
        (queued ahead of this one) makes them larger.
        """
        start = time.perf_counter()
        handed: Reservation | None = None  # a lone step's, reserved by _run_alone
        if len(calls) == 1 and (self.static_decode == "off" or calls[0].inputs.shape[1] != 1):
            outcome = self._run_alone(hosted, calls[0])
            if isinstance(outcome, Reservation):  # bounds that cannot clear it: measured here
                handed = outcome
            elif outcome is not None:
                return [outcome]
        name = hosted.spec.name
        cache = self.cache(name)
        results: list[AttendOutcome | Exception | None] = [None] * len(calls)
        if handed is not None:  # (never given back meanwhile: nobody else takes its room)
            reserved: list[Reservation | CacheError] = [handed]
        else:
            reserved = self.table.reserve_many(
                [(p.request.session_id, p.inputs.shape[1], p.state.claimed) for p in calls]
            )
        # Until _settle takes them, any error rolls back the reservations still open.
        open_ = [r for r in reserved if isinstance(r, Reservation)]
        live: list[tuple[int, Reservation]] = []
        threads, small = 0, False
        try:
            for i, r in enumerate(reserved):
                if isinstance(r, CacheError):
                    results[i] = r
                    continue
                if calls[i].request.need_weights and check_weights is not None:
                    try:
                        check_weights(hosted, calls[i].request, r.start + r.num_tokens)
                    except RequestError as e:
                        open_ = [x for x in open_ if x is not r]
                        self.table.rollback(r)
                        results[i] = e
                        continue
                live.append((i, r))
            if not live:
                return results
            forward = None
            steps = [calls[i] for i, _ in live]
            static = self._static_for(hosted, cache, steps)
            if static is not None:  # plain decode steps in fixed shapes (engine/graphs.py)
                forward = self._forward_fixed(hosted, cache, steps, live, *static)
            if forward is None and len(live) > 1:
                small = _one_thread_is_enough(cache, [r for _, r in live])
                threads = torch.get_num_threads()
                if small and threads > 1:
                    torch.set_num_threads(1)
            if forward is None:
                forward = self._forward(hosted, cache, steps, live)
        except BaseException:  # nothing was kept: every reservation still open goes back
            for r in open_:
                self.table.rollback(r)
            raise
        finally:
            if small and threads > 1:
                torch.set_num_threads(threads)
        compute_ms = (time.perf_counter() - start) * 1e3
        self._settle(forward, compute_ms, calls, live, results)
        return results

    def _static_for(
        self, hosted: HostedModel, cache: KVCache, steps: list[Prepared]
    ) -> tuple[StaticDecode, threading.Lock] | None:
        """The model's StaticDecode, its lock taken (release it), when static_decode is on
        for it and every step is a plain decode step: one token, no weights, no head mask,
        at most its largest batch bucket. None otherwise (the steps run as any step)."""
        if self.static_decode == "off":
            return None
        if any(
            p.inputs.shape[1] != 1 or p.request.need_weights or p.request.head_mask is not None
            for p in steps
        ):
            return None
        name = hosted.spec.name
        if name not in self._static:
            with self._static_made:
                self._make_static(hosted, cache)
        held = self._static[name]
        if held is None or len(steps) > held[0].batch_buckets[-1]:
            return None
        return held if held[1].acquire(blocking=False) else None

    def _make_static(self, hosted: HostedModel, cache: KVCache) -> None:
        """The model's StaticDecode and its lock into _static (None where it cannot run),
        unless another thread made it first."""
        name = hosted.spec.name
        if name not in self._static:
            graphs = self.static_decode == "graphs"
            runs = StaticDecode.supports(hosted.spec.attention) and (
                not graphs or hosted.device.type == "cuda"
            )
            self._static[name] = None
            if runs:
                try:
                    decode = StaticDecode(hosted, cache, graph=graphs)
                except (ValueError, RuntimeError) as e:  # its buffers, say: as any step then
                    log.warning("model %r: decode steps run as any step: %s", name, e)
                else:
                    self._static[name] = (decode, threading.Lock())

    def _forward_fixed(
        self,
        hosted: HostedModel,
        cache: KVCache,
        steps: list[Prepared],
        live: list[tuple[int, Reservation]],
        decode: StaticDecode,
        lock: threading.Lock,
    ) -> StepForward | None:
        """_forward through the model's StaticDecode (its lock taken by _static_for, released
        here). Should it fail (a graph that cannot be captured, its memory), it is logged and
        switched off for the model, and None says: run the steps as any step (which writes
        the same slots again, so nothing of the failed attempt is kept)."""
        name = hosted.spec.name
        try:
            return self._forward(hosted, cache, steps, live, static=decode)
        except _FixedShapeFailed:
            log.exception(
                "model %r: decode steps in fixed shapes (engine/graphs.py) failed; this batch "
                "and later ones run as any step",
                name,
            )
            self._static[name] = None
            return None
        finally:
            lock.release()

    def _run_alone(
        self, hosted: HostedModel, p: Prepared
    ) -> AttendOutcome | Exception | Reservation | None:
        """A lone step (one that finds its lane idle: most decode steps) without weights or a
        head mask whose bounds prove that nothing of it can overflow, run_steps' answer for
        it without the batch's lists and sets: the same ops on the same tensors, the same
        checks and outcome (tests/engine/test_lone_step.py). For a step with weights or a
        head mask, None, with nothing reserved; for one whose bounds cannot clear it, its
        reservation, still open: run_steps then runs either as a batch of one (the latter
        with that reservation, so that its room is never given back in between)."""
        request = p.request
        if request.need_weights or request.head_mask is not None:
            return None
        start = time.perf_counter()
        cache = self.cache(hosted.spec.name)
        try:
            r = self.table.reserve(request.session_id, p.inputs.shape[1], claimed=p.state.claimed)
        except CacheError as e:
            return e
        kept = False  # until then (kept, or handed on), any error rolls the reservation back
        try:
            cached = key_absmax(r.engine_state)
            bound = cleared(hosted, cache.dtype, p.input_absmax, cached, 1.0)
            if bound is None:  # measured instead, as a batch of one, on this reservation
                kept = True
                return r
            x = to_device(p.inputs, hosted.device, hosted.dtype)  # (1, T, E)
            end = r.start + r.num_tokens
            with torch.inference_mode() if _INFERENCE_MODE is None else _INFERENCE_MODE(True):
                y = None
                module = hosted.module
                # A decode step of a plain config over a cache in its dtype: in one call
                if (
                    r.num_tokens == 1
                    and module.decodes_in_one
                    and cache.dtype == x.dtype
                    and not r.first_block
                ):
                    views = cache.step_views(r.block_table, r.slots[0], end)
                    if views is not None:  # (its blocks consecutive, as a session's usually are)
                        y = module.decode_one(x, *views)
                if y is None:
                    q, _, _ = _project_and_append(hosted, cache, x, (r,))
                    keys, values = cache.read(
                        r.block_table, end, start=r.read_start, first_block=r.first_block
                    )
                    # (1, T, E): attend_cached's answer for one sequence, without its tuples
                    y = module.attend_step(q, keys, values, r.start, r.read_start)
            compute_ms = (time.perf_counter() - start) * 1e3
            try:
                dtype = output_dtype(request)
                if y.dtype == dtype and y.is_cpu:  # the step's whole output
                    output = array_of(y)
                else:
                    host = on_host(y, [dtype])
                    out = AttentionOutput(y, None)
                    output, _ = _step_outputs(out, host, None, dtype, 0, r, request, [], True)
                _raise_if_abandoned(p.state)  # last, right before commit: the smallest gap
            except Exception as e:  # refused, or its caller gone: not kept
                return e
            kept = True  # (commit takes the reservation, even when it raises)
            try:
                stats = self.table.commit(r, engine_state=KeyBound(max(cached, bound)))
            except CacheError as e:  # closed while the step ran: its cache went with it
                return e
            except BaseException as e:  # a bug: rolled back, unless it was kept after all
                with contextlib.suppress(ValueError):
                    self.table.rollback(r)
                if not isinstance(e, Exception):
                    raise
                log.exception("settling a lone session step failed")
                return e
        finally:
            if not kept:
                self.table.rollback(r)
        return AttendOutcome(
            output=output, weights=None, compute_ms=compute_ms, batch_size=1, session=stats
        )

    def _forward(
        self,
        hosted: HostedModel,
        cache: KVCache,
        steps: list[Prepared],
        live: list[tuple[int, Reservation]],
        *,
        static: StaticDecode | None = None,
    ) -> StepForward:
        """Writes the steps' K/V and attends; what is left to keep or refuse per row.
        static: plain decode steps run by it in fixed shapes (the same ops and checks)."""
        reservations = [r for _, r in live]
        # Each session's bound on the K/V it held before its step (its KeyBound).
        cached = [key_absmax(r.engine_state) for r in reservations]
        new_tokens = [p.inputs.shape[1] for p in steps]
        x = _batch_inputs(hosted, steps, new_tokens)  # (B, T, E)
        if static is not None:  # plain decode steps: no weights, no head mask
            return self._forward_static(hosted, cache, steps, reservations, cached, x, static)
        first = steps[0].request
        heads = first.heads(hosted.spec.attention.num_heads) if first.need_weights else []
        head_mask = None
        if first.head_mask is not None:
            head_mask = list_tensor(first.head_mask, hosted.device, hosted.dtype)  # (H,)
        with torch.inference_mode():
            # Write first, then attend over each session's positions in order, from its
            # step's window on (read_start): batched (padded groups, one kernel each) or one
            # kernel per session over its blocks in place (engine/attend.py).
            q, k_new, v_new = _project_and_append(hosted, cache, x, reservations)
            # An inf key need not show in this step's output (a -inf score is just a zero
            # weight) but would poison every later step of its session, so the K/V
            # themselves are checked: those rows' steps are refused, not kept. float16 (a
            # narrower cache, or a float16 model's own) overflows past |x| = 65504. The
            # same maxima bound each step's scores against all its session's keys (the
            # cached ones by the session's own bound), so the exact check runs only for a
            # row the bound cannot clear (mha_serve.model.overflow). First, bounds from each
            # step's max |input| (read at validation) and the weights: a batch they clear
            # needs no look at its tensors at all; otherwise its rows' max |q|, |k|, |v| are
            # read with the output's, in one sync after the forward.
            bounded = _bounded_rows(hosted, cache, steps, cached)
            maxima = None if bounded is not None else row_absmax_tensor(q, k_new, v_new)  # (3, B)
            attend = functools.partial(
                attend_steps,
                hosted.module,
                cache,
                q,
                reservations,
                new_tokens,
                batched=self.batched_attention.get(hosted.spec.name, False),
                need_weights=first.need_weights,
                weight_heads=sorted(set(heads)) if first.need_weights else None,
                head_mask=head_mask,
            )
            try:
                out = attend(flash=self.flash_kernels.get(hosted.spec.name))
            except FlashDecodeFailed as e:  # reads only: the same step again, gathered
                log.error(
                    "flash decode failed for model %r, which attends without it from now: %s",
                    hosted.spec.name,
                    e.__cause__,
                )
                self.flash_kernels.pop(hosted.spec.name, None)
                out = attend(flash=None)
        if bounded is not None:  # no overflow anywhere: proven, not measured
            return _proven(out, heads, cached, bounded)
        with torch.inference_mode():
            # The step's one device sync: max |q|, |k|, |v| and |output| of every row. Rows
            # are refused after the forward, so the common case waits for nothing first.
            measured = torch.cat([maxima, row_absmax_tensor(out.output)])  # (4, B)
        return _checked(hosted, cache, out, heads, q, reservations, new_tokens, cached, measured)

    def _forward_static(
        self,
        hosted: HostedModel,
        cache: KVCache,
        steps: list[Prepared],
        reservations: list[Reservation],
        cached: list[float],
        x: torch.Tensor,
        static: StaticDecode,
    ) -> StepForward:
        """_forward's plain decode steps through StaticDecode: the same bounds first, then
        the same checks on the maxima it measures with the output."""
        bounded = _bounded_rows(hosted, cache, steps, cached)
        try:
            with torch.inference_mode():
                result = static.step(x, reservations)
        except Exception as e:  # the fixed-shape step's own failure: as any step instead
            raise _FixedShapeFailed(f"{type(e).__name__}: {e}") from e
        out = AttentionOutput(output=result.output, weights=None)
        if bounded is not None:  # no overflow anywhere: proven, not measured
            return _proven(out, [], cached, bounded)
        ones = [1] * len(steps)
        return _checked(hosted, cache, out, [], result.q, reservations, ones, cached, result.maxima)

    def _settle(
        self,
        forward: StepForward,
        compute_ms: float,
        calls: list[Prepared],
        live: list[tuple[int, Reservation]],
        results: list[AttendOutcome | Exception | None],
    ) -> None:
        """Keeps (commit) or drops (rollback) each step on its own: one step's failure, its
        caller gone, or its session closing meanwhile, is that step's answer alone. Should
        settling itself fail, the steps not yet settled are rolled back and answered with
        that error (a pending step left behind would keep its session busy for good); those
        already kept keep their answers."""
        out, heads = forward.out, forward.heads
        overflowed, too_large, finite = forward.overflowed, forward.too_large, forward.finite
        key_bounds, commit = forward.key_bounds, self.table.commit
        settled = 0
        try:  # (the batch's host copy too: a device error there rolls every step back)
            dtypes = [output_dtype(calls[i].request) for i, _ in live]
            host = on_host(out.output, dtypes)  # one copy for the batch, not one per step
            # Its numpy memory, read once: steps in its dtype take a numpy view of their rows
            # (no torch op per step).
            rows = array_of(host) if host.dtype in dtypes else None
            # Per batch, what _step_outputs finds per row: a row in the host copy's dtype that
            # is finite and cannot overflow on the way to it, with no weights, all its tokens
            # real, takes its row's numpy view as it is (_row_views: no slice per row).
            views = None
            if (
                rows is not None
                and out.weights is None
                and not _may_overflow(out.output.dtype, host.dtype)
            ):
                views = _row_views(rows)
            width = host.shape[1]
            for b, (i, r) in enumerate(live):
                p = calls[i]
                try:
                    if overflowed and b in overflowed:
                        cache_dtype = self.caches[p.hosted.spec.name].dtype
                        raise InvalidRequest(_overflow_message(cache_dtype))
                    if too_large and b in too_large:
                        cache_dtype = self.caches[p.hosted.spec.name].dtype
                        narrower = min(
                            out.output.dtype, cache_dtype, key=lambda d: torch.finfo(d).max
                        )
                        raise scores_overflow_error(narrower)
                    if (
                        views is not None
                        and r.num_tokens == width
                        and dtypes[b] is host.dtype
                        and finite[b]
                    ):
                        output, weights = views[b], None
                    else:
                        output, weights = _step_outputs(
                            out, host, rows, dtypes[b], b, r, p.request, heads, finite[b]
                        )
                    _raise_if_abandoned(p.state)  # last, right before commit: the smallest gap
                except Exception as e:  # refused, caller gone, or a bug: not kept
                    settled = b + 1
                    self.table.rollback(r)
                    results[i] = e
                    continue
                try:  # one transaction: count the tokens, unpin, read the session's stats
                    stats = commit(r, engine_state=KeyBound(key_bounds[b]))
                except CacheError as e:  # closed while the step ran: its cache went with it
                    results[i] = e
                    continue
                finally:
                    settled = b + 1
                request = p.request
                need = request.need_weights
                results[i] = AttendOutcome(
                    output=output,
                    weights=weights,
                    weight_heads=tuple(heads) if need else (),
                    weight_query_start=request.query_start if need else 0,
                    compute_ms=compute_ms,
                    batch_size=len(live),
                    session=stats,
                )
        except BaseException as e:
            for _, r in live[settled:]:
                self.table.rollback(r)
            if settled and results[live[settled - 1][0]] is None:  # its commit failed (a bug):
                with contextlib.suppress(ValueError):  # roll back, unless it was kept after all
                    self.table.rollback(live[settled - 1][1])
            for i, _ in live:
                if results[i] is None:  # not settled, or settled when it failed
                    results[i] = e
            if not isinstance(e, Exception):
                raise
            log.exception("settling a batch of %d session steps failed", len(live))


def _proven(
    out: AttentionOutput, heads: list[int], cached: Sequence[float], bounded: Sequence[float]
) -> StepForward:
    """A step whose bounds prove that no row can overflow: nothing refused, every output
    finite, each session's key bound the larger of its own (cached) and its step's."""
    key_bounds = [max(c, b) for c, b in zip(cached, bounded, strict=True)]
    return StepForward(out, heads, set(), set(), key_bounds, [True] * len(key_bounds))


def _checked(
    hosted: HostedModel,
    cache: KVCache,
    out: AttentionOutput,
    heads: list[int],
    q: torch.Tensor,
    reservations: Sequence[Reservation],
    new_tokens: Sequence[int],
    cached: Sequence[float],
    measured: torch.Tensor,
) -> StepForward:
    """The step's rows checked from `measured` (4, B): max |q|, |k|, |v| and |output| of
    each row, read here in the step's one device sync. K/V not finite in the cache's dtype
    refuse their row; so do scores that overflow, checked exactly (over the session's keys
    in the cache) only for a row whose bound does not clear it."""
    with torch.inference_mode():
        q_max, k_max, v_max, o_max = measured.tolist()
        cfg = hosted.spec.attention
        limit = score_limit(q.dtype, cache.dtype) / cfg.score_factor
        D = cfg.head_dim
        overflowed: set[int] = set()  # K/V not finite in the cache's dtype
        too_large: set[int] = set()  # scores overflow (exact check where the bound fails)
        for b, r in enumerate(reservations):
            if not (k_max[b] < math.inf and v_max[b] < math.inf):
                overflowed.add(b)
            elif bound_crossed(q_max[b], max(k_max[b], cached[b]), D, limit):
                q_b = q[b, :, : new_tokens[b]].to(cache.dtype)  # as the kernels see it
                end = r.start + r.num_tokens
                keys = cache.read(
                    r.block_table, end, start=r.read_start, first_block=r.first_block
                )[0][0]  # (KVH, S, D) from position r.read_start
                window = cfg.sliding_window
                if scores_overflow(
                    q_b, keys, limit, first_pos=r.start, window=window, first_key=r.read_start
                ):
                    too_large.add(b)
    finite = [m < math.inf for m in o_max]
    key_bounds = [max(c, k, v) for c, k, v in zip(cached, k_max, v_max, strict=True)]
    return StepForward(out, heads, overflowed, too_large, key_bounds, finite)


def _project_and_append(
    hosted: HostedModel, cache: KVCache, x: torch.Tensor, reservations: Sequence[Reservation]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v (B, H|KVH, T, D) of the steps' new tokens x (B, T, E), their K/V written into
    the cache at each reservation's slots (in the cache's dtype: a narrower kv_cache_dtype is
    stored rounded). Under inference_mode."""
    positions = None  # only rotary models use them (no cost per step otherwise)
    if hosted.spec.attention.rope is not None:
        # Each session's new tokens continue from its cached length; the cache keeps K
        # rotated at these absolute positions.
        T = x.shape[1]
        if len(reservations) == 1:
            start = reservations[0].start
            positions = torch.arange(start, start + T, device=x.device)[None]  # (1, T)
        else:
            starts = list_tensor([r.start for r in reservations], x.device)  # (B,)
            positions = starts[:, None] + torch.arange(T, device=x.device)  # (B, T)
    q, k_new, v_new = hosted.module.project(x, positions)
    if k_new.dtype != cache.dtype:
        k_new, v_new = k_new.to(cache.dtype), v_new.to(cache.dtype)
    cache.append(k_new, v_new, [r.slots for r in reservations])
    return q, k_new, v_new


def _step_outputs(
    out: AttentionOutput,
    host: torch.Tensor,
    rows: Array | None,
    dtype: torch.dtype,
    b: int,
    r: Reservation,
    call: AttendRequest,
    heads: list[int],
    finite: bool,
) -> tuple[Array, Array | None]:
    """Step b's share of the batch's output and weights, its output in `dtype`; host: the
    batch's output on the host (on_host), rows: its numpy memory (None: not in any step's
    dtype); `finite`: its output row holds no NaN/Inf in the model's dtype."""
    n = r.num_tokens
    # A dtype whose range is not wider than the model's may overflow on the way to it.
    check = not finite or _may_overflow(out.output.dtype, dtype)
    if rows is not None and dtype == host.dtype and not check:  # (every step, most often)
        output = _rows_of(rows, b, n)
    else:
        t = host if host.shape[0] == 1 and host.shape[1] == n else host[b : b + 1, :n]
        if dtype != t.dtype:
            t = t.to(dtype)
        if check:
            require_finite(t, "output")
        # Contiguous here, on the compute thread: encoding then copies nothing with torch,
        # so no other thread ever runs a torch op big enough to start an OpenMP team.
        output = array_of(t.contiguous())
    weights = None
    if out.weights is not None:
        q_end = call.query_end or n
        w = out.weights[b : b + 1, :, call.query_start : q_end, : r.start + n]  # (1, h, R, S)
        w = repeat_heads(w, heads)
        weights = require_finite(w.to(DTYPES[call.weights_dtype]), "attention weights").cpu()
    return output, None if weights is None else array_of(weights.contiguous())


def _rows_of(rows: Array, b: int, n: int) -> Array:
    """Row b's first n tokens of a batch's output (B, T, E) held as an Array: a numpy view
    when they are contiguous (a whole row), else a numpy copy (on the compute thread)."""
    data = rows.data
    if not (data.shape[0] == 1 and data.shape[1] == n):
        data = data[b : b + 1, :n]
        if not data.flags.c_contiguous:
            data = np.ascontiguousarray(data)
    return Array(data, rows.dtype)


def _row_views(rows: Array) -> list[Array]:
    """Each row b of a batch's output (B, T, E) held as an Array: (1, T, E) numpy views, what
    _rows_of gives for a row of all T tokens, made in one pass (no slice per row)."""
    name = rows.dtype
    return [Array(v, name) for v in rows.data[:, None]]


@functools.cache
def _may_overflow(source: torch.dtype, target: torch.dtype) -> bool:
    """Whether a finite tensor in `source` may hold inf or NaN once converted to `target`:
    unless target's range is wider (bfloat16 or float16 to float32, float16 to bfloat16)."""
    return target != source and torch.finfo(target).max <= torch.finfo(source).max


def _raise_if_abandoned(state: CallState) -> None:
    """Its caller stopped waiting (cancelled, or past its deadline): the step is not kept,
    so that a retry does not find it appended already."""
    if state.cancelled:
        raise Abandoned("the caller cancelled before the step was kept; nothing of it was kept")
    if state.deadline is not None and time.monotonic() > state.deadline:
        raise DeadlinePassed(
            "the caller's deadline passed before the step was kept; nothing of it was kept"
        )


def _overflow_message(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if dtype == torch.float16:
        return (
            f"this step's keys or values overflowed to inf/NaN in the KV cache's {name} "
            "(float16 holds |x| <= 65504): scale the input down, or serve the model in a dtype "
            "that holds them (bfloat16 or float32, for the model or its kv_cache_dtype)"
        )
    return (
        f"this step's keys or values overflowed to inf/NaN in {name}: the input values are "
        "too large for the model; scale the input down"
    )


def _bounded_rows(
    hosted: HostedModel,
    cache: KVCache,
    steps: list[Prepared],
    cached: list[float],
) -> list[float] | None:
    """Each step's bound on max |k| and |v| when the bounds from its max |input| prove that
    nothing of the batch can overflow (engine/bounds.py); `cached`, each session's bound
    (KeyBound), covers its cached keys and values. None when any step's cannot: the
    batch's tensors are then measured."""
    gate = gate_absmax(steps[0].request.head_mask)
    # Once for the batch: every step's weights and cache dtype are these.
    c = clearance(hosted, cache.dtype, weight_bounds(hosted.module))
    kv_bounds = []
    for p, cached_absmax in zip(steps, cached, strict=True):
        bound = clears(c, p.input_absmax, cached_absmax, gate)
        if bound is None:
            return None
        kv_bounds.append(bound)
    return kv_bounds


def _batch_inputs(
    hosted: HostedModel, steps: list[Prepared], new_tokens: list[int]
) -> torch.Tensor:
    """The steps' tokens as one (B, T, E) tensor on the model's device and dtype: no copy
    for a lone step in the model's dtype; padded rows (unequal steps) are zeros."""
    device, dtype = hosted.device, hosted.dtype
    longest = max(new_tokens)
    # Made on the host and sent in one copy (through pinned memory on CUDA), never one per
    # step. (cat in the inputs' dtype, then converted once: a cat into another dtype runs a
    # few ops per input.)
    if all(n == longest for n in new_tokens):
        x = steps[0].inputs if len(steps) == 1 else torch.cat([c.inputs for c in steps])
        return to_device(x, device, dtype)
    x = host_buffer((len(steps), longest, hosted.spec.attention.embed_dim), dtype, device)
    x.zero_()
    for b, c in enumerate(steps):
        x[b, : new_tokens[b]].copy_(c.inputs[0])
    return x.to(device, non_blocking=True)


def _one_thread_is_enough(cache, reservations: list[Reservation]) -> bool:
    """Many sessions each stepping a few tokens over a short context: each op is too small
    to split, and waking the OpenMP team for it costs more than it saves. After its last
    parallel op the team spins for milliseconds, and with 64 sessions decoding that spin
    took a third of the server's CPU on 2 cores. One session, or any long context or
    prefill, keeps every thread."""
    if len(reservations) < SMALL_STEP_MIN_SESSIONS or cache.device.type != "cpu":
        return False
    longest = max(r.start + r.num_tokens - r.read_start for r in reservations)  # keys read
    new = sum(r.num_tokens for r in reservations)
    return longest * cache.bytes_per_token <= SMALL_STEP_MAX_KV_BYTES and new <= 4 * len(
        reservations
    )
