"""How a batch of session steps attends over the paged KV cache (Sessions._forward, after
the new K/V are written): in one kernel per group of similar lengths, or one per session.

Batched: the rows are grouped by how many keys they read; each group's K/V are copied by
one index_select each (KVCache.gather) into (B, KVH, S_max, D) and attend in one SDPA with a
mask (MultiHeadAttention.attend_padded). A row joins a group only while it reads at least
BATCHED_MIN_FILL of the group's longest read, so padding at most doubles what a row
costs, and an outlier (one long session among short ones) is a group of its own; a group
of one reads its session in place (no copy), as the per-session path does.

Per session: attend_cached runs one kernel per session over views of the cache. Always for
steps that ask for weights; on CUDA the batched path is the default (a kernel per session
left the GPU at 1-5% of its memory bandwidth at 64 sessions, docs/benchmarks-gpu.md); on
the CPU per session is (gathering copies every session's K/V each step, and there that
copy costs more than the kernels it saves: bench/engine_step.py --sessions 64).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mha_serve.cache import KVCache, Reservation
from mha_serve.model import AttentionOutput, MultiHeadAttention
from mha_serve.transfer import list_tensor

# A row joins a padded group only while it reads at least this share of the group's
# longest read (so at most half of a group's keys are padding).
BATCHED_MIN_FILL = 0.5
# K and V one padded group copies at most (larger batches split into more groups): the
# gather's buffers are held besides the cache's budget.
MAX_GATHER_BYTES = 256 << 20
# A padded group's width is rounded up to this many keys (unless every row reads the same
# number): CUDA's memory-efficient kernel wants its mask's rows aligned so, else it pads a copy.
WIDTH_MULTIPLE = 16


def batched_by_default(device: torch.device) -> bool:
    """Whether steps without weights attend batched on this device when not told."""
    return device.type == "cuda"


def plan_groups(
    key_lengths: Sequence[int],
    bytes_per_token: int,
    *,
    min_fill: float = BATCHED_MIN_FILL,
    max_bytes: int = MAX_GATHER_BYTES,
) -> tuple[list[list[int]], list[int]]:
    """Rows (indices into key_lengths, ascending within a group) of each padded group, and
    the rows that attend alone: longest first, a row joins the current group while it reads
    at least min_fill of the group's longest and the group's padded K/V stay within
    max_bytes."""
    order = sorted(range(len(key_lengths)), key=lambda i: -key_lengths[i])
    groups: list[list[int]] = []
    current: list[int] = []
    for i in order:
        if current:
            longest = key_lengths[current[0]]
            width = -(-longest // WIDTH_MULTIPLE) * WIDTH_MULTIPLE
            fits = (len(current) + 1) * width * bytes_per_token <= max_bytes
            if key_lengths[i] >= min_fill * longest and fits:
                current.append(i)
                continue
            groups.append(current)
        current = [i]
    if current:
        groups.append(current)
    alone = sorted(g[0] for g in groups if len(g) == 1)
    return [sorted(g) for g in groups if len(g) > 1], alone


def attend_steps(
    module: MultiHeadAttention,
    cache: KVCache,
    q: torch.Tensor,
    reservations: Sequence[Reservation],
    new_tokens: Sequence[int],
    *,
    batched: bool,
    need_weights: bool = False,
    weight_heads: Sequence[int] | None = None,
    head_mask: torch.Tensor | None = None,
    min_fill: float = BATCHED_MIN_FILL,
) -> AttentionOutput:
    """The steps' attention over their sessions' cached K/V (the step's own already
    written): q (B, H, T, D) as `project` returns it; output (B, T, E), padded tokens' rows
    zero. batched: in padded groups (plan_groups, min_fill) where a step asks for no
    weights."""
    B = q.shape[0]
    if need_weights or not batched or B == 1:
        return _per_session(
            module, cache, q, reservations, new_tokens, need_weights, weight_heads, head_mask
        )
    lengths = [r.start + r.num_tokens - r.read_start for r in reservations]
    groups, alone = plan_groups(lengths, cache.bytes_per_token, min_fill=min_fill)
    if len(groups) == 1 and not alone:  # every row in one group, in order: no scatter
        return _padded(module, cache, q, reservations, new_tokens, head_mask)
    parts = [(rows, _padded) for rows in groups] + ([(alone, _per_session)] if alone else [])
    # Every part's rows in one index tensor (one copy to the device, no wait), cut per part.
    indices = list_tensor([i for rows, _ in parts for i in rows], q.device)  # (B,)
    out = None
    at = 0
    for rows, attend in parts:
        index = indices.narrow(0, at, len(rows))
        at += len(rows)
        y = attend(
            module,
            cache,
            q.index_select(0, index),
            [reservations[i] for i in rows],
            [new_tokens[i] for i in rows],
            head_mask=head_mask,
        ).output
        if out is None:
            out = y.new_zeros(B, *y.shape[1:])  # (B, T, E)
        out.index_copy_(0, index, y)
    return AttentionOutput(output=out, weights=None)


def _padded(
    module: MultiHeadAttention,
    cache: KVCache,
    q: torch.Tensor,
    reservations: Sequence[Reservation],
    new_tokens: Sequence[int],
    head_mask: torch.Tensor | None = None,
) -> AttentionOutput:
    """One group: its K/V gathered into one padded batch, one attention kernel."""
    lengths = [r.start + r.num_tokens - r.read_start for r in reservations]
    width = max(lengths)
    if any(n != width for n in lengths):
        width = -(-width // WIDTH_MULTIPLE) * WIDTH_MULTIPLE
    reads = [
        (r.block_table, r.read_start, r.start + r.num_tokens, r.first_block) for r in reservations
    ]
    keys, values = cache.gather(reads, width)  # (B, KVH, width, D) each
    return module.attend_padded(
        q,
        keys,
        values,
        past_lengths=[r.start for r in reservations],
        new_lengths=list(new_tokens),
        first_keys=[r.read_start for r in reservations],
        head_mask=head_mask,
    )


def _per_session(
    module: MultiHeadAttention,
    cache: KVCache,
    q: torch.Tensor,
    reservations: Sequence[Reservation],
    new_tokens: Sequence[int],
    need_weights: bool = False,
    weight_heads: Sequence[int] | None = None,
    head_mask: torch.Tensor | None = None,
) -> AttentionOutput:
    """One kernel per session over its K/V read in place (a copy only for a session whose
    blocks are not consecutive)."""
    kv = [
        cache.read(
            r.block_table, r.start + r.num_tokens, start=r.read_start, first_block=r.first_block
        )
        for r in reservations
    ]
    return module.attend_cached(
        q,
        kv,
        past_lengths=[r.start for r in reservations],
        new_lengths=list(new_tokens),
        need_weights=need_weights,
        weight_heads=weight_heads,
        head_mask=head_mask,
        first_keys=[r.read_start for r in reservations],
    )
