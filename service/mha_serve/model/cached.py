"""The kernel of one sequence's attention over its cached keys, laid out by absolute
position (a KV cache read); MultiHeadAttention.attend_cached runs it per sequence. With a
sliding window the read starts where the window does (first_key), so a step costs the
window, not the session's length. Also the explicit kernel for what SDPA cannot do
(soft-capped scores, attention sinks, ALiBi's bias), shared with the stateless forward, and
the fused paths that stand in for it on the CPU where they can (sinks over many scores,
ALiBi over more than one query row: SDPA with the bias as a float mask).

The engine writes the new tokens' K/V into the cache first and then reads each session's
positions 0..past+new-1 in order, so keys need one copy (or none, for a session whose
blocks are contiguous) instead of a gather plus a [past | new] concatenation.

attend_cached attends one sequence at a time, each over its own keys: views into the cache
when its blocks are consecutive (the block pool keeps them so where it can), never padded
to the longest sequence. The projections around attention, where the weights are read, stay
batched. It is the engine's path on the CPU and for steps that ask for weights: gathering
the batch into one padded tensor copies every session's K/V on every step, which on the CPU
costs more than the kernels it saves (64 GQA sessions decoding at 256 and 1024 keys: 1.3x
and 1.2x the time, bench/engine_step.py --sessions 64). On CUDA, where a kernel per session
left the GPU at 1-5% of its memory bandwidth, the engine gathers instead (padded.py,
engine/attend.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .alibi import AlibiSlopes, alibi_bias, positions

# ALiBi for explicit_attention: (the module's AlibiSlopes over H heads, query positions
# (B|1, R), key positions (B|1, S)), absolute positions.
Alibi = tuple[AlibiSlopes, torch.Tensor, torch.Tensor]

# explicit_attention holds at most this many float32 scores at a time (64 MiB).
EXPLICIT_CHUNK_ELEMENTS = 1 << 24
# Attention sinks on the CPU over at least this many scores per head (query rows x keys),
# or over more than one query row without GQA: SDPA's fused kernel with its logsumexp
# (sinks_by_sdpa) instead of the explicit one. Below it, its call per KV head costs more
# than it saves (64 query heads over 8 KV heads, float32, 2 cores, causal: 64 x 64 scores
# 1.8 -> 2.6 ms, 128 x 128 7.2 -> 5.2 ms, 1024 x 1024 560 -> 192 ms; 8 heads of their own:
# 32 x 32 already 0.34 -> 0.21 ms). A decode step's one row stays explicit.
SINKS_BY_SDPA_MIN_SCORES = 1 << 14
# ALiBi over at least this many query rows on the CPU (a prompt, a multi-token step): SDPA's
# fused kernel with the bias as its float32 additive mask (alibi_by_sdpa) instead of the
# explicit kernel (12 heads of 64, 2 threads, a causal prompt of 1024 tokens: 36 against
# 127 ms in float32, 52 against 137 in bfloat16). A decode step's one row stays explicit:
# over 2048 keys the fused kernel took 2.5x its time in bfloat16 (2.5 against 1.0 ms), about
# the same in float32 (0.45 against 0.47; bench/alibi_prompt.py).
ALIBI_BY_SDPA_MIN_ROWS = 2
# alibi_by_sdpa builds its mask over at most this many elements at a time (8 MiB float32):
# the rows of one chunk, over only the keys some of them may see. (Causal prompts of 512 to
# 2048 tokens, 12 heads, 2 threads: 2^20 to 2^21 elements were fastest, within 10% of each
# other; 2^22 and the whole mask 10-30% slower, a fresh 48 MiB mask costing its page faults.)
ALIBI_MASK_CHUNK_ELEMENTS = 1 << 21


def attend_one(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    past: int,
    scale: float,
    *,
    first_key: int = 0,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    alibi: AlibiSlopes | None = None,
) -> torch.Tensor:
    """One sequence: q (1, H, n, D) at positions past..past+n-1 over keys, values
    (1, KVH, S, D) at positions first_key..past+n-1, causally and within the sliding window
    (query p sees key j when p - window < j <= p); sinks (H,): each head's sink logit
    (sink_softmax); alibi: each head's ALiBi slope (and its form), over those absolute positions.
    Returns (1, H, n, D) in q's dtype."""
    _, H, n, _ = q.shape
    S, KVH = keys.shape[2], keys.shape[1]
    # The last query (position past + n - 1) sees key first_key: then so does every query
    # after its own position, and only the causal mask is left.
    whole = window is None or past + n - 1 - first_key < window
    if softcap is not None or sinks is not None or alibi is not None:  # float32 scores, never
        # rounded to the cache's
        allowed = None if n == 1 and whole else key_mask(past, n, first_key, S, window, q.device)
        biases = None
        if alibi is not None:
            biases = (alibi, positions(past, n, q.device), positions(first_key, S, q.device))
        return explicit_attention(q, keys, values, allowed, scale, softcap, sinks, biases)
    narrow = keys.dtype != q.dtype  # a cache narrower than the model (kv_cache_dtype)
    qk = q.to(keys.dtype) if narrow else q
    if n == 1 and whole:
        y = attend_token(qk, keys, values, scale)
    else:
        # n tokens from position 0 are plain (top-left) causal while the window holds
        # them all.
        plain = whole and past == 0 and first_key == 0
        allowed = None if plain else key_mask(past, n, first_key, S, window, q.device)
        y = F.scaled_dot_product_attention(
            qk,
            keys,
            values,
            attn_mask=allowed,
            is_causal=n > 1 and plain,
            scale=scale,
            enable_gqa=KVH != H,
        )
    return y.to(q.dtype) if narrow else y


