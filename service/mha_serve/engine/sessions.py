"""KV-cache sessions of the hosted models: the cache layer bound to the attention modules.

A step reserves cache slots, projects the whole batch's new tokens, writes their K/V, lets
each session attend over its own cached K/V (read in place when its blocks are
consecutive), projects the outputs as one batch and commits; any failure rolls every
reservation back, so a session never counts tokens whose K/V were not written.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterator

import torch

from mha_serve.cache import (
    CacheError,
    KVCache,
    Reservation,
    Session,
    SessionTable,
)
from mha_serve.engine.errors import (
    Abandoned,
    DeadlinePassed,
    InvalidRequest,
    RequestError,
    require_finite,
    scores_overflow_error,
)
from mha_serve.engine.types import DTYPES, AttendCall, AttendResult, HostedModel, repeat_heads
from mha_serve.model.overflow import (
    MARGIN,
    bound_crossed,
    output_bound,
    projected_bounds,
    row_absmax_tensor,
    score_limit,
    scores_overflow,
    weight_bounds,
)

log = logging.getLogger(__name__)

# Batches of at least this many sessions, each reading at most this much K/V, run with one
# torch thread (_one_thread_is_enough).
SMALL_STEP_MIN_SESSIONS = 4
SMALL_STEP_MAX_KV_BYTES = 1 << 20


class Sessions:
    """The session table and one KV cache per model that has a cache budget."""

    def __init__(
        self,
        models: dict[str, HostedModel],
        *,
        evict: bool,
        default_ttl_s: float | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.table = SessionTable(evict=evict, default_ttl_s=default_ttl_s, clock=clock)
        self.caches: dict[str, KVCache] = {}
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
            window = spec.attention.sliding_window  # sessions then keep their window only
            self.table.add_model(name, cache, max_len=spec.max_seq_len, window=window)

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

    def create(
        self, model: str, max_len: int | None, ttl_s: float | None, owner: str = ""
    ) -> Session:
        self.cache(model)
        return self.table.create(model, max_len=max_len, ttl_s=ttl_s, owner=owner)

    @contextlib.contextmanager
    def stepping(self, session_id: str) -> Iterator[None]:
        """Claims the session for one step, from its receipt until its answer
        (SessionTable.claim: another step meanwhile is refused with SessionBusy)."""
        self.table.claim(session_id)
        try:
            yield
        finally:
            self.table.release(session_id)

    def truncate(self, session_id: str, num_tokens: int) -> Session:
        """SessionTable.truncate: refused (SessionBusy) while a step of the session is
        unanswered, queued or computing."""
        return self.table.truncate(session_id, num_tokens)

    def validate_step(self, hosted: HostedModel, call: AttendCall) -> Session:
        """Session-specific checks, before the step queues (the table re-checks at reserve)."""
        session = self.table.get(call.session_id)
        if session.model != call.model:
            raise InvalidRequest(
                f"session {call.session_id!r} belongs to model {session.model!r}, not "
                f"{call.model!r}; leave model empty or name {session.model!r}"
            )
        batch, seq_len, _ = call.inputs.shape
        if batch != 1:
            raise InvalidRequest(
                f"a session step takes one sequence, (T, embed_dim) or (1, T, embed_dim); got batch {batch}"
            )
        if call.lengths is not None and call.lengths != [seq_len]:
            raise InvalidRequest("a session step's tokens are all real: leave lengths empty")
        if call.causal is False:
            raise InvalidRequest(
                "session steps are causal (cached keys are exact only for causal attention); "
                "leave causal unset or true"
            )
        return session

    def run_steps(
        self,
        hosted: HostedModel,
        calls: list[AttendCall],
        check_weights: Callable[[HostedModel, AttendCall, int], None] | None = None,
    ) -> list[AttendResult | Exception]:
        """One batched forward for steps of different sessions of one model.

        Steps with weights arrive one at a time (their own lane); steps without share a batch.
        check_weights(hosted, call, num_keys) raises for weights over the limits: validation
        checked them against the session then, and a step of the same session kept since
        (queued ahead of this one) makes them larger.
        """
        start = time.perf_counter()
        name = hosted.spec.name
        cache = self.cache(name)
        results: list[AttendResult | Exception | None] = [None] * len(calls)
        reserved = self.table.reserve_many(
            [(c.session_id, c.inputs.shape[1], c.claimed) for c in calls]
        )
        # Until _settle takes them, any error rolls back the reservations still open.
        open_ = [r for r in reserved if isinstance(r, Reservation)]
        live: list[tuple[int, Reservation]] = []
        threads, small = torch.get_num_threads(), False
        try:
            for i, r in enumerate(reserved):
                if isinstance(r, CacheError):
                    results[i] = r
                    continue
                if calls[i].need_weights and check_weights is not None:
                    try:
                        check_weights(hosted, calls[i], r.start + r.num_tokens)
                    except RequestError as e:
                        open_ = [x for x in open_ if x is not r]
                        self.table.rollback(r)
                        results[i] = e
                        continue
                live.append((i, r))
            if not live:
                return results
            small = _one_thread_is_enough(cache, [r for _, r in live])
            if small and threads > 1:
                torch.set_num_threads(1)
            forward = self._forward(hosted, cache, [calls[i] for i, _ in live], live)
        except BaseException:  # nothing was kept: every reservation still open goes back
            for r in open_:
                self.table.rollback(r)
            raise
        finally:
            if small and threads > 1:
                torch.set_num_threads(threads)
        compute_ms = (time.perf_counter() - start) * 1e3
        self._settle(*forward, compute_ms, calls, live, results)
        return results

    def _forward(self, hosted, cache, steps: list[AttendCall], live) -> tuple:
        """Writes the steps' K/V and attends; returns (AttentionOutput, heads, overflowed,
        too_large, kv_max, finite): overflowed, the batch rows whose K/V did not fit the
        cache's dtype; too_large, those whose scores overflow; kv_max, a bound on each row's
        max |k| and |v| (measured, or proven), kept as its session's bound (key_absmax: a
        later step's output averages the cached values too, not only its own); finite,
        whether each row's output is."""
        reservations = [r for _, r in live]
        new_tokens = [c.inputs.shape[1] for c in steps]
        x = _batch_inputs(hosted, steps, new_tokens)  # (B, T, E)
        first = steps[0]
        heads = first.heads(hosted.spec.attention.num_heads)
        head_mask = None
        if first.head_mask is not None:
            head_mask = torch.tensor(first.head_mask, dtype=hosted.dtype, device=hosted.device)
        with torch.inference_mode():
            positions = None  # only rotary models use them (no cost per step otherwise)
            if hosted.spec.attention.rope is not None:
                # Each session's new tokens continue from its cached length; the cache keeps
                # K rotated at these absolute positions.
                starts = torch.tensor([r.start for r in reservations], device=x.device)
                positions = starts[:, None] + torch.arange(x.shape[1], device=x.device)  # (B, T)
            q, k_new, v_new = hosted.module.project(x, positions)  # (B, H|KVH, T, D)
            if k_new.dtype != cache.dtype:  # a narrower cache (kv_cache_dtype): stored rounded
                k_new, v_new = k_new.to(cache.dtype), v_new.to(cache.dtype)
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
            bounded = _bounded_rows(hosted, cache, steps, reservations)
            maxima = None if bounded is not None else row_absmax_tensor(q, k_new, v_new)  # (3, B)
            # Write first, then read each session's positions in order: one copy of the
            # past (none for a session whose blocks are consecutive), no concatenation. A
            # sliding-window session is read from its step's window on (read_start).
            cache.append(k_new, v_new, [r.slots for r in reservations])
            past = [r.start for r in reservations]
            reads = [r.read_start for r in reservations]
            kv = [
                cache.read(
                    r.block_table,
                    r.start + r.num_tokens,
                    start=r.read_start,
                    first_block=r.first_block,
                )
                for r in reservations
            ]
            out = hosted.module.attend_cached(
                q,
                kv,
                past_lengths=past,
                new_lengths=new_tokens,
                need_weights=first.need_weights,
                weight_heads=sorted(set(heads)) if first.need_weights else None,
                head_mask=head_mask,
                first_keys=reads,
            )
        if bounded is not None:  # no overflow anywhere: proven, not measured
            return out, heads, set(), set(), bounded, [True] * len(steps)
        with torch.inference_mode():
            # The step's one device sync: max |q|, |k|, |v| and |output| of every row. Rows
            # are refused after the forward, so the common case waits for nothing first.
            out_max = row_absmax_tensor(out.output)
            q_max, k_max, v_max, o_max = torch.cat([maxima, out_max]).tolist()
            cfg = hosted.spec.attention
            limit = score_limit(q.dtype, cache.dtype) / cfg.score_factor
            D = cfg.head_dim
            overflowed: set[int] = set()  # K/V not finite in the cache's dtype
            too_large: set[int] = set()  # scores overflow (exact check where the bound fails)
            for b, r in enumerate(reservations):
                if not (k_max[b] < math.inf and v_max[b] < math.inf):
                    overflowed.add(b)
                elif bound_crossed(q_max[b], max(k_max[b], r.key_absmax), D, limit):
                    q_b = q[b, :, : new_tokens[b]].to(cache.dtype)  # as the kernels see it
                    keys = kv[b][0][0]  # (KVH, S, D) from position reads[b]
                    window = cfg.sliding_window
                    if scores_overflow(
                        q_b, keys, limit, first_pos=past[b], window=window, first_key=reads[b]
                    ):
                        too_large.add(b)
        finite = [m < math.inf for m in o_max]
        kv_max = [max(k, v) for k, v in zip(k_max, v_max, strict=True)]
        return out, heads, overflowed, too_large, kv_max, finite

    def _settle(
        self,
        out,
        heads,
        overflowed,
        too_large,
        kv_max,
        finite,
        compute_ms: float,
        calls,
        live,
        results,
    ) -> None:
        """Keeps (commit) or drops (rollback) each step on its own: one step's failure, its
        caller gone, or its session closing meanwhile, is that step's answer alone. Should
        settling itself fail, the steps not yet settled are rolled back and answered with
        that error (a pending step left behind would keep its session busy for good); those
        already kept keep their answers."""
        settled = 0
        try:
            for b, (i, r) in enumerate(live):
                call = calls[i]
                try:
                    if b in overflowed:
                        raise InvalidRequest(_overflow_message(self.caches[call.model].dtype))
                    if b in too_large:
                        dtypes = (out.output.dtype, self.caches[call.model].dtype)
                        raise scores_overflow_error(min(dtypes, key=lambda d: torch.finfo(d).max))
                    result = self._result(out, b, r, call, heads, compute_ms, len(live), finite[b])
                    _raise_if_abandoned(call)  # last, right before commit: the smallest gap
                except Exception as e:  # refused, caller gone, or a bug: not kept
                    settled = b + 1
                    self.table.rollback(r)
                    results[i] = e
                    continue
                try:  # one transaction: count the tokens, unpin, read the session's stats
                    result.session = self.table.commit(r, key_absmax=kv_max[b])
                except CacheError as e:  # closed while the step ran: its cache went with it
                    results[i] = e
                    continue
                finally:
                    settled = b + 1
                results[i] = result
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

    @staticmethod
    def _result(
        out, b, r: Reservation, call: AttendCall, heads, compute_ms, batch, finite: bool
    ) -> AttendResult:
        """Step b's share of the batch; `finite`: its output row holds no NaN/Inf."""
        n = r.num_tokens
        output = out.output[b : b + 1, :n]
        dtype = call.output_dtype or call.inputs.dtype
        if dtype != output.dtype:  # (no call at all otherwise: this runs per session per step)
            output = output.to(dtype)
        if not finite or output.dtype != out.output.dtype:  # a narrower dtype may overflow
            require_finite(output, "output")
        weights = None
        if out.weights is not None:
            q_end = call.query_end or n
            w = out.weights[b : b + 1, :, call.query_start : q_end, : r.start + n]  # (1, n, R, S)
            w = repeat_heads(w, heads)
            weights = require_finite(w.to(call.weights_dtype), "attention weights").cpu()
        # Contiguous here, on the compute thread: encoding then copies nothing with torch,
        # so no other thread ever runs a torch op big enough to start an OpenMP team.
        return AttendResult(
            output=(output if output.device.type == "cpu" else output.cpu()).contiguous(),
            weights=None if weights is None else weights.contiguous(),
            weight_heads=list(heads) if call.need_weights else [],
            weight_query_start=call.query_start if call.need_weights else 0,
            compute_ms=compute_ms,
            batch_size=batch,
        )


