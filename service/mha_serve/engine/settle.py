"""Settling a batch of session steps (Sessions._settle): each row of a StepForward kept
(commit) or refused (rollback) on its own, and its share of the output and weights made.
Part of Sessions (sessions.py), kept in a file of its own."""

from __future__ import annotations

import contextlib
import functools
import logging
import time

import numpy as np
import torch

from mha_serve.cache import CacheError, Reservation
from mha_serve.engine.bounds import KeyBound
from mha_serve.engine.checks import require_finite, scores_overflow_error
from mha_serve.engine.errors import Abandoned, DeadlinePassed, InvalidRequest
from mha_serve.engine.forward import StepForward
from mha_serve.engine.requests import Array, AttendOutcome, AttendRequest, CallState
from mha_serve.engine.types import DTYPES, Prepared, array_of, on_host, output_dtype, repeat_heads
from mha_serve.model import AttentionOutput

log = logging.getLogger(__name__)


class Settling:
    """Sessions' settling of a batch (mixed into it; its state is Sessions': table, caches)."""

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
            # Per batch, what step_outputs finds per row: a row in the host copy's dtype that
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
                        output, weights = step_outputs(
                            out, host, rows, dtypes[b], b, r, p.request, heads, finite[b]
                        )
                    raise_if_abandoned(p.state)  # last, right before commit: the smallest gap
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


def step_outputs(
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


def raise_if_abandoned(state: CallState) -> None:
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
