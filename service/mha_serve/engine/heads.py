"""Head analysis of a hosted model over the caller's inputs: the engine's side of the
AnalyzeHeads RPC (validation as for Attend, then mha_serve.model.heads)."""

from __future__ import annotations

import dataclasses
import time

import torch

from mha_serve.engine.checks import scores_overflow_error
from mha_serve.engine.engine import Engine
from mha_serve.engine.errors import InvalidRequest, TooLarge
from mha_serve.engine.prepare import NARROW_WEIGHTS
from mha_serve.engine.requests import AttendRequest, HeadReport, PruningLevel
from mha_serve.engine.types import array_of
from mha_serve.model.heads import analyze_heads

# The analysis reads every head's weights over every query row of the whole batch.
NARROW_ANALYSIS = (
    "the head analysis reads every head's weights over every query row: send fewer or "
    "shorter sequences, or raise the model's max_weights_bytes"
)


def analyze(engine: Engine, request: AttendRequest, *, include_weights: bool) -> HeadReport:
    """The analysis of request's model over its inputs (stateless: no session, no head_mask
    of its own). The weights the analysis reads count against the model's max_weights_bytes
    like an Attend asking for all heads."""
    if request.session_id is not None:
        raise InvalidRequest("head analysis runs on stateless inputs; leave session_id empty")
    if request.head_mask is not None:
        raise InvalidRequest("head analysis masks heads itself; leave head_mask empty")
    if request.need_weights:
        raise InvalidRequest(
            "head analysis reads every head's weights itself; leave attend.weights unset "
            "(include_weights returns sequence 0's)"
        )
    request = dataclasses.replace(
        request, need_weights=True, weight_heads=None, query_start=0, query_end=0
    )
    try:
        p = engine.prepare(request)
    except TooLarge as e:  # an Attend's advice (weights.heads, ...) does not apply here
        raise TooLarge(str(e).replace(NARROW_WEIGHTS, NARROW_ANALYSIS)) from None
    hosted = p.hosted
    start = time.perf_counter()
    batch, seq_len, _ = request.inputs.shape
    x = p.inputs.to(hosted.device, hosted.dtype)
    lengths = None
    if request.lengths is not None and any(n != seq_len for n in request.lengths):
        lengths = torch.tensor(request.lengths, dtype=torch.long, device=hosted.device)
    with torch.inference_mode():
        if hosted.module(x, lengths=lengths, causal=request.causal).overflow.rows():
            raise scores_overflow_error(hosted.dtype)
        analysis = analyze_heads(
            hosted.module,
            x,
            lengths=lengths,
            causal=request.causal,
            include_weights=include_weights,
        )
    weights = analysis.weights
    return HeadReport(
        mean_entropy=analysis.mean_entropy,
        mean_max_weight=analysis.mean_max_weight,
        importance=analysis.importance,
        pruning=[
            PruningLevel(s.num_pruned, s.head, s.output_error, s.head_mask)
            for s in analysis.pruning
        ],
        weights=None if weights is None else array_of(weights.cpu().contiguous()),
        compute_ms=(time.perf_counter() - start) * 1e3,
    )
