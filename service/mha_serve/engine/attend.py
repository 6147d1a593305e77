"""How a batch of session steps attends over the paged KV cache (Sessions._forward, after
the new K/V are written): in one kernel per group of similar lengths, or one per session.

Batched: the rows are grouped by how many keys they read; each group's K/V are copied by
one index_select each (KVCache.gather) into (B, KVH, S_max, D) and attend in one SDPA with a
mask (MultiHeadAttention.attend_padded). A row joins a group only while it reads at least
BATCHED_MIN_FILL of the group's longest read, so padding at most doubles what a row
costs, and an outlier (one long session among short ones) is a group of its own; a group
of one reads its session in place (no copy), as the per-session path does.

In place (flash decode, CUDA): a batch of decode steps (one token each, no head mask) of a
model flash attention can run (flash_decode_unsupported) reads every session whose read
lies in consecutive blocks where it lies, in one kernel: FlashAttention's varlen forward
over the cache viewed token-major (KVCache.by_token), each session's first slot and length
given (cu_seqlens_k, seqused_k); no copy, no mask, no padding. Rows whose blocks are not
consecutive attend as above. Off unless asked (Sessions' flash_decode): not yet measured
served on a GPU.

Per session: attend_cached runs one kernel per session over views of the cache. Always for
steps that ask for weights; on CUDA the batched path is the default (a kernel per session
left the GPU at 1-5% of its memory bandwidth at 64 sessions, docs/benchmarks-gpu.md); on
the CPU per session is (gathering copies every session's K/V each step, and there that
copy costs more than the kernels it saves: bench/engine_step.py --sessions 64).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

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


# (q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_k, scale) -> (B, H, D): flash_varlen's
# signature; tests on the CPU pass a plain reference of its semantics.
FlashKernel = Callable[..., torch.Tensor]


class FlashDecodeFailed(RuntimeError):
    """The flash kernel raised (its error is the cause): nothing was written, so the same
    rows can attend again without it."""


def batched_by_default(device: torch.device) -> bool:
    """Whether steps without weights attend batched on this device when not told."""
    return device.type == "cuda"


def flash_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    used: torch.Tensor,
    max_k: int,
    scale: float,
) -> torch.Tensor:
    """FlashAttention's varlen forward, torch's own build (CUDA, float16/bfloat16; the same
    operator and arguments in torch 2.11 and 2.13): q (B, H, D), one query per sequence
    (cu_q = 0..B, int32); sequence b's keys and values are rows cu_k[b] .. cu_k[b] +
    used[b] - 1 of k, v (N, KVH, D) (any strides, the last dimension contiguous; with
    seqused_k the kernel reads cu_k[b] as a start only, so sequences may lie anywhere);
    KVH divides H (query head h reads K/V head h // (H / KVH)). Returns (B, H, D)."""
    out = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, 1, max_k, 0.0, False, False, scale=scale, seqused_k=used
    )
    return out[0]


