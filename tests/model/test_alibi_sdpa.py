"""ALiBi through SDPA's fused kernel (cached.alibi_by_sdpa: the bias as a float32 mask, built
per chunk of query rows over the keys they may see) against the explicit float32 kernel
(forced: ALIBI_BY_SDPA_MIN_ROWS past every call) and against a float64 reference with the
bias written out here (slope * (j - i), slopes as transformers writes them; Falcon-RW's
bfloat16 terms): causal prompts, bidirectional rows, steps after a past, a window's read,
padded batches (one position per row, and a stateless batch whose mask has the batch and
the bias not), MHA/GQA/MQA, alibi_scale/alibi_bfloat16, float32, bfloat16 and float16;
chunks of a few rows; which calls take it; its memory.

Tolerances. float32: 1e-5 (test_families' ATOL/RTOL) against the reference and the
explicit kernel (max differences seen: ~1e-6). Half precision: the fused kernel rounds its
softmax weights to the dtype before p @ v, the explicit kernel only its output, so they
may be a unit in the last place of the output apart (up to 2^-7 of it in bfloat16, 2^-10
in float16): TOL allows two, and against the float64 reference (of the same rounded inputs)
each is within two of it."""

from __future__ import annotations

import pytest
import torch

from mha_serve.model import cached
from mha_serve.model.alibi import AlibiSlopes, alibi_slopes
from mha_serve.model.padded import padded_mask
from tests.model.test_alibi import make, tokens
from tests.model.test_families import assert_close, bfloat16_round, reference, reference_slopes

D, SCALE = 16, 0.25
# dtype: (atol, rtol); half precision: two units in the last place of an output in [2, 4)
# (most are below 2), and as much relative beyond
TOL = {
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (2 * 2**-6, 2**-7),
    torch.float16: (2 * 2**-9, 2**-10),
}
FORMS = {"exact": (1.0, False), "falcon_rw": (0.3, True)}  # (alibi_scale, alibi_bfloat16)
KINDS = ("prompt", "bidirectional", "step", "window", "padded", "stateless_padded")


def case(kind: str, H: int, KVH: int, dtype: torch.dtype, seed: int = 0):
    """q, k, v, allowed and the rows' and keys' absolute positions of one explicit_attention
    call as the module makes it for `kind`."""
    g = torch.Generator().manual_seed(seed)
    # (two sequences without a mask: the bias's (1, H, R, S) broadcast over the batch)
    B = {"padded": 3, "stateless_padded": 3, "bidirectional": 2}.get(kind, 1)
    if kind in ("prompt", "bidirectional", "stateless_padded"):  # token i at position i
        R = S = 29
        rows = cols = torch.arange(S)[None]  # (1, 29)
        i = torch.arange(S)
        allowed = None if kind == "bidirectional" else (i[None] <= i[:, None])[None, None]
        if kind == "stateless_padded":  # 29, 17 and 5 real tokens, as MultiHeadAttention._allowed
            valid = i[None] < torch.tensor([29, 17, 5])[:, None]  # (3, 29)
            allowed = allowed & valid[:, None, None, :] | ~valid[:, None, :, None]
    elif kind in ("step", "window"):  # 11 new tokens after 37 (a window of 9: from 37+1-9)
        past, R = 37, 11
        first, W = (29, 9) if kind == "window" else (0, None)
        S = past + R - first
        rows, cols = torch.arange(past, past + R)[None], torch.arange(first, past + R)[None]
        allowed = cached.key_mask(past, R, first, S, W, torch.device("cpu"))
    else:  # a padded batch of steps (attend_padded): its positions per row
        pasts, news, firsts = [40, 3, 20], [7, 2, 5], [33, 0, 13]
        R, S = 7, 14
        rows = torch.tensor(pasts)[:, None] + torch.arange(R)  # (3, 7)
        cols = torch.tensor(firsts)[:, None] + torch.arange(S)  # (3, 14)
        allowed = padded_mask(pasts, news, firsts, R, S, 8, torch.device("cpu"))
    q = torch.randn(B, H, R, D, generator=g).mul(2).to(dtype)
    k = torch.randn(B, KVH, S, D, generator=g).to(dtype)
    v = torch.randn(B, KVH, S, D, generator=g).to(dtype)
    return q, k, v, allowed, rows, cols


