"""Which heads matter: per-head attention statistics, importance by ablation and a pruning
curve (Michel et al. 2019, "Are Sixteen Heads Really Better than One?": mask heads one by
one, least important first, and watch the output move). Imports only torch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import MultiHeadAttention


@dataclass
class PruningStep:
    num_pruned: int  # heads masked at this level
    head: int  # the head masked last, going from the level before to this one
    output_error: float  # relative error of the output against the unmasked output
    head_mask: list[float]  # (H,) the gate to send as head_mask for this level


@dataclass
class HeadAnalysis:
    """Per query head h (index h of each list), over every real query row of the inputs."""

    # nats; log(keys) is uniform attention, 0 one key (with attention sinks: of the row's
    # weights renormalised over its keys, whose sum is what the sink leaves)
    mean_entropy: list[float]
    mean_max_weight: list[float]  # the largest weight of a row (as returned), averaged
    # Relative output error ||y(h masked) - y|| / ||y|| when head h alone is masked.
    importance: list[float]
    pruning: list[PruningStep]  # levels 1..H, least important head first
    weights: torch.Tensor | None  # (H, L0, L0) float32 of sequence 0, its real rows and keys


def output_error(y: torch.Tensor, reference: torch.Tensor) -> float:
    """||y - reference|| / ||reference|| in float64 (padded rows are 0 in both)."""
    ref = reference.detach().double()
    return float((y.detach().double() - ref).norm() / ref.norm().clamp_min(1e-30))


@torch.no_grad()
def analyze_heads(
    module: MultiHeadAttention,
    x: torch.Tensor,
    *,
    lengths: torch.Tensor | None = None,
    causal: bool | None = None,
    include_weights: bool = False,
) -> HeadAnalysis:
    """Statistics of every head over x (B, L, E) with padding by lengths (B,): 2H + 1
    forward passes (H ablations, H pruning levels, the reference with weights)."""
    H = module.config.num_heads
    B, L, _ = x.shape
    full = module(x, lengths=lengths, causal=causal, need_weights=True)
    w = full.weights  # (B, H, L, L) float32, padded rows and keys 0
    real = torch.ones(B, L, dtype=torch.bool, device=x.device)
    if lengths is not None:
        real = torch.arange(L, device=x.device)[None] < lengths.to(x.device)[:, None]  # (B, L)
    rows = real[:, None, :].expand(B, H, L)  # (B, H, L): real query rows
    p = w.double()
    if module.config.sinks:  # rows sum to less than 1: the entropy of where the keys' share goes
        p = p / p.sum(-1, keepdim=True).clamp_min(1e-300)
    row_entropy = -(p * torch.where(p > 0, p.log(), torch.zeros_like(p))).sum(-1)  # (B, H, L)
    row_max = w.double().amax(-1)  # (B, H, L)
    n = rows.sum((0, 2)).double()  # (H,) real rows per head
    entropy = (row_entropy * rows).sum((0, 2)) / n  # (H,)
    max_weight = (row_max * rows).sum((0, 2)) / n  # (H,)

    def error_with(mask: torch.Tensor) -> float:
        y = module(x, lengths=lengths, causal=causal, head_mask=mask).output
        return output_error(y, full.output)

    ones = torch.ones(H, dtype=x.dtype, device=x.device)
    importance = []
    for h in range(H):
        mask = ones.clone()
        mask[h] = 0
        importance.append(error_with(mask))
    order = sorted(range(H), key=lambda h: (importance[h], h))  # least important first
    pruning, mask = [], ones.clone()
    for k, h in enumerate(order, start=1):
        mask[h] = 0
        pruning.append(PruningStep(k, h, error_with(mask), mask.tolist()))
    weights = None
    if include_weights:
        n0 = int(real[0].sum())
        weights = w[0, :, :n0, :n0].float().cpu()  # (H, n0, n0)
    return HeadAnalysis(
        mean_entropy=entropy.tolist(),
        mean_max_weight=max_weight.tolist(),
        importance=importance,
        pruning=pruning,
        weights=weights,
    )


@torch.no_grad()
def group_importance(
    module: MultiHeadAttention,
    x: torch.Tensor,
    *,
    lengths: torch.Tensor | None = None,
    causal: bool | None = None,
) -> list[float]:
    """Per KV head g: ||y(g's query heads masked together) - y|| / ||y||, the importance of
    a GQA group as a whole (the unit that removes a K/V head): KVH + 1 forward passes."""
    c = module.config
    full = module(x, lengths=lengths, causal=causal).output
    errors = []
    for g in range(c.num_kv_heads):
        mask = torch.ones(c.num_heads, dtype=x.dtype, device=x.device)
        mask[g * c.group_size : (g + 1) * c.group_size] = 0
        y = module(x, lengths=lengths, causal=causal, head_mask=mask).output
        errors.append(output_error(y, full))
    return errors
