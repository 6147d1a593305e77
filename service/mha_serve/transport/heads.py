"""AnalyzeHeadsResponse from the engine's head analysis (conversion only)."""

from __future__ import annotations

from mha_client.api import attention_pb2 as pb
from mha_serve.engine.requests import HeadReport
from mha_serve.transport.tensors import to_proto


def heads_response(model: str, report: HeadReport) -> pb.AnalyzeHeadsResponse:
    response = pb.AnalyzeHeadsResponse(model=model, compute_ms=report.compute_ms)
    for h, (entropy, peak, importance) in enumerate(
        zip(report.mean_entropy, report.mean_max_weight, report.importance, strict=True)
    ):
        response.heads.add(
            head=h, mean_entropy=entropy, mean_max_weight=peak, importance=importance
        )
    for step in report.pruning:
        response.pruning.add(
            num_pruned=step.num_pruned,
            head=step.head,
            output_error=step.output_error,
            head_mask=step.head_mask,
        )
    if report.weights is not None:
        response.attention_weights.CopyFrom(to_proto(report.weights))
    return response
