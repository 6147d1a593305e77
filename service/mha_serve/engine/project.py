"""The projection of a batch of session steps, their new K/V written into the cache: what
every step does before attending (Sessions._forward, the lone step, engine/prompts.py)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mha_serve.cache import KVCache, Reservation
from mha_serve.engine.types import HostedModel
from mha_serve.transfer import list_tensor


def project_and_append(
    hosted: HostedModel,
    cache: KVCache,
    x: torch.Tensor,
    reservations: Sequence[Reservation],
    *,
    expanded: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v (B, H|KVH, T, D) of the steps' new tokens x (B, T, E), their K/V written into
    the cache at each reservation's slots (in the cache's dtype: a narrower kv_cache_dtype is
    stored rounded). expanded (mla): q in the expanded form (project_expanded), the cache's
    k' = v as ever. Under inference_mode."""
    positions = None  # only rotary and query-scaled models use them (no cost otherwise)
    cfg = hosted.spec.attention
    if cfg.rope is not None or cfg.query_scale is not None:
        # Each session's new tokens continue from its cached length; the cache keeps K
        # rotated at these absolute positions.
        T = x.shape[1]
        if len(reservations) == 1:
            start = reservations[0].start
            positions = torch.arange(start, start + T, device=x.device)[None]  # (1, T)
        else:
            starts = list_tensor([r.start for r in reservations], x.device)  # (B,)
            positions = starts[:, None] + torch.arange(T, device=x.device)  # (B, T)
    if expanded:
        q, k_new = hosted.module.project_expanded(x, positions)  # (B, H, T, D_x), (B, 1, T, R + C)
        v_new = k_new
    else:
        q, k_new, v_new = hosted.module.project(x, positions)
    if k_new.dtype != cache.dtype:
        same = v_new is k_new  # values that are the keys (mla): still one tensor, rounded once
        k_new = k_new.to(cache.dtype)
        v_new = k_new if same else v_new.to(cache.dtype)
    cache.append(k_new, v_new, [r.slots for r in reservations])
    return q, k_new, v_new