def float64_reference(q, k, v, allowed, rows, cols, form):
    """softmax(q . k * SCALE + scale * bias) @ v in float64, the bias written out."""
    H, KVH = q.shape[1], k.shape[1]
    scale, bf16 = FORMS[form]
    slopes = reference_slopes(H).view(1, H, 1, 1)
    at_q, at_k = rows.double()[:, None, :, None], cols.double()[:, None, None, :]
    if bf16:  # b(j) - b(i), b(p) = bfloat16(bfloat16(slope) * p)
        b = lambda p: bfloat16_round(bfloat16_round(slopes) * p)  # noqa: E731
        bias = b(at_k) - b(at_q)
    else:
        bias = slopes * (at_k - at_q)
    kx = k.double().repeat_interleave(H // KVH, dim=1)
    vx = v.double().repeat_interleave(H // KVH, dim=1)
    scores = q.double() @ kx.transpose(-2, -1) * SCALE + scale * bias
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    return scores.softmax(-1) @ vx


def explicit(monkeypatch, *args):
    with monkeypatch.context() as m:
        m.setattr(cached, "ALIBI_BY_SDPA_MIN_ROWS", 1 << 62)
        return cached.explicit_attention(*args)


@pytest.mark.parametrize("dtype", TOL)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("kv_heads", [12, 4, 1])
@pytest.mark.parametrize("kind", KINDS)
def test_alibi_by_sdpa_equals_the_explicit_kernel_and_the_reference(
    kind, kv_heads, form, dtype, monkeypatch
):
    """Chunks of 4 rows (ALIBI_MASK_CHUNK_ELEMENTS made small), so chunk boundaries, keys cut
    to each chunk's (a causal chunk's first keys, a window's last) and positions taken per
    chunk all show."""
    q, k, v, allowed, rows, cols = case(kind, 12, kv_heads, dtype)
    B, S = q.shape[0], k.shape[2]
    monkeypatch.setattr(cached, "ALIBI_MASK_CHUNK_ELEMENTS", 4 * B * 12 * S)
    scale, bf16 = FORMS[form]
    alibi = (AlibiSlopes(alibi_slopes(12), scale, bf16), rows, cols)
    calls = []
    real = cached.alibi_by_sdpa
    monkeypatch.setattr(cached, "alibi_by_sdpa", lambda *a: calls.append(1) or real(*a))
    fused = cached.explicit_attention(q, k, v, allowed, SCALE, None, None, alibi)
    assert calls == [1], "explicit_attention did not take alibi_by_sdpa"
    slow = explicit(monkeypatch, q, k, v, allowed, SCALE, None, None, alibi)
    assert calls == [1] and fused.dtype == slow.dtype == dtype
    want = float64_reference(q, k, v, allowed, rows, cols, form)
    atol, rtol = TOL[dtype]
    assert_close(fused, slow, what=f"{kind}: fused vs explicit", atol=atol, rtol=rtol)
    assert_close(fused, want, what=f"{kind}: fused vs float64", atol=atol, rtol=rtol)
    assert_close(slow, want, what=f"{kind}: explicit vs float64", atol=atol, rtol=rtol)


def test_a_cache_narrower_than_the_queries_runs_in_float32(monkeypatch):
    """A bfloat16 cache under a float32 model: the fused kernel takes one dtype, so q, K and
    V run in float32 (K, V widened exactly), as the explicit kernel computes."""
    q, k, v, allowed, rows, cols = case("step", 12, 4, torch.float32, seed=3)
    k, v = k.bfloat16(), v.bfloat16()
    alibi = (AlibiSlopes(alibi_slopes(12)), rows, cols)
    fused = cached.alibi_by_sdpa(q, k, v, allowed, SCALE, alibi)
    slow = explicit(monkeypatch, q, k, v, allowed, SCALE, None, None, alibi)
    assert fused.dtype == torch.float32
    assert_close(fused, slow, what="narrow cache: fused vs explicit")
    assert_close(fused, float64_reference(q, k, v, allowed, rows, cols, "exact"), what="float64")


@pytest.mark.parametrize("shape", ["8_mha", "12_gqa", "12_mqa"])
@pytest.mark.parametrize("form", ["exact", "falcon_rw"])
def test_the_module_takes_it_for_rows_not_for_a_decode_token(shape, form, monkeypatch):
    """A padded stateless batch (causal and not), a session's multi-token steps after a past
    and a ragged padded batch of steps take alibi_by_sdpa and equal the float64 reference
    (test_families', over the module); a decode token does not."""
    calls = []
    real = cached.alibi_by_sdpa
    monkeypatch.setattr(cached, "alibi_by_sdpa", lambda *a: calls.append(a[0].shape[2]) or real(*a))
    monkeypatch.setattr(cached, "ALIBI_MASK_CHUNK_ELEMENTS", 1 << 9)  # a few rows a chunk
    module = make(shape, form=form)
    E = module.config.embed_dim
    x = tokens(2, 24, E, seed=11)
    lengths = torch.tensor([24, 15])
    with torch.no_grad():
        for causal in (True, False):
            want, _ = reference(module, x, lengths=lengths, causal=causal)
            got = module(x, lengths=lengths, causal=causal).output
            assert_close(got, want, what=f"forward, causal {causal}")
        assert calls == [24, 24]
        want, _ = reference(module, x[:1], causal=True)
        q, k, v = module.project(x[:1])
        for past, n in ((0, 9), (9, 6), (15, 1), (16, 8)):  # a decode token among the steps
            step = module.attend_cached(
                q[:, :, past : past + n], [(k[:, :, : past + n], v[:, :, : past + n])],
                past_lengths=[past], new_lengths=[n],
            )  # fmt: skip
            assert_close(step.output, want[:, past : past + n], what=f"step at {past}")
        assert calls == [24, 24, 9, 6, 8]
        pad_k, pad_v = torch.cat([k, k]), torch.cat([v, v])  # (2, KVH, 24, D)
        pad_k[1, :, 12:], pad_v[1, :, 12:] = 1e3, -1e3  # row 1: 12 keys, then junk
        qs = torch.cat([q[:, :, 20:24], q[:, :, 10:14]])  # (2, H, 4, D): rows 20.. and 10..
        got = module.attend_padded(qs, pad_k, pad_v, past_lengths=[20, 10], new_lengths=[4, 2])
        assert calls[-1] == 4
        assert_close(got.output[0], want[0, 20:24], what="padded batch, row 0")
        assert_close(got.output[1, :2], want[0, 10:12], what="padded batch, row 1")


def test_its_memory_is_a_chunk_not_the_prompt():
    """A 1024-token causal prompt of 12 heads: the whole mask would be 48 MiB; the largest
    allocation stays under two chunks' worth of float32 (ALIBI_MASK_CHUNK_ELEMENTS)."""
    from torch.profiler import ProfilerActivity, profile

    g = torch.Generator().manual_seed(9)
    L, H = 1024, 12
    q, k, v = (torch.randn(1, H, L, 64, generator=g) for _ in range(3))
    at = torch.arange(L)[None]
    allowed = (at[0][None] <= at[0][:, None])[None, None]
    alibi = (AlibiSlopes(alibi_slopes(H)), at, at)
    with (
        torch.inference_mode(),
        profile(activities=[ProfilerActivity.CPU], profile_memory=True) as p,
    ):
        cached.alibi_by_sdpa(q, k, v, allowed, 0.125, alibi)
    largest = max(e.cpu_memory_usage for e in p.events())
    whole = H * L * L * 4
    assert 0 < largest <= 2 * cached.ALIBI_MASK_CHUNK_ELEMENTS * 4 < whole, f"{largest} bytes"
