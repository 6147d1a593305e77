"""AnalyzeHeadsResponse from the engine's head analysis (conversion only)."""

from __future__ import annotations

from mha_client.api import attention_pb2 as pb
from mha_serve.model.heads import HeadAnalysis
from mha_serve.transport.tensors import to_proto


def heads_response(
    model: str, analysis: HeadAnalysis, compute_ms: float
) -> pb.AnalyzeHeadsResponse:
    response = pb.AnalyzeHeadsResponse(model=model, compute_ms=compute_ms)
    for h, (entropy, peak, importance) in enumerate(
        zip(analysis.mean_entropy, analysis.mean_max_weight, analysis.importance, strict=True)
    ):
        response.heads.add(
            head=h, mean_entropy=entropy, mean_max_weight=peak, importance=importance
        )
    for step in analysis.pruning:
        response.pruning.add(
            num_pruned=step.num_pruned,
            head=step.head,
            output_error=step.output_error,
            head_mask=step.head_mask,
        )
    if analysis.weights is not None:
        response.attention_weights.CopyFrom(to_proto(analysis.weights.contiguous()))
    return response
