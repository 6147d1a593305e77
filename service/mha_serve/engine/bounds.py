"""Whether a request's inputs prove that nothing it computes can overflow: the bounds from its
max |input| and the model's weights (mha_serve.model.overflow), checked before the forward.
A request they clear needs no look at its tensors at all (no maxima, no device sync); one
they cannot clear is measured (the model's OverflowCheck, the step's maxima). A session's
cached K/V count through their KeyBound, kept beside the session's record."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from mha_serve.engine.types import HostedModel
from mha_serve.model.overflow import (
    MARGIN,
    WeightBounds,
    bound_crossed,
    output_bound,
    projected_bounds,
    score_limit,
    weight_bounds,
)


@dataclass(frozen=True, slots=True)
class KeyBound:
    """A bound on max |k| and |v| over every key and value a session holds or held since it
    was last emptied: the overflow checks read it instead of the cached tensors. The engine's
    state of the session, which the cache carries on its record (Session.engine_state)
    without reading it: frozen, so a fork shares its parent's; an upper bound, so it holds
    for any prefix of the K/V (a truncate keeps it)."""

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


@functools.cache
def _limits(dtype: torch.dtype, cache_dtype: torch.dtype) -> tuple[float, float]:
    """(score limit over MARGIN, largest output over MARGIN) for a model and cache dtype."""
    return score_limit(dtype, cache_dtype) / MARGIN, torch.finfo(dtype).max / MARGIN


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
    the caller read them once for a batch."""
    cfg = hosted.spec.attention
    wb = weight_bounds(hosted.module) if wb is None else wb
    limit, out_limit = _limits(hosted.dtype, cache_dtype)
    limit /= cfg.score_factor  # a scale above 1, or a soft-cap below 1, grows the scores
    q_b, k_b, v_b = projected_bounds(input_absmax, cfg.embed_dim, wb, rotary=cfg.rope is not None)
    # Every tensor on the way must fit too, not only K/V and the output: the input in the
    # model's dtype, q in the model's and the cache's (the kernels round it to the cache's),
    # the gate and the gated heads (a huge gate on tiny values times a small Wo clears the
    # output's bound, yet is inf in float16 and 0 * inf is NaN).
    v_all = max(v_b, cached_absmax)  # the output averages every value the query sees
    if (
        not max(q_b, k_b, v_b) < limit
        or not max(input_absmax, gate, gate * v_all) < out_limit
        or bound_crossed(q_b, max(k_b, cached_absmax), cfg.head_dim, limit * MARGIN)
        or not output_bound(v_all, gate, wb) < out_limit
    ):
        return None
    return max(k_b, v_b)
