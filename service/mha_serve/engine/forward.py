"""The forward of a batch of session steps (Sessions.run_steps' batch path): the steps' K/V
written, attention over each session's cache, and the overflow checks that leave each row
to keep or refuse (StepForward); plain decode steps in fixed shapes (engine/graphs.py).
Part of Sessions (sessions.py), kept in a file of its own."""

from __future__ import annotations

import functools
import logging
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mha_serve.cache import KVCache, Reservation
from mha_serve.engine.attend import FlashDecodeFailed, attend_steps
from mha_serve.engine.bounds import clearance, clears, gate_absmax, key_absmax
from mha_serve.engine.graphs import StaticDecode
from mha_serve.engine.project import project_and_append
from mha_serve.engine.prompts import prompt_rows, with_prompts
from mha_serve.engine.types import HostedModel, Prepared
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
# torch thread (one_thread_is_enough).
SMALL_STEP_MIN_SESSIONS = 4
SMALL_STEP_MAX_KV_BYTES = 1 << 20


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


class BatchForward:
    """Sessions' batch forward (mixed into it; its state is Sessions': static_decode and
    _static, batched_attention, flash_kernels)."""

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

    def decodes_fixed(self, hosted: HostedModel) -> bool:
        """Whether the static decode takes hosted's plain decode steps: it is on, it supports
        the model (StaticDecode.supports), graphs have their CUDA device, and it has not
        been switched off for the model (buffers it could not make, a graph that failed).
        Where it does not, the model's plain steps run as any step: the lone-step path and
        decode_now take them as with the static decode off."""
        if self.static_decode == "off" or not StaticDecode.supports(hosted.spec.attention):
            return False
        if self.static_decode == "graphs" and hosted.device.type != "cuda":
            return False
        name = hosted.spec.name
        return name not in self._static or self._static[name] is not None

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
        bounded = _bounded_rows(hosted, cache, steps, cached)
        batched = self.batched_attention.get(hosted.spec.name, False)
        with torch.inference_mode():
            # MLA prompts (a session's first or long chunk) attend expanded (engine/prompts.py)
            prompts = []
            if bounded is not None and not first.need_weights:
                prompts = prompt_rows(hosted, reservations, new_tokens)
            if prompts:
                out = with_prompts(
                    hosted, cache, x, reservations, new_tokens, prompts, head_mask, batched
                )
                return _proven(out, heads, cached, bounded)
            # Write first, then attend over each session's positions in order, from its
            # step's window on (read_start): batched (padded groups, one kernel each) or one
            # kernel per session over its blocks in place (engine/attend.py).
            q, k_new, v_new = project_and_append(hosted, cache, x, reservations)
            out_gate = hosted.module.output_gate(x)  # (B, T, gate_width); None: no gate
            # An inf key need not show in this step's output (a -inf score is just a zero
            # weight) but would poison every later step of its session, so the K/V
            # themselves are checked: those rows' steps are refused, not kept. float16 (a
            # narrower cache, or a float16 model's own) overflows past |x| = 65504. The
            # same maxima bound each step's scores against all its session's keys (the
            # cached ones by the session's own bound), so the exact check runs only for a
            # row the bound cannot clear (mha_serve.model.overflow). First, bounds from each
            # step's max |input| (read at validation) and the weights (bounded, above): a
            # batch they clear needs no look at its tensors at all; otherwise its rows' max
            # |q|, |k|, |v| are read with the output's, in one sync after the forward.
            maxima = None if bounded is not None else row_absmax_tensor(q, k_new, v_new)  # (3, B)
            attend = functools.partial(
                attend_steps,
                hosted.module,
                cache,
                q,
                reservations,
                new_tokens,
                batched=batched,
                need_weights=first.need_weights,
                weight_heads=sorted(set(heads)) if first.need_weights else None,
                head_mask=head_mask,
                out_gate=out_gate,
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


def one_thread_is_enough(cache, reservations: list[Reservation]) -> bool:
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