def _raise_if_abandoned(call: AttendCall) -> None:
    """Its caller stopped waiting (cancelled, or past its deadline): the step is not kept,
    so that a retry does not find it appended already."""
    if call.cancelled:
        raise Abandoned("the caller cancelled before the step was kept; nothing of it was kept")
    if call.deadline is not None and time.monotonic() > call.deadline:
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
    steps: list[AttendCall],
    reservations: list[Reservation],
) -> list[float] | None:
    """Each step's bound on max |k| and |v| when the bounds from its max |input| prove that
    nothing of the batch can overflow: not its K/V in the cache's dtype, not its scores
    against its session's keys, not its output, which averages the session's cached values
    too. The session's bound (Reservation.key_absmax) covers its cached keys and values.
    None when any step's bounds cannot (or its input was not validated): the batch's
    tensors are then measured."""
    cfg = hosted.spec.attention
    wb = weight_bounds(hosted.module)
    limit = score_limit(hosted.dtype, cache.dtype) / MARGIN / cfg.score_factor
    out_limit = torch.finfo(hosted.dtype).max / MARGIN
    gate = 1.0 if steps[0].head_mask is None else max(abs(g) for g in steps[0].head_mask)
    kv_bounds = []
    for call, r in zip(steps, reservations, strict=True):
        if call.input_absmax is None:
            return None
        q_b, k_b, v_b = projected_bounds(
            call.input_absmax, cfg.embed_dim, wb, rotary=cfg.rope is not None
        )
        # Every tensor on the way must fit too, not only K/V and the output: the input in
        # the model's dtype, q in the model's and the cache's (the kernels round it to the
        # cache's), the gate and the gated heads (a huge gate on tiny values times a small
        # Wo clears the output's bound, yet is inf in float16 and 0 * inf is NaN).
        v_all = max(v_b, r.key_absmax)  # the output averages every value the step sees
        if (
            not max(q_b, k_b, v_b) < limit
            or not max(call.input_absmax, gate, gate * v_all) < out_limit
            or bound_crossed(q_b, max(k_b, r.key_absmax), cfg.head_dim, limit * MARGIN)
            or not output_bound(v_all, gate, wb) < out_limit
        ):
            return None
        kv_bounds.append(max(k_b, v_b))
    return kv_bounds


def _batch_inputs(
    hosted: HostedModel, steps: list[AttendCall], new_tokens: list[int]
) -> torch.Tensor:
    """The steps' tokens as one (B, T, E) tensor on the model's device and dtype: no copy
    for a lone step in the model's dtype; padded rows (unequal steps) are zeros."""
    longest = max(new_tokens)
    if all(n == longest for n in new_tokens):
        x = steps[0].inputs if len(steps) == 1 else torch.cat([c.inputs for c in steps])
        return x.to(hosted.device, hosted.dtype, non_blocking=True)
    embed_dim = hosted.spec.attention.embed_dim
    x = torch.zeros(len(steps), longest, embed_dim, device=hosted.device, dtype=hosted.dtype)
    for b, c in enumerate(steps):
        x[b, : new_tokens[b]].copy_(c.inputs[0], non_blocking=True)
    return x


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
