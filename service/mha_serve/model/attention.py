"""The attention module: one class for MHA, GQA and MQA, and for the families' options
(RoPE, q/k RMSNorm, sliding window, soft-capping: all read from the config). Embeddings
come from fused SDPA (from the explicit float32 kernel where scores are soft-capped, which
SDPA cannot do); attention weights come from a separate explicit path, only when asked."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mha_serve.transfer import list_tensor

from .cached import attend_one, attend_token, capped_scores, explicit_attention, key_mask
from .checks import (
    check_cached,
    check_head_mask,
    check_heads,
    check_input,
    check_padded,
    check_queries,
    check_query_range,
    valid_positions,
)
from .config import AttentionConfig
from .overflow import NO_OVERFLOW, NoOverflow, OverflowCheck, score_limit
from .padded import attend_padded, padded_mask
from .rope import cos_sin, doubled, inv_freq, rotate


@dataclass
class AttentionOutput:
    output: torch.Tensor  # (B, L, E), rows at padded positions are 0
    weights: torch.Tensor | None  # (B, len(heads), R, S) float32; None unless need_weights
    # Which batch rows' attention scores (or values) overflow the compute dtype: their output
    # and weights are meaningless and must not be returned. Read it (.rows(), a device sync)
    # where the output is read: the forward itself never waits for the device (overflow.py).
    overflow: OverflowCheck | NoOverflow = NO_OVERFLOW


class MultiHeadAttention(nn.Module):
    def __init__(
        self,
        config: AttentionConfig,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.scale = config.scale
        # Whether decode_one can run a lone decode step: none of the options it leaves out
        # (RoPE and a q/k norm per head it applies itself; a sliding window while the
        # session is no longer than it, every key then in view).
        self.decodes_in_one = (
            config.qk_norm is None or config.qk_norm.scope == "head"
        ) and config.softcap is None
        # RoPE frequencies: a plain float32 tensor, not a buffer, so that module.to(dtype)
        # never rounds them (transformers keeps them float32 too); kept on the weights'
        # device (here and in _apply), so that a step copies nothing from the host for them
        # (on CUDA such a copy from pageable memory would wait for the device).
        # Each frequency twice (rope.doubled: the angles' layout), made once here.
        self.rope_freq, self.rope_scaling = (None, 1.0)
        if config.rope is not None:
            freq, self.rope_scaling = inv_freq(config.rope, config.head_dim)
            freq = doubled(freq)  # (D,)
            self.rope_freq = freq if device is None else freq.to(device)
        # Fused projection whose rows are [Wq; Wk; Wv] (as gpt-fast): one matmul,
        # and exactly nn.MultiheadAttention's in_proj_weight layout when KVH == H.
        self.wqkv = nn.Linear(
            config.embed_dim, config.qkv_dim, bias=config.bias, device=device, dtype=dtype
        )
        self.wo = nn.Linear(
            config.num_heads * config.head_dim,
            config.embed_dim,
            bias=config.bias,
            device=device,
            dtype=dtype,
        )
        # q/k RMSNorm weights (Qwen3, OLMo-2, Gemma 3), in the state dict as q_norm, k_norm:
        # (D,) shared by every head, or (H*D,) and (KVH*D,) over the whole projection.
        self.q_norm = self.k_norm = None
        if config.qk_norm is not None:
            whole = config.qk_norm.scope == "projection"
            H, KVH, D = config.num_heads, config.num_kv_heads, config.head_dim
            for name, width in (
                ("q_norm", H * D if whole else D),
                ("k_norm", KVH * D if whole else D),
            ):
                setattr(self, name, nn.Parameter(torch.ones(width, device=device, dtype=dtype)))

    def forward(
        self,
        x: torch.Tensor,
        *,
        lengths: torch.Tensor | None = None,
        causal: bool | None = None,
        need_weights: bool = False,
        weight_heads: Sequence[int] | None = None,
        query_range: tuple[int, int] | None = None,
        head_mask: torch.Tensor | None = None,
        check_overflow: bool = True,
    ) -> AttentionOutput:
        """Attend over x (B, L, E).

        lengths (B,): real length of each sequence; later positions are padding
        that never influences real positions and whose output rows are 0.
        causal: None takes config.causal. need_weights: also return softmax
        weights, for query heads weight_heads (None = all, any order) and query
        rows query_range = (start, end) over the padded length (None = all);
        these two only narrow the weights and are ignored otherwise.
        head_mask (H,): gate on each query head's output before wo (0 prunes).
        Rotary models place token i of every sequence at position i (padding is at the
        end, so real tokens keep their positions). check_overflow False: the caller has
        proven that nothing overflows (the engine's bounds), so no maxima are taken.
        """
        c = self.config
        H, KVH = c.num_heads, c.num_kv_heads
        B, L = check_input(c, self.wqkv.weight, x)
        causal = c.causal if causal is None else bool(causal)
        valid = valid_positions(lengths, B, L, x.device)  # (B, L) bool, None if unpadded
        heads = check_heads(self.config, weight_heads)
        q_start, q_end = check_query_range(query_range, L)
        gate = check_head_mask(self.config, head_mask, x)

        if valid is not None:
            # Padding may be uninitialised memory from a batcher; a NaN or inf
            # there would leak through the masked softmax as 0 * NaN in p @ v.
            x = x.masked_fill(~valid[:, :, None], 0.0)

        q, k, v = self.project(x)  # (B, H, L, D), (B, KVH, L, D), (B, KVH, L, D)
        overflow = NO_OVERFLOW
        if check_overflow:  # its maxima are read with the output, never waited for here
            overflow = OverflowCheck(
                q,
                k,
                v,
                [0 if causal else None] * B,
                window=c.sliding_window,
                limit=score_limit(q.dtype, k.dtype) / c.score_factor,
            )

        # No mask at all when nothing is padded and no window cuts keys off, so SDPA can
        # pick its fastest kernel (is_causal needs no mask tensor).
        mask = None
        if valid is not None or _cuts(c.sliding_window, L):
            mask = self._allowed(valid, causal, 0, L, L, x.device)  # (B|1, 1, L, L)
        if c.softcap is None:
            y = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                is_causal=causal and mask is None,
                scale=self.scale,
                enable_gqa=KVH != H,  # SDPA broadcasts kv heads; no repeat_interleave copy
            )  # (B, H, L, D)
        else:
            if mask is None and causal:
                mask = self._allowed(None, True, 0, L, L, x.device)  # (1, 1, L, L)
            y = explicit_attention(q, k, v, mask, self.scale, c.softcap)  # (B, H, L, D)
        out = self._merge_heads(y, gate, valid)  # (B, L, E)

        weights = None
        if need_weights:
            weights = self._weights(q, k, valid, causal, heads, q_start, q_end)
        return AttentionOutput(output=out, weights=weights, overflow=overflow)

    def _weights(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        valid: torch.Tensor | None,
        causal: bool,
        heads: list[int],
        q_start: int,
        q_end: int,
    ) -> torch.Tensor:
        """softmax(q k^T * scale + mask) in float32, only for the requested heads
        and rows, so memory is B * len(heads) * R * S, never B * H * L * S."""
        allowed = None
        if causal or valid is not None or _cuts(self.config.sliding_window, q.shape[2]):
            allowed = self._allowed(valid, causal, q_start, q_end, q.shape[2], q.device)
        # Every row keeps at least one key (its own, or any for a padded row), so no row is
        # all -inf and masked columns come out exactly 0.
        weights = self._softmax(q[:, :, q_start:q_end], k, heads, allowed)  # (B, n, R, S)
        if valid is not None:
            weights = weights.masked_fill(~valid[:, None, q_start:q_end, None], 0.0)
        return weights

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
                return AttentionOutput(self.attend_step(q, keys, values, past, first), None)
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
            )
            if new != T:  # padded rows zero
                y = torch.cat([y, y.new_zeros(1, H, T - new, D)], dim=2)
                valid = (torch.arange(T, device=q.device) < new)[None]  # (1, T)
                return AttentionOutput(output=self._merge_heads(y, gate, valid), weights=None)
            return AttentionOutput(output=self._merge_heads(y, gate, None), weights=None)
        if not len(kv) == len(past_lengths) == len(new_lengths) == len(first_keys) == B:
            raise ValueError(
                f"q has batch {B} but kv, past_lengths, new_lengths and first_keys have "
                f"{len(kv)}, {len(past_lengths)}, {len(new_lengths)} and {len(first_keys)} "
                "entries"
            )
        ys, weights = [], []
        rows = q.split(1)  # q[b : b + 1] of every b, in one call: (1, H, T, D) each
        # Decode rows (one token, no weights, no soft-cap) whose token sees every key it
        # reads, from a cache in q's dtype: attend_token's kernel, on its grouped queries
        # (1, KVH, G, D) made by one reshape for the batch rather than two per row.
        KVH = c.num_kv_heads
        grouped = None
        if T == 1 and not need_weights and c.softcap is None:
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
            )  # (1, H, n, D)
            ys.append(y_b)
            if need_weights:
                S_b = keys.shape[2]
                allowed = key_mask(past, new, first, S_b, c.sliding_window, q.device)
                weights.append(
                    (first, self._softmax(q_b, keys, heads, allowed))
                )  # (1, n_h, n, S_b)
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
        out = self._merge_heads(y, gate, new_valid)  # (B, T, E)
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
    ) -> torch.Tensor:
        """attend_cached of one sequence whose tokens are all new, without weights or a head
        mask: a lone session step (the engine's most frequent call), its output (1, T, E)
        alone, with the same checks and ops and none of attend_cached's tuples and lists.
        q (1, H, T, D) at positions past..past+T-1; keys, values (1, KVH, past + T -
        first_key, D) at positions first_key.. (KVCache.read)."""
        c = self.config
        T = check_queries(c, q)[2]
        check_cached(c, 0, keys, values, past, T, first_key, T, q)
        y = attend_one(
            q, keys, values, past, self.scale,
            first_key=first_key, window=c.sliding_window, softcap=c.softcap,
        )  # fmt: skip
        return self._merge_heads(y, None, None)  # (1, T, E)

    def decode_one(
        self,
        x: torch.Tensor,
        kv_slot: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
    ) -> torch.Tensor | None:
        """A lone session step of one token x (1, 1, E) for a config without soft-cap or a
        q/k norm over the whole projection, over a cache in x's dtype: project writes its
        K/V (K normed per head and rotated at position S - 1 as the config has them) into
        kv_slot (1, 2 KVH, 1, D: K's heads, then V's), then attend_step's output (1, 1, E)
        over keys, values (1, KVH, S, D), positions 0..S-1 with the new token's last
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
        norm = c.qk_norm
        if self.rope_freq is None and norm is None:
            q = qkv.as_strided((1, H, 1, D), strides)
            kv = qkv.as_strided((1, 2 * KVH, 1, D), strides, qkv.storage_offset() + H * D)
            kv_slot.copy_(kv)  # K and V at once
        else:  # q and K normed per head, then rotated at the token's position, S - 1
            qk = qkv.as_strided((1, H + KVH, 1, D), strides)
            if norm is not None:  # project's two _rms_norm calls, in one: q's and K's gains
                params = self._parameters
                gains = (params["q_norm"].expand(H, D), params["k_norm"].expand(KVH, D))
                qk = _rms_norm(qk, torch.cat(gains)[:, None], norm.eps)  # (H + KVH, 1, D)
            if self.rope_freq is not None:
                position = keys.shape[2] - 1
                qk = rotate(qk, *cos_sin(self.rope_freq, self.rope_scaling, position, x.dtype))
            q = qk[:, :H]
            kv_slot[:, :KVH].copy_(qk[:, H:])
            kv_slot[:, KVH:].copy_(
                qkv.as_strided((1, KVH, 1, D), strides, qkv.storage_offset() + (H + KVH) * D)
            )
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
    ) -> AttentionOutput:
        """attend_cached's outputs (no weights) for the whole batch in one attention kernel:
        keys, values (B, KVH, S, D) hold sequence b's positions first_keys[b]..
        past_lengths[b] + new_lengths[b] - 1 in columns 0.. (KVCache.gather), later columns
        padding, finite (they are masked, and 0 * inf is NaN)."""
        c = self.config
        B, H, T, D = check_queries(c, q)
        gate = check_head_mask(c, head_mask, q)
        first_keys = [0] * B if first_keys is None else first_keys
        check_padded(c, keys, values, past_lengths, new_lengths, first_keys, q)
        S = keys.shape[2]
        allowed = padded_mask(
            past_lengths, new_lengths, first_keys, T, S, c.sliding_window, q.device
        )  # (B, 1, T, S) or None
        y = attend_padded(q, keys, values, allowed, self.scale, softcap=c.softcap)
        new_valid = None  # (B, T): padded tokens' rows are zero in the output
        if any(n != T for n in new_lengths):
            new_len = list_tensor(new_lengths, q.device)  # pinned, non_blocking on CUDA
            new_valid = torch.arange(T, device=q.device)[None, :] < new_len[:, None]
        return AttentionOutput(output=self._merge_heads(y, gate, new_valid), weights=None)

    def _apply(self, fn, recurse=True):  # module.to(device), .cuda(), ...: rope_freq follows
        super()._apply(fn, recurse)
        if self.rope_freq is not None:  # the device only: it stays float32
            self.rope_freq = self.rope_freq.to(self.wqkv.weight.device)
        return self

    def project(
        self, x: torch.Tensor, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of x (B, L, E); with q/k norm, q and k are RMS-normalised first; for a
        rotary model q and k are then rotated at `positions` (B, L) or (L,) absolute
        positions (None: 0..L-1), so cached keys need no more work. Without RoPE, positions
        are ignored."""
        c = self.config
        H, KVH, D = c.num_heads, c.num_kv_heads, c.head_dim
        B, L, _ = x.shape
        # F.linear, not self.wqkv(x), and the parameters from the modules' own dicts, not
        # nn.Module's __getattr__ (a Python call each): a decode step is small enough for
        # each to show.
        wqkv = self._modules["wqkv"]._parameters
        qkv = F.linear(x, wqkv["weight"], wqkv["bias"])  # (B, L, (H + 2 KVH) * D)
        norm = c.qk_norm
        if L == 1 and norm is None and self.rope_freq is None:  # one token: no transpose
            # (B, H + 2 KVH, 1, D) split by heads: two view ops, not four
            return qkv.view(B, H + 2 * KVH, 1, D).split_with_sizes([H, KVH, KVH], dim=1)
        q, k, v = qkv.split_with_sizes([H * D, KVH * D, KVH * D], dim=-1)  # (B, L, H*D | KVH*D)
        if norm is not None and norm.scope == "projection":  # OLMo-2: over all heads at once
            q, k = _rms_norm(q, self.q_norm, norm.eps), _rms_norm(k, self.k_norm, norm.eps)
        v = v.view(B, L, KVH, D).transpose(1, 2)  # (B, KVH, L, D)
        if norm is None and self.rope_freq is not None:  # q and k rotated in one call
            qk = qkv[..., : (H + KVH) * D].view(B, L, H + KVH, D).transpose(1, 2)
            qk = rotate(qk, *self._cos_sin(x, positions, B, L))  # (B, H + KVH, L, D)
            return qk[:, :H], qk[:, H:], v
        q = q.view(B, L, H, D)  # (B, L, H, D)
        k = k.view(B, L, KVH, D)  # (B, L, KVH, D)
        if norm is not None and norm.scope == "head":  # Qwen3, Gemma 3: each head on its own
            q, k = _rms_norm(q, self.q_norm, norm.eps), _rms_norm(k, self.k_norm, norm.eps)
        q = q.transpose(1, 2)  # (B, H, L, D)
        k = k.transpose(1, 2)  # (B, KVH, L, D)
        if self.rope_freq is not None:
            cos, sin = self._cos_sin(x, positions, B, L)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)  # (B, H|KVH, L, D)
        return q, k, v

    def _cos_sin(
        self, x: torch.Tensor, positions: torch.Tensor | None, B: int, L: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """project's cos and sin (B|1, 1, L, D) at positions (B, L), (L,) or None (0..L-1)."""
        if positions is None:
            positions = torch.arange(L, device=x.device)
        positions = torch.as_tensor(positions, device=x.device)
        if positions.dim() == 1:
            positions = positions[None]  # (1, L)
        if positions.shape not in ((1, L), (B, L)):
            raise ValueError(
                f"positions must be (seq_len,) = ({L},) or (batch, seq_len) = ({B}, {L}), "
                f"got {tuple(positions.shape)}"
            )
        return cos_sin(self.rope_freq, self.rope_scaling, positions, x.dtype)

    def merge_heads(self, y: torch.Tensor) -> torch.Tensor:
        """Attention's per-head output y (B, H, L, D) as the module's output (B, L, E): heads
        merged, then wo (for a kernel run outside the module, engine/attend.py)."""
        return self._merge_heads(y, None, None)

    def _merge_heads(
        self, y: torch.Tensor, gate: torch.Tensor | None, valid: torch.Tensor | None
    ) -> torch.Tensor:
        B, H, L, D = y.shape
        if gate is not None:
            y = y * gate.view(1, H, 1, 1)
        # (B, L, H*D); one token's heads need no transpose (a view where its layout allows)
        y = y.reshape(B, 1, H * D) if L == 1 else y.transpose(1, 2).reshape(B, L, H * D)
        wo = self._modules["wo"]._parameters  # (as in project)
        out = F.linear(y, wo["weight"], wo["bias"])  # (B, L, E)
        if valid is not None:
            out = out.masked_fill(~valid[:, :, None], 0.0)
        return out

    def _softmax(
        self, q: torch.Tensor, k: torch.Tensor, heads: list[int], allowed: torch.Tensor | None
    ) -> torch.Tensor:
        """softmax(q k^T * scale) in float32 over allowed keys (scores soft-capped when the
        config says so), for query heads `heads`:
        q (B, H, R, D), k (B, KVH, S, D), allowed broadcastable to (B, 1, R, S)."""
        idx = list_tensor(heads, q.device)
        qh = q[:, idx]  # (B, n, R, D)
        kh = k[:, idx // self.config.group_size]  # (B, n, S, D): GQA head h reads kv h // G
        scores = capped_scores(qh, kh, self.scale, self.config.softcap)  # (B, n, R, S) float32
        if allowed is not None:
            scores.masked_fill_(~allowed, float("-inf"))
        return torch.softmax(scores, dim=-1)  # (B, n, R, S)

    def _allowed(
        self,
        valid: torch.Tensor | None,
        causal: bool,
        q_start: int,
        q_end: int,
        S: int,
        device: torch.device,
    ) -> torch.Tensor:
        """Bool mask, True where query row i in [q_start, q_end) may attend to key j (rows
        and keys at positions 0..): j <= i when causal; i - j < window (|i - j| < window when
        not causal) with a sliding window; j real when padded. (B|1, 1, R|1, S).

        A padded query row may see every key: its output is dropped, and a row with no key
        at all (its window past the real keys) would be NaN."""
        window = self.config.sliding_window
        rows = torch.arange(q_start, q_end, device=device)[:, None]  # (R, 1)
        cols = torch.arange(S, device=device)[None, :]  # (1, S)
        allowed = None
        if causal:
            allowed = rows >= cols  # (R, S)
        if _cuts(window, max(S, q_end)):
            near = (rows - cols < window) if causal else ((rows - cols).abs() < window)
            allowed = near if allowed is None else allowed & near
        if allowed is not None:
            allowed = allowed[None, None]  # (1, 1, R, S)
        if valid is not None:
            keys = valid[:, None, None, :]  # (B, 1, 1, S)
            allowed = keys if allowed is None else allowed & keys  # (B, 1, R, S)
            allowed = allowed | ~valid[:, None, q_start:q_end, None]  # padded rows: any key
        assert allowed is not None, "_allowed needs causal, a window or padding"
        return allowed


def _cuts(window: int | None, L: int) -> bool:
    """Whether a sliding window hides any key of an L-token sequence from some query."""
    return window is not None and window < L


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dim, in float32 (as transformers'
    Qwen3, OLMo-2 and Gemma 3 norms), back in x's dtype."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.float()).to(x.dtype)
