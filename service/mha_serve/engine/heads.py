"""Head analysis of a hosted model over the caller's inputs: the engine's side of the
AnalyzeHeads RPC (validation as for Attend, then mha_serve.model.heads)."""

from __future__ import annotations

import dataclasses
import time

import torch

from mha_serve.engine.engine import Engine
from mha_serve.engine.errors import InvalidRequest, scores_overflow_error
from mha_serve.engine.types import AttendCall
from mha_serve.model.heads import HeadAnalysis, analyze_heads


def analyze(
    engine: Engine, call: AttendCall, *, include_weights: bool
) -> tuple[HeadAnalysis, float]:
    """(analysis, compute_ms) of call's model over call's inputs (stateless: no session,
    no head_mask of its own). The weights the analysis reads count against the model's
    max_weights_bytes like an Attend asking for all heads."""
    if call.session_id is not None:
        raise InvalidRequest("head analysis runs on stateless inputs; leave session_id empty")
    if call.head_mask is not None:
        raise InvalidRequest("head analysis masks heads itself; leave head_mask empty")
    call = dataclasses.replace(
        call, need_weights=True, weight_heads=None, query_start=0, query_end=0
    )
    hosted = engine.validate(call)
    start = time.perf_counter()
    batch, seq_len, _ = call.inputs.shape
    x = call.inputs.to(hosted.device, hosted.dtype)
    lengths = None
    if call.lengths is not None and any(n != seq_len for n in call.lengths):
        lengths = torch.tensor(call.lengths, dtype=torch.long, device=hosted.device)
    with torch.inference_mode():
        if hosted.module(x, lengths=lengths, causal=call.causal).overflow:
            raise scores_overflow_error(hosted.dtype)
        analysis = analyze_heads(
            hosted.module, x, lengths=lengths, causal=call.causal, include_weights=include_weights
        )
    return analysis, (time.perf_counter() - start) * 1e3
