"""Queries scaled by position (QueryScaleConfig) and q/k norms after RoPE (QKNormConfig's
after_rope, gain): rounded in each dtype as transformers rounds them, the same on every path
that projects (project at a session's positions, decode_one), and bounded by the largest
position a model serves (tests/engine/test_position_scale.py). The float64 reference and the cached steps over one projection are
tests/model/test_families.py's OPTIONS."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mha_serve.model import AttentionConfig, MultiHeadAttention, init_weights
from mha_serve.model.config import QKNormConfig, QueryScaleConfig, RopeConfig
from tests.model.test_families import assert_close, make

MINISTRAL3 = QueryScaleConfig(0.4, 3)  # 1 + beta * log(1 + floor(p / 3)), scale in q's dtype
LLAMA4 = QueryScaleConfig(0.6, 2, offset=1, float32=True)  # the product in float32
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def module_of(dtype: torch.dtype, **options) -> MultiHeadAttention:
    module = MultiHeadAttention(AttentionConfig(48, 6, 2, 12, causal=True, **options))
    init_weights(module, 3)
    return module.to(dtype).eval()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qs", [MINISTRAL3, LLAMA4], ids=["ministral3", "llama4"])
def test_the_scale_is_rounded_as_transformers_rounds_it(dtype, qs):
    """Bit for bit: Ministral 3's q * get_llama_4_attn_scale(p).to(q.dtype) and Llama 4's
    (q * (log1p(floor((p + 1.0) / floor_scale)) * attn_scale + 1.0)).to(q.dtype), written
    as transformers writes them, over the unscaled module's q at positions crossing floors."""
    scaled = module_of(dtype, rope=RopeConfig(theta=300.0), query_scale=qs)
    plain = MultiHeadAttention(dataclasses.replace(scaled.config, query_scale=None), dtype=dtype)
    plain.load_state_dict(scaled.state_dict())
    x = torch.randn(2, 13, 48, generator=torch.Generator().manual_seed(1)).to(dtype)
    pos = torch.arange(5, 18)[None]  # (1, L): a session's absolute positions
    with torch.no_grad():
        q, k, v = scaled.project(x, pos)
        q0, k0, v0 = plain.project(x, pos)
    at = pos[:, None, :, None]  # (1, 1, L, 1)
    if qs.float32:
        scales = torch.log1p(torch.floor((at.float() + 1.0) / 2)) * 0.6 + 1.0
        want = (q0 * scales).to(dtype)
    else:
        want = q0 * (1 + 0.4 * torch.log(1 + torch.floor(at / 3))).to(dtype)
    assert torch.equal(q, want) and torch.equal(k, k0) and torch.equal(v, v0)
    assert not torch.equal(q, q0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "options",
    [
        {"rope": RopeConfig(theta=300.0), "query_scale": MINISTRAL3},
        {"query_scale": LLAMA4},  # (NoPE)
        {
            "rope": RopeConfig(interleaved=True),
            "qk_norm": QKNormConfig(after_rope=True, gain=False),
        },
        {"rope": RopeConfig(reverse=True), "qk_norm": QKNormConfig(after_rope=True, gain=False)},
        {"rope": RopeConfig(), "qk_norm": QKNormConfig(after_rope=True), "query_scale": LLAMA4},
    ],
    ids=["ministral3", "llama4_nope", "llama4_rope", "nanochat", "hunyuan_scaled"],
)
def test_decode_one_writes_and_answers_as_project_and_attend_step(dtype, options):
    """The lone decode step (decode_one: its own norm, rotation and scale of one token at
    position S - 1) writes the K/V project makes and answers as attend_step over them, bit
    for bit, at positions on both sides of a floor."""
    module = module_of(dtype, **options)
    assert module.decodes_in_one
    KVH = module.config.num_kv_heads
    x = torch.randn(1, 12, 48, generator=torch.Generator().manual_seed(2)).to(dtype)
    with torch.no_grad():
        _, k, v = module.project(x)
        for S in (3, 4, 7, 12):  # the token at S - 1: 2, 3 (a floor of 3), 6, 11
            q1, k1, v1 = module.project(x[:, S - 1 : S], torch.tensor([S - 1]))  # one row
            keys = torch.cat([k[:, :, : S - 1], k1], dim=2)
            values = torch.cat([v[:, :, : S - 1], v1], dim=2)
            want = module.attend_step(q1, keys, values, S - 1)
            slot = torch.full((1, 2 * KVH, 1, 12), float("nan"), dtype=dtype)
            got = module.decode_one(x[:, S - 1 : S], slot, keys.clone(), values.clone())
            assert got is not None
            assert torch.equal(slot[:, :KVH], k1), f"K at {S - 1}"
            assert torch.equal(slot[:, KVH:], v1), f"V at {S - 1}"
            assert torch.equal(got, want), f"output at {S - 1}: {(got - want).abs().max()}"


