"""Head pruning that pays: a smaller model without chosen heads (their rows of the Q/K/V
projections, their columns of the output projection), which served equals the original
with those heads masked (head_mask 0), at a compute and KV-cache cost in proportion to the
heads kept. Which heads: a list, or the least important ones of the head analysis
(model/heads.py), query heads one by one or, for GQA, whole KV groups. Imports only torch."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from .attention import MultiHeadAttention
from .config import AttentionConfig

UNITS = ("head", "group")


def kept_heads(config: AttentionConfig, heads: Sequence[int]) -> tuple[list[int], list[int]]:
    """(query heads kept, KV heads kept) without query heads `heads`: a KV head goes with
    the last query head of its group. ValueError when the result is not a model: every
    head gone, a head out of range or twice, groups left unequal (GQA shares one K/V head
    among the same number of query heads in every group), or a q/k norm over the whole
    projection (OLMo-2), where every head's normalisation depends on the others."""
    H, KVH, G = config.num_heads, config.num_kv_heads, config.group_size
    drop = [int(h) for h in heads]
    bad = sorted({h for h in drop if not 0 <= h < H})
    if bad:
        raise ValueError(f"heads {bad} are out of range: the model has query heads 0..{H - 1}")
    if len(set(drop)) != len(drop):
        raise ValueError(f"heads to remove {drop} name a head twice")
    if not drop:
        raise ValueError("no heads to remove: name at least one")
    if len(drop) == H:
        raise ValueError(f"removing all {H} heads leaves no model; keep at least one")
    if config.qk_norm is not None and config.qk_norm.scope == "projection":
        raise ValueError(
            "this model's q/k norm (qk_norm scope 'projection', as OLMo-2's) normalises all "
            "heads' values together: removing a head changes every other head's output, so "
            "the result cannot equal the masked model; mask heads with head_mask instead"
        )
    if config.mla is not None:
        raise ValueError(
            "this model is multi-head latent attention (mla): its query heads share one "
            "latent K/V and its weights are laid out per head in q_b and kv_b, which head "
            "pruning does not cut yet; mask heads with head_mask instead"
        )
    if config.alibi:
        raise ValueError(
            "this model's ALiBi slopes come from its head count (alibi): removing a head "
            "changes every other head's slope, so the result cannot equal the masked model; "
            "mask heads with head_mask instead"
        )
    q_kept = [h for h in range(H) if h not in set(drop)]
    per_group = [sum(1 for h in q_kept if h // G == g) for g in range(KVH)]
    left = sorted({n for n in per_group if n})
    if len(left) > 1:
        raise ValueError(
            f"removing heads {sorted(drop)} leaves groups of unequal size (query heads kept "
            f"per KV group: {per_group}): GQA shares one K/V head among the same number of "
            "query heads in every group; remove the same number from each group, or whole "
            "groups"
        )
    return q_kept, [g for g in range(KVH) if per_group[g]]


def prune_heads(module: MultiHeadAttention, heads: Sequence[int]) -> MultiHeadAttention:
    """A copy of module without query heads `heads` (kept_heads says which K/V heads go
    with them), in module's dtype and device, in eval mode. Served, it equals module with
    head_mask 0 at `heads`: their outputs were multiplied by 0 before wo, and now are not
    computed at all (wo's bias stays)."""
    c = module.config
    H, KVH, D = c.num_heads, c.num_kv_heads, c.head_dim
    q_kept, kv_kept = kept_heads(c, heads)
    config = dataclasses.replace(c, num_heads=len(q_kept), num_kv_heads=len(kv_kept))

    def rows(t: torch.Tensor, keep: list[int]) -> torch.Tensor:  # (n*D, ...) -> (len(keep)*D, ...)
        return t.reshape(-1, D, *t.shape[1:])[keep].reshape(len(keep) * D, *t.shape[1:])

    def qkv(t: torch.Tensor) -> torch.Tensor:  # weight (qkv_dim, E) or bias (qkv_dim,)
        q, k, v = t.detach().split([H * D, KVH * D, KVH * D])
        return torch.cat([rows(q, q_kept), rows(k, kv_kept), rows(v, kv_kept)])

    wo = module.wo.weight.detach()  # (E, H*D): columns by head
    state = {
        "wqkv.weight": qkv(module.wqkv.weight),
        "wo.weight": rows(wo.t(), q_kept).t(),
    }
    if c.bias:
        state["wqkv.bias"] = qkv(module.wqkv.bias)
        state["wo.bias"] = module.wo.bias.detach()
    if c.qk_norm is not None and c.qk_norm.gain:  # per head: (D,) gains every head shares
        state["q_norm"], state["k_norm"] = module.q_norm.detach(), module.k_norm.detach()
    if c.sinks:  # one per query head: the kept heads' (each head's softmax is its own)
        state["sinks"] = module.sinks.detach()[q_kept]
    if c.output_gate:  # rows by query head (each gates its own head): the kept heads'
        per_head = c.gate_width // H  # (D, or 1 with output_gate_per_head)

        def gate_rows(t: torch.Tensor) -> torch.Tensor:  # (H*g, ...) -> (len(q_kept)*g, ...)
            return t.reshape(H, per_head, *t.shape[1:])[q_kept].reshape(-1, *t.shape[1:])

        state["wgate.weight"] = gate_rows(module.wgate.weight.detach())
        if c.bias:
            state["wgate.bias"] = gate_rows(module.wgate.bias.detach())
    w = module.wqkv.weight
    out = MultiHeadAttention(config, device=w.device, dtype=w.dtype)
    out.load_state_dict({k: t.contiguous() for k, t in state.items()})
    return out.eval()


def default_unit(config: AttentionConfig) -> str:
    """GQA prunes whole KV groups by default (query heads of a group only in equal numbers
    per group); MHA and MQA prune query heads."""
    return "group" if 1 < config.num_kv_heads < config.num_heads else "head"


def least_important(
    config: AttentionConfig,
    k: int,
    *,
    unit: str,
    importance: Sequence[float],
    group_importance: Sequence[float] | None = None,
) -> list[int]:
    """The query heads to remove for "drop the k least important", ties to the lower index:
    unit "head": k query heads by importance (GQA: k / num_kv_heads from each group, the
    least important of each, so that groups stay equal); unit "group": the query heads of
    the k KV groups least important as a whole (group_importance: the output error with a
    group's heads masked together)."""
    H, KVH, G = config.num_heads, config.num_kv_heads, config.group_size
    if unit not in UNITS:
        raise ValueError(f"unit {unit!r} is not one of {', '.join(UNITS)}")
    if len(importance) != H:
        raise ValueError(f"importance has {len(importance)} values for {H} query heads")
    if unit == "group":
        if KVH == 1:
            raise ValueError("an MQA model has one KV group: remove query heads (unit 'head')")
        if group_importance is None or len(group_importance) != KVH:
            raise ValueError(f"unit 'group' needs one group_importance per KV head ({KVH})")
        if not 1 <= k < KVH:
            raise ValueError(f"k must be in 1..{KVH - 1} KV groups (the model has {KVH}), got {k}")
        groups = sorted(range(KVH), key=lambda g: (group_importance[g], g))[:k]
        return sorted(h for g in groups for h in range(g * G, (g + 1) * G))
    if not 1 <= k < H:
        raise ValueError(f"k must be in 1..{H - 1} query heads (the model has {H}), got {k}")
    if G == 1 or KVH == 1:  # MHA (a head is a group) or MQA (one group): any k heads
        return sorted(sorted(range(H), key=lambda h: (importance[h], h))[:k])
    if k % KVH:
        raise ValueError(
            f"k {k} query heads of a GQA model with {KVH} KV groups: k must be a multiple "
            f"of {KVH} (the same number from each group), or use unit 'group'"
        )
    drop = []
    for g in range(KVH):
        members = range(g * G, (g + 1) * G)
        drop += sorted(members, key=lambda h: (importance[h], h))[: k // KVH]
    return sorted(drop)


def cost_per_token(config: AttentionConfig, itemsize: int) -> dict[str, int]:
    """What one token costs the model: multiply-adds of its projections (2 FLOPs each; an
    output gate's wgate one more, gate_width x E), of its attention per key it sees (q.k and p.v,
    4 H D), and its KV-cache bytes (K and V)."""
    E, H, KVH, D = config.embed_dim, config.num_heads, config.num_kv_heads, config.head_dim
    gate = 2 * config.gate_width * E
    return {
        "projection_flops": 2 * E * (H + 2 * KVH) * D + 2 * H * D * E + gate,
        "attention_flops_per_key": 4 * H * D,
        "kv_bytes": 2 * KVH * D * itemsize,
    }