def key_mask(
    past: int, n: int, first_key: int, S: int, window: int | None, device: torch.device
) -> torch.Tensor:
    """(1, 1, n, S) bool: new token t (absolute position past + t) may see key j (absolute
    position first_key + j) when j's position <= past + t and, with a window, past + t -
    window < j's position."""
    t = torch.arange(past, past + n, device=device)[:, None]  # (n, 1) query positions
    j = torch.arange(first_key, first_key + S, device=device)[None, :]  # (1, S) key positions
    allowed = j <= t
    if window is not None:
        allowed &= j > t - window
    return allowed[None, None]  # (1, 1, n, S)


def capped_scores(
    q: torch.Tensor, k: torch.Tensor, scale: float, softcap: float | None
) -> torch.Tensor:
    """q k^T * scale in float32 for q (..., R, D) and k (..., S, D), soft-capped (Gemma 2:
    softcap * tanh(scores / softcap)) when softcap is set: (..., R, S)."""
    scores = (q.float() * scale) @ k.float().transpose(-2, -1)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    return scores


def sink_softmax(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """softmax over the last dimension of float32 scores (..., S), in place; with sinks
    (broadcastable to (..., 1), float32), each row's sink joins the softmax as one more
    logit whose column is then dropped (GPT-OSS, as transformers' eager attention: the
    weights over the keys sum to 1 / (1 + exp(sink - logsumexp(scores))) < 1). A finite
    sink keeps a row finite whatever its scores: the row's largest logit is subtracted
    first, the sink's included."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    top = torch.maximum(scores.amax(dim=-1, keepdim=True), sinks)  # (..., 1)
    p = scores.sub_(top).exp_()  # (..., S)
    return p.div_(p.sum(dim=-1, keepdim=True) + (sinks - top).exp())


def explicit_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor | None,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
    alibi: Alibi | None = None,
) -> torch.Tensor:
    """Attention whose softmax SDPA cannot make (soft-capped scores, attention sinks, ALiBi),
    in float32, query rows in chunks of at most EXPLICIT_CHUNK_ELEMENTS scores: q (B, H, R,
    D), k and v (B, KVH, S, D) (query head h reads KV head h // (H / KVH)), allowed
    broadcastable to (B, 1, R, S) (None: every key), sinks (H,) (None: none), alibi (Alibi:
    slopes and the rows' and keys' absolute positions; None: none), its bias added to the
    scores before the mask. Every row must see a key. Returns (B, H, R, D) in q's dtype.
    On the CPU, sinks over many scores run sinks_by_sdpa and ALiBi over
    ALIBI_BY_SDPA_MIN_ROWS rows or more alibi_by_sdpa: the same softmax by SDPA's kernel.

    Each KV head's G query heads are the rows of one product with it, (B, KVH, G*n, D) @
    (B, KVH, D, S), as padded.py folds them: a product broadcast over G instead (q as (B,
    KVH, G, n, D) against K as (B, KVH, 1, S, D)) copied K and V G times on every call,
    13-17x the plain kernel's time for a decode step of 64 heads over 8 KV heads at 4096
    keys on the CPU."""
    B, H, R, D = q.shape
    KVH, S = k.shape[1], k.shape[2]
    if (
        sinks is not None
        and softcap is None
        and alibi is None
        and R > 1
        and (KVH == H or R * S >= SINKS_BY_SDPA_MIN_SCORES)
        and q.device.type == "cpu"
        and q.dtype == k.dtype == v.dtype
    ):
        return sinks_by_sdpa(q, k, v, allowed, scale, sinks)
    if (
        alibi is not None
        and softcap is None
        and sinks is None
        and R >= ALIBI_BY_SDPA_MIN_ROWS
        and q.device.type == "cpu"
    ):
        return alibi_by_sdpa(q, k, v, allowed, scale, alibi)
    G = H // KVH
    kf, vf = k.float(), v.float()  # (B, KVH, S, D)
    if sinks is not None:
        sinks = sinks.float().view(1, KVH, G, 1, 1)  # query head h = kv * G + g
    out = q.new_empty(B, H, R, D)
    rows = max(1, EXPLICIT_CHUNK_ELEMENTS // max(1, B * H * S))
    for r0 in range(0, R, rows):
        n = min(R, r0 + rows) - r0
        qc = q[:, :, r0 : r0 + n].reshape(B, KVH, G * n, D)  # row g * n + i: head kv * G + g
        scores = capped_scores(qc, kf, scale, softcap).view(B, KVH, G, n, S)
        if alibi is not None:
            slopes, query_pos, key_pos = alibi
            bias = alibi_bias(slopes, query_pos[:, r0 : r0 + n], key_pos)  # (B|1, H, n, S)
            scores += bias.view(bias.shape[0], KVH, G, n, S)
        if allowed is not None:
            a = allowed if allowed.shape[2] == 1 else allowed[:, :, r0 : r0 + n]  # (B|1,1,n|1,S)
            scores.masked_fill_(~a[:, :, None], float("-inf"))
        p = sink_softmax(scores, sinks).view(B, KVH, G * n, S)
        y = p @ vf  # (B, KVH, G*n, D)
        out[:, :, r0 : r0 + n] = y.view(B, H, n, D).to(q.dtype)
    return out


def sinks_by_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor | None,
    scale: float,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """explicit_attention with sinks (no soft-capping) on the CPU as SDPA's fused kernel,
    which also returns each row's logsumexp (lse) of its scores: a sink s joins the softmax
    as one more logit whose column is dropped, so the row's weights are SDPA's times
    sum(exp(scores)) / (sum(exp(scores)) + exp(s)) = sigmoid(lse - s), and so is its
    output. No (R, S) scores are held. Same arguments; q, k, v of one dtype. Each KV head's
    G query heads run as one call over that head's K and V, broadcast (never copied)."""
    B, H, R, D = q.shape
    KVH, S = k.shape[1], k.shape[2]
    G = H // KVH
    mask = None
    if allowed is not None:  # (the kernel takes an additive mask in q's dtype)
        mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device)
        mask.masked_fill_(~allowed, float("-inf"))
    keep = sinks.float().view(1, H, 1)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    if G == 1:  # (MHA: one call)
        y, lse = flash(q, k, v, 0.0, False, attn_mask=mask, scale=scale)
        return (y.float() * torch.sigmoid(lse.float() - keep)[..., None]).to(q.dtype)
    out = q.new_empty(B, H, R, D)
    for h in range(KVH):
        heads = slice(h * G, (h + 1) * G)
        kh = k[:, h : h + 1].expand(B, G, S, D)
        vh = v[:, h : h + 1].expand(B, G, S, D)
        y, lse = flash(q[:, heads], kh, vh, 0.0, False, attn_mask=mask, scale=scale)
        share = torch.sigmoid(lse.float() - keep[:, heads])  # (B, G, R): the keys' share
        out[:, heads] = (y.float() * share[..., None]).to(q.dtype)
    return out


def alibi_by_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor | None,
    scale: float,
    alibi: Alibi,
) -> torch.Tensor:
    """explicit_attention with ALiBi (no soft-capping, no sinks) as SDPA's fused kernel, the
    bias its additive mask: alibi_bias's float32 values, -inf where allowed is False. Same
    arguments. The mask stays float32 for every q dtype (the CPU kernel adds it to its
    float32 scores; a bfloat16 mask would round slope * (j - i) to 8 bits); a cache narrower
    than q (or of another dtype) runs in float32, as the explicit kernel does.

    Query rows in chunks of at most ALIBI_MASK_CHUNK_ELEMENTS mask elements, each over only
    the keys from the first to the last that some row of the chunk may see (a causal chunk
    skips the keys after it, a window's those before it: the fused kernel skips no masked
    key of a float mask). Each KV head's G query heads are its rows, (B, KVH, G*n, D), as in
    explicit_attention; the bias's (H, n, S) is (KVH, G*n, S) in the same order."""
    B, H, R, D = q.shape
    KVH, S = k.shape[1], k.shape[2]
    G = H // KVH
    slopes, query_pos, key_pos = alibi
    out = q.new_empty(B, H, R, D)
    if not q.dtype == k.dtype == v.dtype:  # (the fused kernel takes one dtype)
        q, k, v = q.float(), k.float(), v.float()
    rows = max(1, ALIBI_MASK_CHUNK_ELEMENTS // max(1, B * H * S))
    for r0 in range(0, R, rows):
        n = min(R, r0 + rows) - r0
        lo, hi = 0, S  # the chunk's keys
        a = None
        if allowed is not None:
            a = allowed if allowed.shape[2] == 1 else allowed[:, :, r0 : r0 + n]  # (B|1,1,n|1,S)
            seen = a.reshape(-1, S).any(dim=0).nonzero()  # columns some row sees
            lo, hi = int(seen[0]), int(seen[-1]) + 1
            a = a[..., lo:hi]
        bias = alibi_bias(slopes, query_pos[:, r0 : r0 + n], key_pos[:, lo:hi])  # (B|1,H,n,S')
        if a is not None:  # (in place unless the mask has the batch and the bias not)
            hidden = ~a  # (B|1, 1, n|1, S')
            if hidden.shape[0] > bias.shape[0]:
                bias = bias.masked_fill(hidden, float("-inf"))
            else:
                bias.masked_fill_(hidden, float("-inf"))
        qc = q[:, :, r0 : r0 + n].reshape(B, KVH, G * n, D)  # row g * n + i: head kv * G + g
        mask = bias.view(bias.shape[0], KVH, G * n, hi - lo)
        y = F.scaled_dot_product_attention(
            qc, k[:, :, lo:hi], v[:, :, lo:hi], attn_mask=mask, scale=scale
        )  # (B, KVH, G*n, D)
        out[:, :, r0 : r0 + n] = y.view(B, H, n, D).to(out.dtype)
    return out


def attend_token(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
) -> torch.Tensor:
    """One token that sees every key it is given (a decode step): q (1, H, 1, D) over keys,
    values (1, KVH, S, D), query head h reading KV head h // G (H = KVH * G). Returns
    (1, H, 1, D).

    GQA/MQA: each KV head's G query heads are the G query rows of one SDPA call over that
    head (FlashAttention's own layout for decoding), so the kernel reads each KV head once.
    SDPA with enable_gqa on the CPU reads the keys once per query head instead: 8 query
    heads of 64 over 256 to 4096 keys took 1.5-3.2x the time in float32 (2 or 1 KV heads,
    one thread: `python bench/decode_attention.py`), up to 5x in float16. Rows are
    independent (one token, no mask), so the answer is SDPA's with enable_gqa."""
    H, D = q.shape[1], q.shape[3]
    KVH = keys.shape[1]
    if KVH == H:
        return F.scaled_dot_product_attention(q, keys, values, scale=scale)
    y = F.scaled_dot_product_attention(q.reshape(1, KVH, H // KVH, D), keys, values, scale=scale)
    return y.reshape(1, H, 1, D)
