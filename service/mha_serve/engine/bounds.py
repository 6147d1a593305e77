"""Whether a request's inputs prove that nothing it computes can overflow: the bounds from its
max |input| and the model's weights (mha_serve.model.overflow), checked before the forward.
A request they clear needs no look at its tensors at all (no maxima, no device sync); one
they cannot clear is measured (the model's OverflowCheck, the step's maxima). A session's
cached K/V count through their KeyBound, kept beside the session's record."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from mha_serve.engine.types import HostedModel
from mha_serve.model.mla_bounds import latent_maxima, worst
from mha_serve.model.overflow import MARGIN, WeightBounds, score_limit, weight_bounds


@dataclass(slots=True)
class KeyBound:
    """A bound on max |k| and |v| over every key and value a session holds or held since it
    was last emptied: the overflow checks read it instead of the cached tensors. The engine's
    state of the session, which the cache carries on its record (Session.engine_state)
    without reading it: never written once made (a step's commit makes a new one), so a
    fork shares its parent's; an upper bound, so it holds for any prefix of the K/V (a
    truncate keeps it). Not frozen, as the engine's other per-step records (Reservation,
    SessionStats, AttendOutcome): see AttendOutcome."""

    absmax: float

    @classmethod
    def of(cls, k: torch.Tensor, v: torch.Tensor) -> KeyBound:
        """Recomputed from a session's K/V where they arrive whole (a spilled session
        brought back, one adopted at start or moved in): never trusted from a file."""
        if k.numel() == 0:
            return cls(0.0)
        return cls(float(max(k.abs().max(), v.abs().max())))


def key_absmax(engine_state: object) -> float:
    """The bound on a session's cached K/V from its Session.engine_state (None: none held)."""
    return 0.0 if engine_state is None else engine_state.absmax


def gate_absmax(head_mask: tuple[float, ...] | None) -> float:
    return 1.0 if head_mask is None else max(abs(g) for g in head_mask)


def cleared(
    hosted: HostedModel,
    cache_dtype: torch.dtype,
    input_absmax: float,
    cached_absmax: float,
    gate: float,
    wb: WeightBounds | None = None,
) -> float | None:
    """A bound on max |k| and |v| of the new tokens when the bounds prove that nothing can
    overflow: not K/V in the cache's dtype, not a score against the new and the cached keys
    (cached_absmax bounds those, and the cached values), not the output, which averages
    every value seen. None when they cannot prove it. wb: the module's weight_bounds, when
    the caller read them once for a batch.

    The bounds are projected_bounds, bound_crossed and output_bound, computed here from
    constants kept per version of the weights and cache dtype (_constants): the same
    floating-point operations in the same order, without their calls (this runs on every
    step)."""
    return clears(clearance(hosted, cache_dtype, wb), input_absmax, cached_absmax, gate)


def clearance(
    hosted: HostedModel, cache_dtype: torch.dtype, wb: WeightBounds | None = None
) -> tuple:
    """cleared()'s constants for the module's current weights (wb: its weight_bounds, when
    the caller read them) and cache_dtype: read once for a batch, then clears() per row."""
    module = hosted.module
    wb = weight_bounds(module) if wb is None else wb
    held = module.__dict__.get("_clearance")
    c = None if held is None else held.get(cache_dtype)
    if c is None or c[0] is not wb or c[1] is not hosted.dtype:
        c = _constants(hosted, cache_dtype, wb)
    return c


def clears(c: tuple, input_absmax: float, cached_absmax: float, gate: float) -> float | None:
    """cleared() with its constants c (clearance)."""
    if c[2] is None:  # multi-head latent attention: its own bounds
        return latent_cleared(c, input_absmax, cached_absmax, gate)
    _, _, sqrt_e, turn, q_fixed, q_row, q_bias, k_fixed, k_row, k_bias = c[:10]
    v_fixed, v_row, v_bias, limit, crossed_at, out_limit, head_dim, o_row, o_bias = c[10:]
    x_norm = sqrt_e * input_absmax
    q_raw, k_raw, v_raw = x_norm * q_row + q_bias, x_norm * k_row + k_bias, x_norm * v_row + v_bias
    q_b = turn * (q_fixed or q_raw)
    k_b = turn * (k_fixed or k_raw)
    v_b = v_fixed or v_raw
    # A norm's bound holds only for a finite projection: an inf in the model's dtype before
    # a q, k or v norm is NaN after it (NaN scores, which a fused kernel may turn into zero
    # attention: a finite, wrong answer; NaN values in the cache).
    if (q_fixed or k_fixed or v_fixed) and not max(q_raw, k_raw, v_raw) < out_limit:
        return None
    # Every tensor on the way must fit too, not only K/V and the output: the input in the
    # model's dtype, q in the model's and the cache's (the kernels round it to the cache's),
    # the gate and the gated heads (a huge gate on tiny values times a small Wo clears the
    # output's bound, yet is inf in float16 and 0 * inf is NaN).
    v_all = max(v_b, cached_absmax)  # the output averages every value the query sees
    if (
        not max(q_b, k_b, v_b) < limit
        or not max(input_absmax, gate, gate * v_all) < out_limit
        or not head_dim * q_b * max(k_b, cached_absmax) * MARGIN < crossed_at  # bound_crossed
        or not o_row * gate * v_all + o_bias < out_limit  # output_bound
    ):
        return None
    return max(k_b, v_b)


