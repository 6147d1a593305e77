"""Head analysis from the SDK: which heads of a served model matter over your inputs.

from mha_client.heads import analyze_heads, save_pruning_curve
report = analyze_heads(client, "minilm0", x, include_weights=True)
report.least_important(3)          # heads to prune first
report.pruning[2].head_mask        # the head_mask that prunes those 3 (for attend)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mha_client import ops
from mha_client.api import attention_pb2 as pb
from mha_client.heatmap import require_matplotlib
from mha_client.messages import build_attend_request
from mha_client.tensors import from_proto


@dataclass
class HeadStat:
    head: int
    mean_entropy: float  # nats over real query rows; log(keys) is uniform attention
    mean_max_weight: float  # a row's largest weight, averaged
    importance: float  # relative output change when this head alone is masked


@dataclass
class PruningLevel:
    num_pruned: int
    head: int  # the head masked last to reach this level
    output_error: float  # relative output error with num_pruned heads masked
    head_mask: list[float]  # send as head_mask to serve this level


@dataclass
class HeadReport:
    model: str
    heads: list[HeadStat]
    pruning: list[PruningLevel]
    weights: np.ndarray | None = None  # (H, L0, L0) of sequence 0, when asked
    compute_ms: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def least_important(self, n: int) -> list[int]:
        """The n heads the pruning curve masks first."""
        return [level.head for level in self.pruning[:n]]

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "compute_ms": self.compute_ms,
            "heads": [vars(h) for h in self.heads],
            "pruning": [vars(p) for p in self.pruning],
        }


def build_heads_request(
    model: str,
    x: np.ndarray,
    *,
    lengths: Sequence[int] | None = None,
    causal: bool | None = None,
    include_weights: bool = False,
) -> pb.AnalyzeHeadsRequest:
    attend = build_attend_request(model, x, lengths=lengths, causal=causal)
    return pb.AnalyzeHeadsRequest(attend=attend, include_weights=include_weights)


def parse_heads_response(resp: pb.AnalyzeHeadsResponse) -> HeadReport:
    weights = None
    if resp.HasField("attention_weights"):
        weights = from_proto(resp.attention_weights)
    return HeadReport(
        model=resp.model,
        heads=[
            HeadStat(h.head, h.mean_entropy, h.mean_max_weight, h.importance) for h in resp.heads
        ],
        pruning=[
            PruningLevel(p.num_pruned, p.head, p.output_error, list(p.head_mask))
            for p in resp.pruning
        ],
        weights=weights,
        compute_ms=resp.compute_ms,
    )


def heads_rpc(
    model: str,
    x: np.ndarray,
    *,
    lengths: Sequence[int] | None = None,
    causal: bool | None = None,
    include_weights: bool = False,
) -> ops.Rpc[HeadReport]:
    request = build_heads_request(
        model, x, lengths=lengths, causal=causal, include_weights=include_weights
    )
    return ops.Rpc("AnalyzeHeads", request, lambda reply, _: parse_heads_response(reply))


def analyze_heads(
    client: Any,
    model: str,
    x: np.ndarray,
    *,
    lengths: Sequence[int] | None = None,
    causal: bool | None = None,
    include_weights: bool = False,
    timeout: float | None = None,
) -> HeadReport:
    """Per-head entropy, peak weight and importance of `model` over x (L, E) or (B, L, E),
    and the pruning curve (AnalyzeHeads). include_weights: sequence 0's weights too.
    client: a Client (an AsyncClient gives an awaitable)."""
    rpc = heads_rpc(model, x, lengths=lengths, causal=causal, include_weights=include_weights)
    return client._run(rpc, timeout)


def save_pruning_curve(report: HeadReport, path: str | Path, title: str | None = None) -> None:
    """PNG: relative output error against heads pruned, each point named by its head."""
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.0), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    xs = [0] + [p.num_pruned for p in report.pruning]
    ys = [0.0] + [p.output_error for p in report.pruning]
    ax.plot(xs, ys, marker="o")
    for p in report.pruning:
        ax.annotate(
            f"h{p.head}",
            (p.num_pruned, p.output_error),
            fontsize=8,
            textcoords="offset points",
            xytext=(3, -10),
        )
    ax.set_xlabel("heads pruned (least important first)")
    ax.set_ylabel("relative output error")
    ax.set_title(title or f"{report.model}: pruning curve")
    ax.grid(alpha=0.3)
    fig.savefig(path, format="png", dpi=100)
