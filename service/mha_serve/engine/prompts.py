"""Multi-head latent attention's prompt steps (a session's first chunk, or a long one): which
rows of a batch of steps attend in the expanded form (model/mla.py: every head decompressed
from the latents, fewer multiply-adds over many query rows), and their attention over the
cache, which still holds the latents. Sessions._forward and the lone step choose by it."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mha_serve.cache import KVCache, Reservation
from mha_serve.engine.attend import attend_steps
from mha_serve.engine.project import project_and_append
from mha_serve.engine.types import HostedModel
from mha_serve.model import AttentionOutput, MultiHeadAttention
from mha_serve.model.mla import attend_cached_expanded, expanded_width, expands
from mha_serve.transfer import list_tensor

# A step's expanded keys and values (every head's, over every key it reads) take at most this
# many bytes, else it stays absorbed: they are held beside the cache's budget, and a chunk
# after a long context would decompress all of it (DeepSeek-V3 in bfloat16: 96 KiB a key, so
# about 10900 keys).
MAX_EXPANDED_BYTES = 1 << 30


def prompt_rows(
    hosted: HostedModel, reservations: Sequence[Reservation], new_tokens: Sequence[int]
) -> list[int]:
    """The rows (indices) whose steps attend faster expanded (mla.expands: their new tokens
    over the keys they read before them) within MAX_EXPANDED_BYTES; none for a model without
    mla, or with an output gate. The caller asks only for steps without weights whose bounds clear them
    (engine/bounds.py latent_cleared covers both forms; a measured step stays absorbed, as
    its exact check reads the absorbed q)."""
    config = hosted.spec.attention
    if config.mla is None or hosted.module.wgate is not None:
        return []
    per_key = 2 * config.num_heads * expanded_width(config) * hosted.dtype.itemsize  # K and V
    return [
        b
        for b, (r, n) in enumerate(zip(reservations, new_tokens, strict=True))
        if expands(config, n, r.start - r.read_start)
        and (r.start + n - r.read_start) * per_key <= MAX_EXPANDED_BYTES
    ]


def attend_prompts(
    module: MultiHeadAttention,
    cache: KVCache,
    q: torch.Tensor,
    reservations: Sequence[Reservation],
    new_tokens: Sequence[int],
    head_mask: torch.Tensor | None = None,
) -> AttentionOutput:
    """The steps' attention in the expanded form: q (B, H, T, D_x) their new tokens'
    expanded queries (project_expanded), their latents already written; each session's
    latents read (in place where its blocks are consecutive) and decompressed. Output
    (B, T, E), padded tokens' rows zero."""
    keys = [
        cache.read(
            r.block_table, r.start + r.num_tokens, start=r.read_start, first_block=r.first_block
        )[0]
        for r in reservations
    ]  # (1, 1, S_b, R + C) each: K alone, its values
    y = attend_cached_expanded(
        module,
        q,
        keys,
        past_lengths=[r.start for r in reservations],
        new_lengths=list(new_tokens),
        first_keys=[r.read_start for r in reservations],
        head_mask=head_mask,
    )
    return AttentionOutput(output=y, weights=None)


def with_prompts(
    hosted: HostedModel,
    cache: KVCache,
    x: torch.Tensor,
    reservations: Sequence[Reservation],
    new_tokens: Sequence[int],
    prompts: list[int],
    head_mask: torch.Tensor | None,
    batched: bool,
) -> AttentionOutput:
    """A batch whose rows `prompts` attend expanded (engine/prompts.py) and the rest as any
    step's, each part projected, written and attended on its own (no weights asked, bounds
    clear every row). Output (B, T, E), padded tokens' rows zero."""
    B = x.shape[0]
    if len(prompts) == B:
        q, _, _ = project_and_append(hosted, cache, x, reservations, expanded=True)
        return attend_prompts(hosted.module, cache, q, reservations, new_tokens, head_mask)
    chosen = set(prompts)
    rest = [b for b in range(B) if b not in chosen]
    out = None
    for rows, expanded in ((prompts, True), (rest, False)):
        index = list_tensor(rows, x.device)
        part = [reservations[b] for b in rows]
        news = [new_tokens[b] for b in rows]
        x_part = x.index_select(0, index)[:, : max(news)]  # (n, T', E)
        q, _, _ = project_and_append(hosted, cache, x_part, part, expanded=expanded)
        if expanded:
            y = attend_prompts(hosted.module, cache, q, part, news, head_mask).output
        else:
            y = attend_steps(
                hosted.module, cache, q, part, news, batched=batched, head_mask=head_mask
            ).output
        if out is None:
            out = x.new_zeros(B, x.shape[1], y.shape[2])  # (B, T, E)
        out[:, : y.shape[1]].index_copy_(0, index, y)
    return AttentionOutput(output=out, weights=None)
