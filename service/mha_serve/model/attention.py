"""The attention module: one class for MHA, GQA and MQA, and for the families' options
(RoPE, q/k RMSNorm, a value RMSNorm, sliding window, soft-capping, attention sinks, ALiBi,
multi-head latent attention served as MQA (model/mla.py; its prompts expanded), an output
gate, queries scaled by position: all read from the config).
Embeddings come from fused SDPA (from the explicit float32 kernel where scores are
soft-capped, sinks join the softmax or ALiBi biases the scores, which SDPA cannot do alone;
on the CPU a prompt with sinks or ALiBi runs SDPA again, cached.sinks_by_sdpa and
cached.alibi_by_sdpa); attention weights come from a separate explicit path, only when
asked."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from mha_serve.transfer import list_tensor

from . import mla, steps
from .alibi import AlibiSlopes, alibi_bias, alibi_slopes, positions
from .cached import capped_scores, explicit_attention, sink_softmax
from .checks import (
    check_head_mask,
    check_heads,
    check_input,
    check_out_gate,
    check_query_range,
    valid_positions,
)
from .config import AttentionConfig
from .norm import rms_norm
from .output import AttentionOutput
from .overflow import NO_OVERFLOW, OverflowCheck, score_limit
from .rope import cos_sin, doubled, inv_freq, query_scales, rotation


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
            (config.qk_norm is None or config.qk_norm.scope == "head")
            and config.softcap is None
            and not config.sinks
            and not config.alibi
            and config.mla is None  # (its projection is not wqkv's)
            and not config.output_gate  # (its merge needs the gate's own projection)
        )
        # RoPE frequencies: a plain float32 tensor, not a buffer, so that module.to(dtype)
        # never rounds them (transformers keeps them float32 too); kept on the weights'
        # device (here and in _apply), so that a step copies nothing from the host for them
        # (on CUDA such a copy from pageable memory would wait for the device).
        # Each frequency twice (rope.doubled: the angles' layout), made once here.
        self.rope_freq, self.rope_scaling = (None, 1.0)
        if config.rope is not None:
            freq, self.rope_scaling = inv_freq(config.rope, config.rope_dim)
            freq = doubled(freq, config.rope.interleaved)  # (rope_dim,)
            if config.rope.reverse:  # (nanochat: angles negated, sin's sign with them)
                freq = -freq
            self.rope_freq = freq if device is None else freq.to(device)
            # q and k rotated by halves or by pairs, all of each head or its first rope_dim
            self.rotate = rotation(config.rope, config.rope_dim, config.head_dim)
        # ALiBi's slopes (H,): float32 and on the weights' device as rope_freq (not a buffer:
        # derived from the config, not in the state dict), with the bias's form.
        self.alibi = None
        if config.alibi:
            slopes = alibi_slopes(config.num_heads, config.alibi_bias_max)
            self.alibi = AlibiSlopes(
                slopes if device is None else slopes.to(device),
                1.0 if config.alibi_scale is None else config.alibi_scale,
                config.alibi_bfloat16,
            )
        if config.mla is not None:  # MLA's projections (q_a, q_b or q, kv_a, kv_b) and wo
            mla.add_parameters(self, config, device, dtype)
        else:
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
        # (D,) shared by every head, or (H*D,) and (KVH*D,) over the whole projection; none
        # for a norm without a gain (Llama 4's, nanochat's).
        self.q_norm = self.k_norm = None
        if config.qk_norm is not None and config.qk_norm.gain:
            whole = config.qk_norm.scope == "projection"
            H, KVH, D = config.num_heads, config.num_kv_heads, config.head_dim
            for name, width in (
                ("q_norm", H * D if whole else D),
                ("k_norm", KVH * D if whole else D),
            ):
                setattr(self, name, nn.Parameter(torch.ones(width, device=device, dtype=dtype)))
        # Attention sinks (GPT-OSS): one logit per query head, in the state dict as sinks (H,).
        self.sinks = None
        if config.sinks:
            self.sinks = nn.Parameter(torch.zeros(config.num_heads, device=device, dtype=dtype))
        # The output gate's projection (Qwen3-Next, Qwen3.5, AFMoE; LFM3 one row per head),
        # in the state dict as wgate: rows by query head as wo's columns, (gate_width, E),
        # biased as the projections.
        self.wgate = None
        if config.output_gate:
            self.wgate = nn.Linear(
                config.embed_dim,
                config.gate_width,
                bias=config.bias,
                device=device,
                dtype=dtype,
            )

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
        H = c.num_heads
        B, L = check_input(c, self.wo.weight, x)
        causal = c.causal if causal is None else bool(causal)
        valid = valid_positions(lengths, B, L, x.device)  # (B, L) bool, None if unpadded
        heads = check_heads(self.config, weight_heads)
        q_start, q_end = check_query_range(query_range, L)
        gate = check_head_mask(self.config, head_mask, x)

        if valid is not None:
            # Padding may be uninitialised memory from a batcher; a NaN or inf
            # there would leak through the masked softmax as 0 * NaN in p @ v.
            x = x.masked_fill(~valid[:, :, None], 0.0)

        # MLA's prompts attend expanded (mla.expands): HF's decompressed heads (an output
        # gate multiplies their V dims in _merge_heads, as it does W_uv's after the absorbed
        # form); requests for weights stay absorbed
        expanded = c.mla is not None and not need_weights and mla.expands(c, L, cached_keys=0)
        if expanded:  # (B, H, L, D_x) each: q, and every head's keys and values
            q, k = self.project_expanded(x)
            k, v = mla.expand_keys(self, k)
        else:
            q, k, v = self.project(x)  # (B, H, L, D), (B, KVH, L, D), (B, KVH, L, D)
        out_gate = self.output_gate(x)  # (B, L, H*D) or None
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
        if c.softcap is None and self.sinks is None and self.alibi is None:
            y = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                is_causal=causal and mask is None,
                scale=self.scale,
                enable_gqa=k.shape[1] != H,  # SDPA broadcasts kv heads; no repeat_interleave copy
            )  # (B, H, L, D)
        else:
            if mask is None and causal:
                mask = self._allowed(None, True, 0, L, L, x.device)  # (1, 1, L, L)
            alibi = None
            if self.alibi is not None:  # token i of every sequence at position i
                at = positions(0, L, x.device)  # (1, L)
                alibi = (self.alibi, at, at)
            y = explicit_attention(
                q, k, v, mask, self.scale, c.softcap, self.sinks, alibi
            )  # (B, H, L, D)
        if expanded:
            y = y[..., : c.mla.v_head_dim]  # (B, H, L, V): the values' zero padding dropped
        out = self._merge_heads(y, gate, valid, out_gate, expanded=expanded)  # (B, L, E)

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
        """softmax(q k^T * scale + mask) in float32 (with sinks: without the sink's column),
        only for the requested heads and rows, so memory is B * len(heads) * R * S, never
        B * H * L * S."""
        allowed = None
        if causal or valid is not None or _cuts(self.config.sliding_window, q.shape[2]):
            allowed = self._allowed(valid, causal, q_start, q_end, q.shape[2], q.device)
        # Every row keeps at least one key (its own, or any for a padded row), so no row is
        # all -inf and masked columns come out exactly 0.
        weights = self._softmax(q[:, :, q_start:q_end], k, heads, allowed, q_start)  # (B, n, R, S)
        if valid is not None:
            weights = weights.masked_fill(~valid[:, None, q_start:q_end, None], 0.0)
        return weights

    # A session's steps over its KV cache: defined in steps.py, bound here as methods.
    attend_cached = steps.attend_cached
    attend_step = steps.attend_step
    decode_one = steps.decode_one
    attend_padded = steps.attend_padded

    def _apply(self, fn, recurse=True):  # module.to(device), .cuda(), ...: rope_freq follows
        super()._apply(fn, recurse)
        if self.rope_freq is not None:  # the device only: it stays float32
            self.rope_freq = self.rope_freq.to(self.wo.weight.device)
        if self.alibi is not None:  # (likewise)
            self.alibi = self.alibi.to(self.wo.weight.device)
        return self

    def project(
        self, x: torch.Tensor, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of x (B, L, E); with q/k norm, q and k are RMS-normalised first (with
        v_norm, v too: each head over its head_dim, without a gain); for a
        rotary model q and k are then rotated at `positions` (B, L) or (L,) absolute
        positions (None: 0..L-1), so cached keys need no more work. Without RoPE, positions
        are ignored. With mla: its absorbed q, and k = v, one kv head (model/mla.py)."""
        c = self.config
        H, KVH, D = c.num_heads, c.num_kv_heads, c.head_dim
        B, L, _ = x.shape
        if c.mla is not None:  # the absorbed q (B, H, L, R + C), k = v (B, 1, L, R + C)
            cos_sin = (None, None)  # (NoPE: Kimi Linear's)
            if self.rope_freq is not None:
                cos_sin = self._cos_sin(x, positions, B, L)
            q, k, v = mla.project(self, x, *cos_sin)
            if c.query_scale is not None:  # (q' is linear in q: the scale carries through)
                q = self._scale_queries(q, x, positions, B, L)
            return q, k, v
        # F.linear, not self.wqkv(x), and the parameters from the modules' own dicts, not
        # nn.Module's __getattr__ (a Python call each): a decode step is small enough for
        # each to show.
        wqkv = self._modules["wqkv"]._parameters
        qkv = F.linear(x, wqkv["weight"], wqkv["bias"])  # (B, L, (H + 2 KVH) * D)
        norm, scaled = c.qk_norm, c.query_scale is not None
        if (
            L == 1 and norm is None and self.rope_freq is None and not scaled and not c.v_norm
        ):  # one token:
            # (B, H + 2 KVH, 1, D) split by heads: two view ops, not four (no transpose)
            return qkv.view(B, H + 2 * KVH, 1, D).split_with_sizes([H, KVH, KVH], dim=1)
        q, k, v = qkv.split_with_sizes([H * D, KVH * D, KVH * D], dim=-1)  # (B, L, H*D | KVH*D)
        before = norm is not None and not norm.after_rope  # (Qwen3, OLMo-2, Gemma 3: before)
        if before and norm.scope == "projection":  # OLMo-2: over all heads at once
            q, k = rms_norm(q, self.q_norm, norm.eps), rms_norm(k, self.k_norm, norm.eps)
        v = v.view(B, L, KVH, D).transpose(1, 2)  # (B, KVH, L, D)
        if c.v_norm:  # Gemma 3n, Gemma 4: each value head RMS-normed, no gain
            v = rms_norm(v, None, norm.eps)
        if norm is None and self.rope_freq is not None:  # q and k rotated in one call
            qk = qkv[..., : (H + KVH) * D].view(B, L, H + KVH, D).transpose(1, 2)
            qk = self.rotate(qk, *self._cos_sin(x, positions, B, L))  # (B, H + KVH, L, D)
            q, k = qk[:, :H], qk[:, H:]
        else:
            q = q.view(B, L, H, D)  # (B, L, H, D)
            k = k.view(B, L, KVH, D)  # (B, L, KVH, D)
            if before and norm.scope == "head":  # Qwen3, Gemma 3: each head on its own
                q, k = rms_norm(q, self.q_norm, norm.eps), rms_norm(k, self.k_norm, norm.eps)
            q = q.transpose(1, 2)  # (B, H, L, D)
            k = k.transpose(1, 2)  # (B, KVH, L, D)
            if self.rope_freq is not None:
                cos, sin = self._cos_sin(x, positions, B, L)
                q, k = self.rotate(q, cos, sin), self.rotate(k, cos, sin)  # (B, H|KVH, L, D)
            if norm is not None and norm.after_rope:  # Llama 4, nanochat, Hunyuan v1
                q, k = self._norm_after(q, k, norm.scope, norm.eps)
        if scaled:  # Llama 4's NoPE layers, Ministral 3: after RoPE and the norm
            q = self._scale_queries(q, x, positions, B, L)
        return q, k, v

    def _norm_after(
        self, q: torch.Tensor, k: torch.Tensor, scope: str, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q (B, H, L, D) and k (B, KVH, L, D) RMS-normed after RoPE: each head's D values,
        or all heads' together (scope projection: over (B, L, H*D), then back)."""
        if scope == "head":
            return rms_norm(q, self.q_norm, eps), rms_norm(k, self.k_norm, eps)
        out = []
        for t, gain in ((q, self.q_norm), (k, self.k_norm)):
            B, h, L, D = t.shape
            flat = t.transpose(1, 2).reshape(B, L, h * D)  # (B, L, h*D)
            out.append(rms_norm(flat, gain, eps).view(B, L, h, D).transpose(1, 2))
        return out[0], out[1]

    def _scale_queries(
        self, q: torch.Tensor, x: torch.Tensor, positions: torch.Tensor | None, B: int, L: int
    ) -> torch.Tensor:
        """q (B, H, L, .) times its position's query scale (QueryScaleConfig), at positions
        (B, L), (L,) or None (0..L-1), as transformers rounds it (rope.query_scales)."""
        qs = self.config.query_scale
        at = _positions(x, positions, B, L)
        scale = query_scales(qs, at)[:, None, :, None]  # (B|1, 1, L, 1) float32
        if qs.float32:  # Llama 4: (q * scales).to(q.dtype), the product in float32
            return (q * scale).to(q.dtype)
        return q * scale.to(q.dtype)  # Ministral 3: the scale rounded to q's dtype first

    def project_expanded(
        self, x: torch.Tensor, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """MLA's expanded form (model/mla.py) of x (B, L, E) at positions as project's: every
        head's query [rope(q_rope_h); q_nope_h] (B, H, L, D_x) (mla.expanded_width, zero
        padded), and k' = [rope(k_rope); c] (B, 1, L, R + C), the cache's (mla.expand_keys
        decompresses it)."""
        c = self.config
        B, L, _ = x.shape
        if c.mla is None:
            raise ValueError("project_expanded is multi-head latent attention's (mla) alone")
        cos_sin = (None, None)  # (NoPE: Kimi Linear's)
        if self.rope_freq is not None:
            cos_sin = self._cos_sin(x, positions, B, L)
        q_nope, q_rope, k = mla.parts(self, x, *cos_sin)
        q = mla.expand_queries(self, q_nope, q_rope)
        if c.query_scale is not None:  # (Mistral 4's: each head's whole query, as absorbed)
            q = self._scale_queries(q, x, positions, B, L)
        return q, k

    def _cos_sin(
        self, x: torch.Tensor, positions: torch.Tensor | None, B: int, L: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """project's cos and sin (B|1, 1, L, D) at positions (B, L), (L,) or None (0..L-1)."""
        at = _positions(x, positions, B, L)
        return cos_sin(self.rope_freq, self.rope_scaling, at, x.dtype)

    def output_gate(self, x: torch.Tensor) -> torch.Tensor | None:
        """The output gate of tokens x (B, L, E), sigmoid(wgate x) (B, L, gate_width: H*D,
        H*V with mla, H per head) in x's dtype (as Qwen3-Next's torch.sigmoid(gate)), which
        the merge multiplies the heads' output by; None for a config without one. Every merge of a gated
        model takes it (out_gate): attend_cached, attend_step, attend_padded, merge_heads."""
        if self.wgate is None:
            return None
        wgate = self._modules["wgate"]._parameters  # (as in project)
        return torch.sigmoid(F.linear(x, wgate["weight"], wgate["bias"]))  # (B, L, gate_width)

    def merge_heads(self, y: torch.Tensor, out_gate: torch.Tensor | None = None) -> torch.Tensor:
        """Attention's per-head output y (B, H, L, D) as the module's output (B, L, E): heads
        merged, gated by out_gate (B, L, gate_width) (output_gate(x) of the same tokens; required
        with output_gate), then wo (for a kernel run outside the module, engine/attend.py)."""
        return self._merge_heads(y, None, None, out_gate)

    def _merge_heads(
        self,
        y: torch.Tensor,
        gate: torch.Tensor | None,
        valid: torch.Tensor | None,
        out_gate: torch.Tensor | None = None,
        *,
        expanded: bool = False,
    ) -> torch.Tensor:
        """y (B, H, L, D) through the head mask gate (H,), the output gate out_gate
        (B, L, gate_width) and wo; rows not valid (B, L) zero. expanded: mla's y is its
        expanded heads' (B, H, L, V) (model/mla.py), merged as they are (not through W_uv)."""
        B, H, L, D = y.shape
        if gate is not None:
            y = y * gate.view(1, H, 1, 1)
        if out_gate is not None or self.wgate is not None:
            check_out_gate(self.config, out_gate, B, L, y)
        if self.config.mla is not None and not expanded:  # each head's latent dims by its W_uv
            y = mla.merge(self, y)  # (B, L, H*V)
        elif L == 1:  # (B, 1, H*D): one token's heads need no transpose (a view where it can)
            y = y.reshape(B, 1, H * D)
        else:
            y = y.transpose(1, 2).reshape(B, L, H * D)  # (B, L, H*D)
        if out_gate is not None:  # each head's dims (D; V with mla) by its own gate values
            y = y.reshape(B, L, H, -1) * out_gate.view(B, L, H, -1)  # (B, L, H, D|V)
            y = y.reshape(B, L, -1)  # (B, L, H*D|H*V)
        wo = self._modules["wo"]._parameters  # (as in project)
        out = F.linear(y, wo["weight"], wo["bias"])  # (B, L, E)
        if valid is not None:
            out = out.masked_fill(~valid[:, :, None], 0.0)
        return out

    def _softmax(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        heads: list[int],
        allowed: torch.Tensor | None,
        q_pos: int = 0,
        k_pos: int = 0,
    ) -> torch.Tensor:
        """softmax(q k^T * scale) in float32 over allowed keys (scores soft-capped, ALiBi's
        bias added, and each head's sink in the softmax without a column of its own, when
        the config says so), for query heads `heads`: q (B, H, R, D) at positions q_pos..,
        k (B, KVH, S, D) at positions k_pos.., allowed broadcastable to (B, 1, R, S)."""
        idx = list_tensor(heads, q.device)
        qh = q[:, idx]  # (B, n, R, D)
        kh = k[:, idx // self.config.group_size]  # (B, n, S, D): GQA head h reads kv h // G
        scores = capped_scores(qh, kh, self.scale, self.config.softcap)  # (B, n, R, S) float32
        if self.alibi is not None:
            rows = positions(q_pos, q.shape[2], q.device)  # (1, R)
            cols = positions(k_pos, k.shape[2], q.device)  # (1, S)
            scores += alibi_bias(self.alibi.heads(idx), rows, cols)  # (1, n, R, S)
        if allowed is not None:
            scores.masked_fill_(~allowed, float("-inf"))
        sinks = None
        if self.sinks is not None:
            sinks = self.sinks[idx].float().view(1, len(heads), 1, 1)  # (1, n, 1, 1)
        return sink_softmax(scores, sinks)  # (B, n, R, S)

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


def _positions(x: torch.Tensor, positions: torch.Tensor | None, B: int, L: int) -> torch.Tensor:
    """Absolute positions (B|1, L) on x's device from (B, L), (L,) or None (0..L-1): what
    RoPE's cos/sin and the query scale are computed at."""
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
    return positions