@pytest.mark.parametrize("option", ["query_scale", "query_scale_nope", "norm_after_rope"])
def test_steps_projected_at_their_positions_and_batched_equal_one_forward(option):
    """Each step projected alone at its absolute positions (as the engine projects a
    session's new tokens), then attended over the keys so far: alone, and in one call with
    another sequence at other positions (attend_cached and attend_padded), the rows of one
    causal forward, across the floors (3, 6, 9 for query_scale)."""
    module = make(option)
    L = 11
    x = torch.randn(2, L, 48, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        whole = [module(x[b : b + 1], causal=True).output for b in range(2)]
        keys = [[], []]
        past = [0, 0]
        for sizes in ([4, 2], [1, 3], [3, 1], [1, 1], [2, 4]):  # b=0 and b=1 apart in position
            qs, kv = [], []
            for b, n in enumerate(sizes):
                n = min(n, L - past[b])
                pos = torch.arange(past[b], past[b] + n)
                q, k, v = module.project(x[b : b + 1, past[b] : past[b] + n], pos)
                keys[b].append((k, v))
                kv.append(tuple(torch.cat([t[i] for t in keys[b]], dim=2) for i in (0, 1)))
                qs.append((q, n))
                alone = module.attend_cached(q, [kv[b]], past_lengths=[past[b]], new_lengths=[n])
                rows = slice(past[b], past[b] + n)
                assert_close(alone.output, whole[b][:, rows], what=f"{option} {b} at {past[b]}")
            T = max(n for _, n in qs)
            q = torch.cat([torch.nn.functional.pad(q, (0, 0, 0, T - n)) for q, n in qs])
            news = [n for _, n in qs]
            both = module.attend_cached(q, kv, past_lengths=past, new_lengths=news)
            S = max(k.shape[2] for k, _ in kv)
            padded = [
                torch.cat([torch.nn.functional.pad(t[i], (0, 0, 0, S - t[i].shape[2])) for t in kv])
                for i in (0, 1)
            ]
            one_kernel = module.attend_padded(q, *padded, past_lengths=past, new_lengths=news)
            for b, n in enumerate(news):
                rows = slice(past[b], past[b] + n)
                for got, what in ((both, "batched"), (one_kernel, "padded")):
                    assert_close(got.output[b : b + 1, :n], whole[b][:, rows], what=what)
            past = [p + n for p, n in zip(past, news, strict=True)]


def test_a_norm_after_rope_is_not_a_norm_before_it():
    """With gains, normalising after the rotation differs from before it (Hunyuan v1's
    order, not Qwen3's); without gains the two agree (a rotation keeps each pair's length,
    so the RMS): the option must move the norm, not only drop the gains."""
    x = torch.randn(1, 9, 48, generator=torch.Generator().manual_seed(4))
    outs = {}
    for after in (False, True):
        for gain in (False, True):
            module = module_of(
                torch.float32,
                rope=RopeConfig(theta=300.0),
                qk_norm=QKNormConfig(after_rope=after, gain=gain),
            )
            with torch.no_grad():
                outs[after, gain] = module.project(x)[0]
    assert_close(outs[True, False], outs[False, False], what="no gain: the same RMS")
    assert (outs[True, True] - outs[False, True]).abs().max() > 1e-3