def flash_decode_unsupported(
    config, device: torch.device, dtype: torch.dtype, cache_dtype: torch.dtype
) -> str | None:
    """Why flash decode cannot run a model (None: it can): config an AttentionConfig."""
    if dtype not in (torch.float16, torch.bfloat16):
        return f"flash attention takes float16 or bfloat16 (the model is {str(dtype).removeprefix('torch.')})"
    if cache_dtype != dtype:
        return "the KV cache is narrower than the model (kv_cache_dtype)"
    if config.softcap is not None:
        return "the model soft-caps its scores (softcap), which this kernel call does not"
    if config.sinks:
        return "the model's softmax has attention sinks (sinks), which this kernel call has not"
    if config.alibi:
        return "the model biases its scores by ALiBi (alibi), which this kernel call does not"
    if config.head_dim % 8 or config.head_dim > 256:
        return f"flash attention needs head_dim a multiple of 8 up to 256 (it is {config.head_dim})"
    if device.type != "cuda":
        return f"it needs CUDA (the model is on {device.type})"
    if not torch.backends.cuda.is_flash_attention_available():
        return "this torch build has no flash attention"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        return f"flash attention needs compute capability 8.0 or newer (this GPU: {major}.{minor})"
    return None


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
    B = len(key_lengths)
    if B > 1:  # (most batches) every row joins the longest's group: its loop's answer at once
        longest = max(key_lengths)
        width = -(-longest // WIDTH_MULTIPLE) * WIDTH_MULTIPLE
        if min(key_lengths) >= min_fill * longest and B * width * bytes_per_token <= max_bytes:
            return [list(range(B))], []
    order = sorted(range(B), key=lambda i: -key_lengths[i])
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
    flash: FlashKernel | None = None,
    out_gate: torch.Tensor | None = None,
) -> AttentionOutput:
    """The steps' attention over their sessions' cached K/V (the step's own already
    written): q (B, H, T, D) as `project` returns it, out_gate (B, T, gate_width) as
    `output_gate` returns it (a model with an output gate); output (B, T, E), padded
    tokens' rows zero. batched: in padded groups (plan_groups, min_fill) where a step asks for no
    weights; flash (flash_varlen, for a model flash_decode_unsupported clears): one token
    each and no head mask, the rows whose blocks are consecutive read in place by it."""
    B = q.shape[0]
    if need_weights or not batched or B == 1:
        return _per_session(
            module,
            cache,
            q,
            reservations,
            new_tokens,
            need_weights,
            weight_heads,
            head_mask,
            out_gate=out_gate,
        )
    rest = range(B)
    parts: list = []
    if flash is not None and head_mask is None and q.shape[2] == 1:
        # The kernel gets no mask: each row reads from its token's first key on (its
        # window's, which read_start may precede), to its own.
        W = module.config.sliding_window
        reads = [
            (
                r.block_table,
                r.read_start if W is None else max(r.read_start, r.start + 1 - W),
                r.start + 1,
                r.first_block,
            )
            for r in reservations
        ]
        firsts = cache.runs(reads)
        counts = [length - start for _, start, length, _ in reads]
        if None not in firsts:  # every row in place, in order: no scatter
            return _in_place(module, q, cache, firsts, counts, flash, out_gate)
        placed = [i for i, f in enumerate(firsts) if f is not None]
        rest = [i for i, f in enumerate(firsts) if f is None]
        if placed:  # (their attend: _in_place, below)
            parts.append((placed, None))
    lengths = [r.start + r.num_tokens - r.read_start for r in reservations]
    groups, alone = plan_groups(
        [lengths[i] for i in rest], cache.bytes_per_token, min_fill=min_fill
    )
    if not parts and len(groups) == 1 and not alone:  # every row in one group, in order
        return _padded(module, cache, q, reservations, new_tokens, head_mask, out_gate)
    parts += [([rest[i] for i in rows], _padded) for rows in groups]
    if alone:
        parts.append(([rest[i] for i in alone], _per_session))
    # Every part's rows in one index tensor (one copy to the device, no wait), cut per part.
    indices = list_tensor([i for rows, _ in parts for i in rows], q.device)  # (B,)
    out = None
    at = 0
    for rows, attend in parts:
        index = indices.narrow(0, at, len(rows))
        at += len(rows)
        gate = None if out_gate is None else out_gate.index_select(0, index)  # (n, T, gate_width)
        if attend is None:  # rows read in place
            sub = [firsts[i] for i in rows], [counts[i] for i in rows]
            y = _in_place(module, q.index_select(0, index), cache, *sub, flash, gate).output
        else:
            y = attend(
                module,
                cache,
                q.index_select(0, index),
                [reservations[i] for i in rows],
                [new_tokens[i] for i in rows],
                head_mask=head_mask,
                out_gate=gate,
            ).output
        if out is None:
            out = y.new_zeros(B, *y.shape[1:])  # (B, T, E)
        out.index_copy_(0, index, y)
    return AttentionOutput(output=out, weights=None)


def _in_place(
    module: MultiHeadAttention,
    q: torch.Tensor,
    cache: KVCache,
    firsts: Sequence[int],
    counts: Sequence[int],
    flash: FlashKernel,
    out_gate: torch.Tensor | None = None,
) -> AttentionOutput:
    """One token per row (q (B, H, 1, D)), no head mask: row b's keys are counts[b] slots from
    firsts[b] in every head (KVCache.runs), read where they lie by one flash kernel."""
    B = q.shape[0]
    # cu_seqlens_q 0..B, cu_seqlens_k each row's first slot (its last entry unread), seqused_k
    # each row's key count: one int32 tensor, one copy.
    meta = list_tensor([*range(B + 1), *firsts, firsts[-1], *counts], q.device, torch.int32)
    k, v = cache.by_token()  # (slots, KVH, D) each
    cu_q, cu_k, used = meta[: B + 1], meta[B + 1 : 2 * B + 2], meta[2 * B + 2 :]
    try:
        y = flash(q[:, :, 0], k, v, cu_q, cu_k, used, max(counts), module.scale)  # (B, H, D)
    except RuntimeError as e:  # (a CUDA error that poisons the context is no better after)
        raise FlashDecodeFailed(f"{type(e).__name__}: {e}") from e
    return AttentionOutput(output=module.merge_heads(y.unsqueeze(2), out_gate), weights=None)


def _padded(
    module: MultiHeadAttention,
    cache: KVCache,
    q: torch.Tensor,
    reservations: Sequence[Reservation],
    new_tokens: Sequence[int],
    head_mask: torch.Tensor | None = None,
    out_gate: torch.Tensor | None = None,
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
        out_gate=out_gate,
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
    out_gate: torch.Tensor | None = None,
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
        out_gate=out_gate,
    )