def latent_cleared(
    c: tuple, input_absmax: float, cached_absmax: float, gate: float
) -> float | None:
    """clears() of multi-head latent attention (c: its clearance, whose third element is
    None): the same checks over its own tensors (model/mla_bounds.py LatentBounds): the hidden ones
    before q' (q_a(x) or q(x), kv_a(x), the normed q and q_b's output) in the model's dtype,
    q' and k' = v in the model's and the cache's, every score against the new and the
    cached keys, the gated heads, their merge through W_uv, and the output; and what the
    expanded form (mla.expands: a prompt) makes besides, every head's keys W_uk c and values
    W_uv c in the model's dtype, so that a step they clear may run either way."""
    _, _, _, lb, embed_dim, limit, out_limit = c
    b = latent_maxima(input_absmax, embed_dim, lb)
    k_b = b.k
    v_all = worst(k_b, cached_absmax)  # the output averages every value the query sees
    expanded = worst(lb.uk_l1, lb.uv_l1) * v_all  # (max |c| <= v_all): k_nope, v
    merged = lb.uv_l1 * gate * v_all  # each head's W_uv y_lat
    # (each compared on its own: a NaN, inf * 0 of a bound that bounds nothing, fails)
    if not (
        b.q < limit
        and k_b < limit
        and input_absmax < out_limit
        and b.hidden < out_limit
        and gate < out_limit
        and gate * v_all < out_limit
        and merged < out_limit
        and expanded < out_limit
        and b.score(cached_absmax) < limit
        and lb.o_row_l1 * merged + lb.o_bias < out_limit
    ):
        return None
    return k_b


def _constants(hosted: HostedModel, cache_dtype: torch.dtype, wb: WeightBounds) -> tuple:
    """cleared()'s constants for the module's weights (wb), its dtype and cache_dtype, kept
    on the module per cache dtype until its weights change."""
    cfg = hosted.spec.attention
    # A scale above 1, or a soft-cap below 1, grows the scores.
    limit = score_limit(hosted.dtype, cache_dtype) / MARGIN / cfg.score_factor
    out_limit = torch.finfo(hosted.dtype).max / MARGIN
    # Queries scaled by position (query_scale): the scale grows with the position, so the
    # largest one any query of the model may have, at max_seq_len - 1 (no session and no
    # request is longer), bounds them all.
    s = 1.0
    if cfg.query_scale is not None:
        s = cfg.query_scale.factor(hosted.spec.max_seq_len - 1)
    if wb.latent is not None:  # (latent_cleared's; q' = [rope(q_rope); q_lat] scaled whole)
        lb = wb.latent
        if s != 1.0:
            # The expanded form (a prompt's heads decompressed) scales q_nope itself, which
            # `hidden` bounds (q_b's or q's output): scaled too, so a scaled q_nope past the
            # dtype's max is not cleared (q_a's and kv_a's outputs, unscaled, only more
            # strictly).
            lb = replace(
                lb,
                **{
                    name: getattr(lb, name) * s
                    for name in ("q_row", "q_bias", "rope_l1_row", "rope_l1_bias")
                    + ("latent_l1_row", "latent_l1_bias")
                    + ("hidden_row", "hidden_bias", "hidden_fixed")
                },
            )
        c = (wb, hosted.dtype, None, lb, cfg.embed_dim, limit, out_limit)
        return _keep(hosted, cache_dtype, c)
    c = (
        wb,
        hosted.dtype,
        math.sqrt(cfg.embed_dim),  # ||x||_2 <= sqrt(E) max|x| (projected_bounds)
        wb.rotation if cfg.rope is not None else 1.0,
        wb.q_norm * s,
        wb.q_row * s,
        wb.q_bias * s,
        wb.k_norm,
        wb.k_row,
        wb.k_bias,
        wb.v_norm,
        wb.v_row,
        wb.v_bias,
        limit,
        limit * MARGIN,
        out_limit,
        cfg.head_dim,
        wb.o_row_l1,
        wb.o_bias,
    )
    return _keep(hosted, cache_dtype, c)


def _keep(hosted: HostedModel, cache_dtype: torch.dtype, c: tuple) -> tuple:
    """c kept on the module for cache_dtype (clearance reads it back)."""
    module = hosted.module
    held = module.__dict__.get("_clearance")
    if held is None:
        held = module._clearance = {}
    held[cache_dtype] = c
    return c
