"""A session's steps over its KV cache, MultiHeadAttention's methods for them: attend_cached
(new tokens over keys laid out by absolute position), attend_step and decode_one (a lone step,
the engine's most frequent call) and attend_padded (a batch in one kernel). Defined here as
functions of the module (`self`) and bound in its class body (attention.py), so that a call
costs what a method defined there costs."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from mha_serve.transfer import list_tensor

from .cached import attend_one, attend_token, key_mask
from .checks import check_cached, check_head_mask, check_heads, check_padded, check_queries
from .norm import rms_norm
from .output import AttentionOutput
from .padded import attend_padded as padded_attention
from .padded import padded_mask
from .rope import cos_sin, scale_one


def attend_cached(
    self,
    q: torch.Tensor,
    kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
    *,
    past_lengths: Sequence[int],
    new_lengths: Sequence[int],
    need_weights: bool = False,
    weight_heads: Sequence[int] | None = None,
    head_mask: torch.Tensor | None = None,
    first_keys: Sequence[int] | None = None,
    out_gate: torch.Tensor | None = None,
) -> AttentionOutput:
    """Attention of new tokens over keys already laid out by absolute position (a KV
    cache read): the engine's session step. Always causal (a cache is exact only so),
    and within the config's sliding window.

    q (B, H, T, D): the new tokens' queries (`project`). kv[b] = (keys, values), each
    (1, KVH, S_b, D): sequence b's positions first_keys[b]..past_lengths[b] +
    new_lengths[b] - 1 in order, its new tokens last (KVCache.read), new_lengths[b] in
    1..T. first_keys None: every sequence from position 0; with a sliding window W a
    read may start anywhere up to past_lengths[b] + 1 - W (keys before the window of the
    step's first token are never seen, so need not be read, or kept).
    Keys and values may be narrower than q (a bfloat16 cache for a float32 model): the
    queries are then rounded to their dtype for the fused kernels, whose softmax and
    sums stay float32, and the outputs come back in q's dtype; weights are computed in
    float32 from the unrounded queries.

    New token t of sequence b (absolute position past_lengths[b] + t) attends to
    positions 0..past_lengths[b] + t (the last W of them with a window). Returns output
    (B, T, E) (rows of padded tokens 0) and, when asked, weights (B, len(heads), T,
    max(past_lengths[b] + new_lengths[b])) float32 over absolute positions (columns
    before a sequence's read or past its end, rows of padded tokens 0): row t equals
    row past_lengths[b] + t of a causal `forward` over the whole sequence.
    out_gate (B, T, H*D): output_gate(x) of the new tokens, for (and only for) a model with
    an output gate.
    """
    c = self.config
    B, H, T, D = check_queries(self.config, q)
    heads = check_heads(self.config, weight_heads) if need_weights else []
    gate = check_head_mask(self.config, head_mask, q)
    if first_keys is None:
        first_keys = [0] * B
    if B == 1 and not need_weights and len(kv) == len(past_lengths) == len(new_lengths) == 1:
        # One sequence, no weights (every decode step alone): the loop below, unrolled.
        (keys, values), past, new = kv[0], past_lengths[0], new_lengths[0]
        first = first_keys[0]
        if new == T and gate is None:  # (attend_step checks it all again: a few us)
            y = self.attend_step(q, keys, values, past, first, out_gate)
            return AttentionOutput(y, None)
        check_cached(c, 0, keys, values, past, new, first, T, q)
        q_b = q if new == T else q[:, :, :new]  # (1, H, n, D)
        y = attend_one(
            q_b,
            keys,
            values,
            past,
            self.scale,
            first_key=first,
            window=c.sliding_window,
            softcap=c.softcap,
            sinks=self.sinks,
            alibi=self.alibi,
        )
        if new != T:  # padded rows zero
            y = torch.cat([y, y.new_zeros(1, H, T - new, D)], dim=2)
            valid = (torch.arange(T, device=q.device) < new)[None]  # (1, T)
            out = self._merge_heads(y, gate, valid, out_gate)
            return AttentionOutput(output=out, weights=None)
        return AttentionOutput(output=self._merge_heads(y, gate, None, out_gate), weights=None)
    if not len(kv) == len(past_lengths) == len(new_lengths) == len(first_keys) == B:
        raise ValueError(
            f"q has batch {B} but kv, past_lengths, new_lengths and first_keys have "
            f"{len(kv)}, {len(past_lengths)}, {len(new_lengths)} and {len(first_keys)} "
            "entries"
        )
    ys, weights = [], []
    rows = q.split(1)  # q[b : b + 1] of every b, in one call: (1, H, T, D) each
    # Decode rows (one token, no weights, no soft-cap or sinks) whose token sees every key it
    # reads, from a cache in q's dtype: attend_token's kernel, on its grouped queries
    # (1, KVH, G, D) made by one reshape for the batch rather than two per row.
    KVH = c.num_kv_heads
    grouped = None
    if T == 1 and not need_weights and c.softcap is None and not c.sinks and not c.alibi:
        grouped = q.reshape(B, KVH, H // KVH, D).split(1)  # (1, KVH, G, D) each
    W = c.sliding_window
    every_grouped = True  # (then one reshape of the batch's output too)
    for b, ((keys, values), past, new, first) in enumerate(
        zip(kv, past_lengths, new_lengths, first_keys, strict=True)
    ):
        check_cached(c, b, keys, values, past, new, first, T, q)
        if grouped is not None and keys.dtype == q.dtype and (W is None or past - first < W):
            y_b = F.scaled_dot_product_attention(grouped[b], keys, values, scale=self.scale)
            ys.append(y_b if every_grouped else y_b.reshape(1, H, 1, D))  # (as attend_one's)
            continue
        if every_grouped and grouped is not None:  # the rows so far, as attend_one's
            ys = [y_b.reshape(1, H, 1, D) for y_b in ys]
        every_grouped = False
        q_b = rows[b] if new == T else rows[b][:, :, :new]  # (1, H, n, D)
        y_b = attend_one(
            q_b,
            keys,
            values,
            past,
            self.scale,
            first_key=first,
            window=c.sliding_window,
            softcap=c.softcap,
            sinks=self.sinks,
            alibi=self.alibi,
        )  # (1, H, n, D)
        ys.append(y_b)
        if need_weights:
            S_b = keys.shape[2]
            allowed = key_mask(past, new, first, S_b, c.sliding_window, q.device)
            probs = self._softmax(q_b, keys, heads, allowed, past, first)  # (1, n_h, n, S_b)
            weights.append((first, probs))
    new_valid = None
    if grouped is not None and every_grouped:
        y = torch.cat(ys).reshape(B, H, T, D)  # (B, KVH, G, D) -> (B, H, 1, D)
    elif B == 1 and new_lengths[0] == T:
        y = ys[0]
    elif all(n == T for n in new_lengths):
        y = torch.cat(ys)  # (B, H, T, D)
    else:  # ragged: padded rows are zero here and in the output
        y = q.new_zeros(B, H, T, D)
        for b, (y_b, n) in enumerate(zip(ys, new_lengths, strict=True)):
            y[b, :, :n] = y_b[0]
        new_len = list_tensor(new_lengths, q.device)  # pinned, non_blocking on CUDA
        new_valid = torch.arange(T, device=q.device)[None, :] < new_len[:, None]  # (B, T)
    out = self._merge_heads(y, gate, new_valid, out_gate)  # (B, T, E)
    if not need_weights:
        return AttentionOutput(output=out, weights=None)
    S = max(first + w.shape[-1] for first, w in weights)  # absolute positions
    all_w = torch.zeros(B, len(heads), T, S, dtype=torch.float32, device=q.device)
    for b, (first, w) in enumerate(weights):
        all_w[b, :, : w.shape[2], first : first + w.shape[3]] = w[0]
    return AttentionOutput(output=out, weights=all_w)


def attend_step(
    self,
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    past: int,
    first_key: int = 0,
    out_gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """attend_cached of one sequence whose tokens are all new, without weights or a head
    mask: a lone session step (the engine's most frequent call), its output (1, T, E)
    alone, with the same checks and ops and none of attend_cached's tuples and lists.
    q (1, H, T, D) at positions past..past+T-1; keys, values (1, KVH, past + T -
    first_key, D) at positions first_key.. (KVCache.read); out_gate (1, T, H*D) with an
    output gate (output_gate)."""
    c = self.config
    T = check_queries(c, q)[2]
    check_cached(c, 0, keys, values, past, T, first_key, T, q)
    y = attend_one(
        q, keys, values, past, self.scale,
        first_key=first_key, window=c.sliding_window, softcap=c.softcap, sinks=self.sinks,
        alibi=self.alibi,
    )  # fmt: skip
    return self._merge_heads(y, None, None, out_gate)  # (1, T, E)


def decode_one(
    self,
    x: torch.Tensor,
    kv_slot: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
) -> torch.Tensor | None:
    """A lone session step of one token x (1, 1, E) for a config without soft-cap, sinks,
    ALiBi, an output gate or a q/k norm over the whole projection, over a cache in x's dtype: project writes its
    K/V (K normed per head and rotated at position S - 1 as the config has them) into
    kv_slot (1, 2 KVH, 1, D: K's heads, then V's, normed with v_norm), then attend_step's
    output (1, 1, E) over keys, values (1, KVH, S, D), positions 0..S-1 with the new token's last
    (KVCache.step_views): the same ops on the same tensors as project, KVCache.append,
    KVCache.read and attend_step, in one call without their checks, which such views
    pass by construction (tests/cache/test_incremental_cache.py). None, nothing
    written, for any other config (not decodes_in_one), dtype, or a sliding window
    shorter than S (the token would not see every key): the caller then takes those
    calls."""
    c = self.config
    if not self.decodes_in_one or keys.dtype != x.dtype:
        return None
    if c.sliding_window is not None and keys.shape[2] > c.sliding_window:
        return None
    H, KVH, D = c.num_heads, c.num_kv_heads, c.head_dim
    linears = self._modules  # (as in project)
    wqkv = linears["wqkv"]._parameters
    qkv = F.linear(x, wqkv["weight"], wqkv["bias"])  # (1, 1, (H + 2 KVH) * D)
    # q (1, H, 1, D) and K, V (1, 2 KVH, 1, D), each one as_strided over qkv's row (a
    # view and a split are four dispatches)
    strides = ((H + 2 * KVH) * D, D, D, 1)
    norm, qs = c.qk_norm, c.query_scale
    if self.rope_freq is None and norm is None and qs is None:
        q = qkv.as_strided((1, H, 1, D), strides)
        kv = qkv.as_strided((1, 2 * KVH, 1, D), strides, qkv.storage_offset() + H * D)
        kv_slot.copy_(kv)  # K and V at once
    else:  # q and K normed per head and rotated at the token's position, S - 1, in the
        # config's order; then q scaled for that position
        qk = qkv.as_strided((1, H + KVH, 1, D), strides)
        gains = None
        if norm is not None and norm.gain:  # project's two rms_norm calls, in one
            params = self._parameters
            gains = (params["q_norm"].expand(H, D), params["k_norm"].expand(KVH, D))
            gains = torch.cat(gains)[:, None]  # (H + KVH, 1, D): q's and K's gains
        position = keys.shape[2] - 1
        if norm is not None and not norm.after_rope:
            qk = rms_norm(qk, gains, norm.eps)  # (H + KVH, 1, D)
        if self.rope_freq is not None:
            qk = self.rotate(qk, *cos_sin(self.rope_freq, self.rope_scaling, position, x.dtype))
        if norm is not None and norm.after_rope:
            qk = rms_norm(qk, gains, norm.eps)
        if qs is not None:  # (K is not scaled: a copy of q's part)
            qk = torch.cat([scale_one(qs, qk[:, :H], position), qk[:, H:]], dim=1)
        q = qk[:, :H]
        kv_slot[:, :KVH].copy_(qk[:, H:])
        v = qkv.as_strided((1, KVH, 1, D), strides, qkv.storage_offset() + (H + KVH) * D)
        if c.v_norm:  # (project's value norm: each head, no gain)
            v = rms_norm(v, None, norm.eps)
        kv_slot[:, KVH:].copy_(v)
    y = attend_token(q, keys, values, self.scale)  # (attend_one's call for it)
    wo = linears["wo"]._parameters
    return F.linear(y.reshape(1, 1, H * D), wo["weight"], wo["bias"])  # (1, 1, E)


def attend_padded(
    self,
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    *,
    past_lengths: Sequence[int],
    new_lengths: Sequence[int],
    first_keys: Sequence[int] | None = None,
    head_mask: torch.Tensor | None = None,
    out_gate: torch.Tensor | None = None,
) -> AttentionOutput:
    """attend_cached's outputs (no weights) for the whole batch in one attention kernel:
    keys, values (B, KVH, S, D) hold sequence b's positions first_keys[b]..
    past_lengths[b] + new_lengths[b] - 1 in columns 0.. (KVCache.gather), later columns
    padding, finite (they are masked, and 0 * inf is NaN); out_gate (B, T, H*D) as
    attend_cached's."""
    c = self.config
    B, H, T, D = check_queries(c, q)
    gate = check_head_mask(c, head_mask, q)
    first_keys = [0] * B if first_keys is None else first_keys
    check_padded(c, keys, values, past_lengths, new_lengths, first_keys, q)
    S = keys.shape[2]
    allowed = padded_mask(
        past_lengths, new_lengths, first_keys, T, S, c.sliding_window, q.device
    )  # (B, 1, T, S) or None
    alibi = None
    if self.alibi is not None:  # row b's token t at past[b] + t, column j at first[b] + j
        starts = list_tensor([list(past_lengths), list(first_keys)], q.device)  # (2, B)
        rows = starts[0][:, None] + torch.arange(T, device=q.device)  # (B, T)
        cols = starts[1][:, None] + torch.arange(S, device=q.device)  # (B, S)
        alibi = (self.alibi, rows, cols)
    y = padded_attention(
        q, keys, values, allowed, self.scale, softcap=c.softcap, sinks=self.sinks, alibi=alibi
    )
    new_valid = None  # (B, T): padded tokens' rows are zero in the output
    if any(n != T for n in new_lengths):
        new_len = list_tensor(new_lengths, q.device)  # pinned, non_blocking on CUDA
        new_valid = torch.arange(T, device=q.device)[None, :] < new_len[:, None]
    return AttentionOutput(output=self._merge_heads(y, gate, new_valid, out_gate), weights=None)
