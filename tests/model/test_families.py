"""The families' options as data: sliding window, q/k RMSNorm (per head, over the whole
projection), soft-capping, attention sinks, ALiBi and the softmax scale, against a plain float64
reference written here; cached against uncached with window reads; checkpoints keep the
options."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mha_serve.model import (
    AttentionConfig,
    MultiHeadAttention,
    init_weights,
    load_checkpoint,
    save_checkpoint,
)
from mha_serve.model.config import QKNormConfig, QueryScaleConfig, RopeConfig

ATOL = 1e-5
RTOL = 1e-5
OPTIONS = {
    "window": {"sliding_window": 4},
    "window_gqa_rope": {"sliding_window": 5, "rope": RopeConfig(theta=500.0)},
    "head_norm": {"qk_norm": QKNormConfig("head", 1e-5), "rope": RopeConfig()},
    "projection_norm": {"qk_norm": QKNormConfig("projection", 1e-6)},
    "softcap_scale": {"softcap": 3.0, "softmax_scale": 0.2, "sliding_window": 6},
    "sinks": {"sinks": True, "rope": RopeConfig(theta=500.0)},
    "rope_pairs": {"rope": RopeConfig(theta=300.0, interleaved=True)},  # Cohere, Helium
    "rope_partial_pairs": {  # GLM: half of each head, by pairs, and a window
        "rope": RopeConfig(theta=300.0, interleaved=True, partial=0.5),
        "sliding_window": 5,
    },
    "rope_partial": {"rope": RopeConfig(theta=300.0, partial=0.5), "qk_norm": QKNormConfig()},
    "sinks_window": {"sinks": True, "sliding_window": 4, "softmax_scale": 0.2},
    "alibi": {"alibi": True},  # BLOOM (6 heads: not a power of 2)
    "alibi_falcon_rw": {  # Falcon-RW's form: bfloat16 slope * position, scaled
        "alibi": True,
        "alibi_scale": 0.3,
        "alibi_bfloat16": True,
    },
    "alibi_window_norm": {  # MPT's alibi_bias_max, with a window and a q/k norm
        "alibi": True,
        "alibi_bias_max": 4.0,
        "sliding_window": 4,
        "qk_norm": QKNormConfig(),
    },
    # queries scaled by position (Ministral 3's form; floors at 3, 6, 9 within 11 tokens)
    "query_scale": {"rope": RopeConfig(theta=300.0), "query_scale": QueryScaleConfig(0.5, 3)},
    "query_scale_nope": {  # Llama 4's NoPE layers: (p + 1) / floor_scale, float32 product
        "query_scale": QueryScaleConfig(0.7, 2, offset=1, float32=True),
        "sliding_window": 5,
    },
    # q/k norms after RoPE: Llama 4's (no gain, pairs), nanochat's (no gain, turned the other
    # way), Hunyuan v1's (gains), one over the whole projection with a query scale
    "norm_after_rope": {
        "rope": RopeConfig(theta=300.0, interleaved=True),
        "qk_norm": QKNormConfig(after_rope=True, gain=False),
    },
    "norm_after_reverse_rope": {
        "rope": RopeConfig(theta=300.0, reverse=True),
        "qk_norm": QKNormConfig("head", 1e-5, after_rope=True, gain=False),
    },
    "norm_after_rope_gain": {
        "rope": RopeConfig(theta=300.0),
        "qk_norm": QKNormConfig("head", 1e-5, after_rope=True),
    },
    "projection_norm_after_scaled": {
        "rope": RopeConfig(theta=300.0),
        "qk_norm": QKNormConfig("projection", 1e-6, after_rope=True),
        "query_scale": QueryScaleConfig(0.3, 4),
    },
    "everything": {
        "sinks": True,
        "sliding_window": 3,
        "qk_norm": QKNormConfig("head"),
        "softcap": 2.0,
        "softmax_scale": 0.3,
        "rope": RopeConfig(theta=100.0),
    },
}


def assert_close(actual, expected, *, what, atol=ATOL, rtol=RTOL):
    actual, expected = actual.double(), expected.double()
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    diff = (actual - expected).abs()
    assert torch.allclose(actual, expected, atol=atol, rtol=rtol), (
        f"{what}: max abs diff {diff.max().item():.3e}, mean {diff.mean().item():.3e}"
    )


def make(option: str, *, num_kv_heads=2, head_dim=12, seed=0) -> MultiHeadAttention:
    config = AttentionConfig(48, 6, num_kv_heads, head_dim, **OPTIONS[option])
    module = MultiHeadAttention(config)
    init_weights(module, seed)
    with torch.no_grad():  # sharp attention: a wrong key or mask shows far above tolerance
        module.wqkv.weight.mul_(3.0)
    return module.eval()


def rms(x, w, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def reference_slopes(H, bias_max=8.0):
    """ALiBi's slopes as transformers' build_alibi_tensor writes them (BLOOM; MPT's
    alibi_bias_max in place of its 8): the closest power of 2 below H's, then every other
    slope of twice as many heads', the odd powers."""
    closest = 2 ** math.floor(math.log2(H))
    slopes = [2.0 ** (-bias_max * k / closest) for k in range(1, closest + 1)]
    extra = [2.0 ** (-bias_max * k / (2 * closest)) for k in range(1, 2 * (H - closest), 2)]
    return torch.tensor(slopes + extra, dtype=torch.float64)


def bfloat16_round(t):
    """float64 t rounded to the nearest bfloat16 value (8 significant bits, ties to even),
    written out: each value's mantissa in [0.5, 1) to a multiple of 2^-8."""
    mantissa, exponent = torch.frexp(t)
    return torch.ldexp(torch.round(mantissa * 256) / 256, exponent)


def reference(module, x, *, lengths=None, causal=True, first_position=0):
    """Every option written out in float64 over positions 0..L-1, by loops where it says
    what a key may see: (output (B, L, E), weights (B, H, L, L)). ALiBi's bias over
    positions first_position.. (the softmax is the same at any start, but for Falcon-RW's
    bfloat16 form)."""
    c = module.config
    H, KVH, D = c.num_heads, c.num_kv_heads, c.head_dim
    B, L, _ = x.shape
    p = {k: t.double() for k, t in module.state_dict().items()}
    qkv = F.linear(x.double(), p["wqkv.weight"], p.get("wqkv.bias"))
    q, k, v = qkv.split([H * D, KVH * D, KVH * D], dim=-1)
    norm = c.qk_norm
    gains = (p.get("q_norm", 1.0), p.get("k_norm", 1.0))  # (none: a norm without a gain)
    if norm is not None and not norm.after_rope and norm.scope == "projection":
        q, k = rms(q, gains[0], norm.eps), rms(k, gains[1], norm.eps)
    q, k, v = q.view(B, L, H, D), k.view(B, L, KVH, D), v.view(B, L, KVH, D)
    if norm is not None and not norm.after_rope and norm.scope == "head":
        q, k = rms(q, gains[0], norm.eps), rms(k, gains[1], norm.eps)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, h, L, D)
    if c.rope is not None:
        R = int(D * c.rope.partial)  # the first R dims of each head turn, the rest pass
        inv = 1.0 / c.rope.theta ** (torch.arange(0, R, 2, dtype=torch.float64) / R)
        ang = torch.arange(L, dtype=torch.float64)[:, None] * inv  # (L, R/2)
        if c.rope.reverse:  # nanochat: rotate_half [x2, -x1], the other way round
            ang = -ang

        def turn(t):
            out = t.clone()
            for i in range(R // 2):  # pair i: dims (2i, 2i + 1), or (i, i + R/2) as halves
                a, b = (2 * i, 2 * i + 1) if c.rope.interleaved else (i, i + R // 2)
                cos, sin = ang[:, i].cos(), ang[:, i].sin()
                out[..., a] = t[..., a] * cos - t[..., b] * sin
                out[..., b] = t[..., b] * cos + t[..., a] * sin
            return out

        q, k = turn(q), turn(k)
    if norm is not None and norm.after_rope and norm.scope == "head":
        q, k = rms(q, gains[0], norm.eps), rms(k, gains[1], norm.eps)
    if norm is not None and norm.after_rope and norm.scope == "projection":
        flat = lambda t: t.transpose(1, 2).reshape(B, L, -1)  # noqa: E731  (B, L, h*D)
        back = lambda t, h: t.view(B, L, h, D).transpose(1, 2)  # noqa: E731
        q = back(rms(flat(q), gains[0], norm.eps), H)
        k = back(rms(flat(k), gains[1], norm.eps), KVH)
    if c.query_scale is not None:  # q at position i times 1 + beta log(1 + floor(..))
        qs = c.query_scale
        at = torch.arange(L, dtype=torch.float64)
        q = q * (1 + qs.beta * torch.log1p(torch.floor((at + qs.offset) / qs.floor_div)))[:, None]
    k = k.repeat_interleave(H // KVH, dim=1)
    v = v.repeat_interleave(H // KVH, dim=1)
    scores = q @ k.transpose(-2, -1) * c.scale  # (B, H, L, L)
    if c.softcap is not None:
        scores = c.softcap * torch.tanh(scores / c.softcap)
    if c.alibi:  # slope * key position: each row shifted by a constant, the same softmax
        slopes = reference_slopes(H, c.alibi_bias_max)[:, None]  # (H, 1)
        at = first_position + torch.arange(L, dtype=torch.float64)  # (L,)
        if c.alibi_bfloat16:  # Falcon-RW: bfloat16(slope) * bfloat16(position), in bfloat16
            bias = bfloat16_round(bfloat16_round(slopes) * bfloat16_round(at))
        else:
            bias = slopes * at  # (H, L)
        scale = 1.0 if c.alibi_scale is None else c.alibi_scale
        scores = scores + scale * bias.view(1, H, 1, L)
    n = [L] * B if lengths is None else list(lengths)
    allowed = torch.zeros(B, 1, L, L, dtype=torch.bool)
    for b in range(B):
        for i in range(n[b]):
            for j in range(n[b]):
                seen = j <= i if causal else True
                if c.sliding_window is not None:
                    seen = seen and abs(i - j) < c.sliding_window
                allowed[b, 0, i, j] = seen
            allowed[b, 0, n[b] :, :] = True  # padded rows: anything, dropped below
    scores = scores.masked_fill(~allowed, float("-inf"))
    if c.sinks:  # as transformers' GPT-OSS: one more column, softmaxed, then dropped
        sinks = p["sinks"].view(1, H, 1, 1).expand(B, H, L, 1)
        weights = torch.cat([scores, sinks], dim=-1).softmax(-1)[..., :-1]
    else:
        weights = scores.softmax(-1)
    out = F.linear((weights @ v).transpose(1, 2).reshape(B, L, H * D), p["wo.weight"], p["wo.bias"])
    for b in range(B):
        out[b, n[b] :] = 0
        weights[b, :, n[b] :] = 0
    return out, weights


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("causal", [True, False])
def test_forward_and_weights_equal_the_reference(option, causal):
    """A padded batch whose sequences are longer and shorter than the window: output of
    the fused path and of the weights path, weights, a query range and narrowed heads."""
    module = make(option)
    x = torch.randn(3, 11, 48, generator=torch.Generator().manual_seed(1))
    lengths = torch.tensor([11, 7, 2])
    want, want_w = reference(module, x, lengths=lengths, causal=causal)
    with torch.no_grad():
        fast = module(x, lengths=lengths, causal=causal)
        slow = module(x, lengths=lengths, causal=causal, need_weights=True)
        part = module(
            x,
            lengths=lengths,
            causal=causal,
            need_weights=True,
            weight_heads=[4, 1],
            query_range=(3, 9),
        )
    assert fast.overflow.rows() == [] and fast.weights is None
    assert_close(fast.output, want, what="fused output")
    assert_close(slow.output, want, what="output with weights")
    assert_close(slow.weights, want_w, what="weights")
    assert_close(part.weights, want_w[:, [4, 1], 3:9], what="narrowed weights")


def test_window_at_least_the_length_changes_nothing():
    """A window no sequence reaches is full attention, bit for bit (no mask at all)."""
    plain = make("window")
    wide = MultiHeadAttention(AttentionConfig(48, 6, 2, 12, sliding_window=11)).eval()
    wide.load_state_dict(plain.state_dict())
    x = torch.randn(2, 11, 48, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = MultiHeadAttention(AttentionConfig(48, 6, 2, 12)).eval()
        full.load_state_dict(plain.state_dict())
        assert torch.equal(wide(x, causal=True).output, full(x, causal=True).output)
        assert not torch.equal(plain(x, causal=True).output, full(x, causal=True).output)


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("sizes", [[1] * 9, [6, 1, 1, 4, 1], [10, 3]])
@pytest.mark.parametrize("read_from", ["start", "window"])
def test_cached_steps_with_window_reads_equal_one_forward(option, sizes, read_from):
    """Session steps (prefill, decode past the window, chunks) over keys read from position
    0, or from where the step's window starts (what a session past its window keeps),
    equal the rows of one causal forward, outputs and weights (over absolute positions)."""
    module = make(option, num_kv_heads=1 if option == "window" else 2)
    W = module.config.sliding_window
    L = sum(sizes)
    x = torch.randn(1, L, 48, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        whole = module(x, causal=True, need_weights=True)
        q, k, v = module.project(x)  # rotated at 0..L-1, as a session caches them
        past = 0
        for n in sizes:
            first = 0 if read_from == "start" or W is None else max(0, past + 1 - W)
            kv = [(k[:, :, first : past + n], v[:, :, first : past + n])]
            got = module.attend_cached(
                q[:, :, past : past + n],
                kv,
                past_lengths=[past],
                new_lengths=[n],
                first_keys=[first],
                need_weights=True,
            )
            rows = slice(past, past + n)
            assert_close(got.output, whole.output[:, rows], what=f"step at {past}")
            assert_close(
                got.weights, whole.weights[:, :, rows, : past + n], what=f"weights at {past}"
            )
            past += n


def test_a_read_that_misses_keys_the_window_sees_is_refused():
    module = make("window")  # window 4
    q, k, v = module.project(torch.randn(1, 10, 48))
    with pytest.raises(ValueError, match=r"first_keys must be in \[0, 5\]"):
        module.attend_cached(
            q[:, :, 8:10],
            [(k[:, :, 6:10], v[:, :, 6:10])],
            past_lengths=[8],
            new_lengths=[2],
            first_keys=[6],
        )


@pytest.mark.parametrize("scope", ["head", "projection"])
def test_qk_norm_is_applied_before_rope_with_its_own_weights(scope):
    """q and k are normalised, then rotated: changing a norm weight changes q and k; norms
    after RoPE would leave |q| per pair unchanged by the rotation, which this checks not."""
    module = make("head_norm" if scope == "head" else "projection_norm")
    x = torch.randn(1, 5, 48, generator=torch.Generator().manual_seed(4))
    c = module.config
    assert module.q_norm.shape == ((c.num_heads if scope == "projection" else 1) * 12,)
    with torch.no_grad():
        q, before, _ = module.project(x)
        module.k_norm.mul_(2.0)
        k2 = module.project(x)[1]
    assert_close(k2, 2.0 * before, what="k scales with its norm weight")
    if scope == "head":  # RoPE keeps each rotated pair's length: per-head rms of q is the
        # norm's, whatever the position
        unrotated = MultiHeadAttention(AttentionConfig(48, 6, 2, 12, qk_norm=c.qk_norm))
        unrotated.load_state_dict(module.state_dict())
        with torch.no_grad():
            q0 = unrotated.project(x)[0]
        pairs = lambda t: t[..., :6].pow(2) + t[..., 6:].pow(2)  # noqa: E731
        assert_close(pairs(q), pairs(q0), what="rotation after the norm keeps pair lengths")


@pytest.mark.parametrize("scope", ["head", "projection"])
def test_qk_norm_of_huge_inputs_does_not_overflow_to_zero(scope):
    """The norm is scale-free: x * 1e20 gives the q and k of x. Squared in float32, q^2
    overflowed (from |q| ~ 1.8e19), 1 / sqrt(inf) made q and k all zeros and every row's
    attention uniform, returned as a finite answer (found by a float64 reference over gRPC)."""
    module = make("head_norm" if scope == "head" else "projection_norm")
    x = torch.randn(1, 5, 48, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        module.wqkv.bias.zero_()  # q and k then scale with x
        q, k, _ = module.project(x)
        for factor in (1e20, 1e30):
            q_big, k_big, _ = module.project(x * factor)
            assert_close(q_big, q, what=f"q of x * {factor:g}")
            assert_close(k_big, k, what=f"k of x * {factor:g}")


def test_options_survive_a_checkpoint_round_trip(tmp_path):
    module = make("everything")
    path = tmp_path / "m.safetensors"
    save_checkpoint(module, path)
    loaded = load_checkpoint(path)
    assert loaded.config == module.config
    x = torch.randn(2, 7, 48)
    with torch.no_grad():
        assert torch.equal(loaded(x, causal=True).output, module(x, causal=True).output)


def test_a_checkpoint_whose_sinks_are_not_finite_in_the_served_dtype_is_refused(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    path = tmp_path / "m.safetensors"
    save_checkpoint(make("sinks"), path)
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
    tensors = load_file(path)
    tensors["sinks"][2] = 1e5  # finite in float32, inf in float16
    save_file(tensors, path, metadata=metadata)
    assert load_checkpoint(path).sinks[2] == 1e5
    with pytest.raises(ValueError, match="key 'sinks' holds NaN or Inf as float16"):
        load_checkpoint(path, dtype=torch.float16)
    tensors["sinks"][2] = math.nan
    save_file(tensors, path, metadata=metadata)
    with pytest.raises(ValueError, match="key 'sinks' holds NaN or Inf as float32"):
        load_checkpoint(path)


@pytest.mark.parametrize(
    ("kwargs", "piece"),
    [
        ({"sliding_window": 0}, "sliding_window must be >= 1"),
        ({"sliding_window": 2.5}, "sliding_window must be an int"),
        ({"softcap": 0.0}, "softcap must be a finite number > 0"),
        ({"softcap": math.inf}, "softcap must be a finite number > 0"),
        ({"qk_norm": {"scope": "layer"}}, "qk_norm scope 'layer' is not supported"),
        ({"qk_norm": {"eps": -1.0}}, "qk_norm eps must be a finite number >= 0"),
        ({"qk_norm": {"gain": 1}}, "qk_norm gain must be true or false, got 1"),
        ({"qk_norm": {"weight": 1}}, "unknown qk_norm key(s) ['weight']"),
        ({"rope": {"partial": 0.0}}, "rope partial must be in (0, 1], got 0.0"),
        ({"rope": {"partial": 1.5}}, "rope partial must be in (0, 1], got 1.5"),
        ({"rope": {"partial": "half"}}, "rope partial must be a finite number"),
        ({"rope": {"partial": 0.125}}, "rope partial 0.125 of head_dim 8 rotates 1 dims"),
        ({"rope": {"partial": 0.1}}, "of head_dim 8 rotates 0 dims"),
        ({"rope": {"partial": 0.5}, "head_dim": 6}, "rotates 3 dims: it must be an even"),
        ({"rope": {"interleaved": 1}}, "rope interleaved must be true or false, got 1"),
        ({"rope": {"reverse": "yes"}}, "rope reverse must be true or false, got 'yes'"),
        ({"qk_norm": {"after_rope": 1}}, "qk_norm after_rope must be true or false, got 1"),
        ({"query_scale": {"beta": 0.1}}, "query_scale is missing required key(s) ['floor_div']"),
        ({"query_scale": {"beta": 0.1, "floor_div": 0}}, "query_scale floor_div must be > 0"),
        ({"query_scale": {"beta": -1, "floor_div": 8}}, "query_scale beta must be >= 0"),
        ({"query_scale": {"beta": 0.1, "floor_div": 8, "offset": -1}}, "offset must be an int"),
        ({"query_scale": {"beta": 0.1, "floor_div": 8, "x": 1}}, "unknown query_scale key"),
        ({"chunk_size": 0, "causal": True}, "chunk_size must be >= 1"),
        ({"chunk_size": 8}, "chunk_size needs causal = true"),
    ],
)
def test_bad_options_are_refused_by_name(kwargs, piece):
    with pytest.raises(ValueError) as err:
        AttentionConfig(48, 6, **kwargs)
    assert piece in str(err.value), str(err.value)


def test_score_factor_covers_scales_above_one_and_small_caps():
    assert AttentionConfig(48, 6).score_factor == 1.0
    assert AttentionConfig(48, 6, softmax_scale=4.0).score_factor == 4.0
    assert AttentionConfig(48, 6, softmax_scale=4.0, softcap=0.5).score_factor == 8.0
    assert AttentionConfig(48, 6, softcap=50.0).score_factor == 1.0


@pytest.mark.parametrize(("dtype", "atol"), [(torch.bfloat16, 5e-2), (torch.float16, 1e-2)])
def test_low_precision_with_every_option_stays_near_float32(dtype, atol):
    """The norms and the soft-capped kernel compute in float32 inside; stateless and cached
    steps over a narrower cache (float16 K/V) stay near the float32 model."""
    module = make("everything")
    narrow = MultiHeadAttention(module.config, dtype=dtype)
    narrow.load_state_dict(module.state_dict())
    x = torch.randn(2, 12, 48, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = module(x, lengths=torch.tensor([12, 7]), causal=True).output
        got = narrow(x.to(dtype), lengths=torch.tensor([12, 7]), causal=True).output
        q, k, v = narrow.project(x[:1].to(dtype))
        kv = [(k[:, :, 6:].half(), v[:, :, 6:].half())]  # window 3: step at 8 reads from 6
        step = narrow.attend_cached(
            q[:, :, 8:], kv, past_lengths=[8], new_lengths=[4], first_keys=[6]
        )
    assert_close(got.float(), want, what=f"{dtype} forward", atol=atol, rtol=atol)
    assert_close(step.output.float(), want[:1, 8:], what=f"{dtype} cached", atol=atol, rtol=atol)


def test_rope_frequencies_follow_the_module_and_stay_float32():
    """On the weights' device from the start and after every move (a step then copies
    nothing from the host for them), and never rounded by a move to another dtype."""
    config = AttentionConfig(64, 4, rope={"theta": 100.0})
    module = MultiHeadAttention(config)
    freq = module.rope_freq.clone()
    module.to(torch.bfloat16)
    assert module.rope_freq.dtype == torch.float32 and torch.equal(module.rope_freq, freq)
    module.to("meta")  # a device other than the CPU (this machine has no GPU)
    assert module.rope_freq.device.type == "meta" and module.rope_freq.dtype == torch.float32
    assert MultiHeadAttention(config, device="meta").rope_freq.device.type == "meta"


@pytest.mark.parametrize("option", ["softcap", "sinks"])
def test_the_explicit_kernel_copies_no_key_or_value_per_query_head(option):
    """A decode token of 64 query heads over 8 KV heads of 4096 keys: the kernel's largest
    allocation is its scores (1 MiB), never K or V (8 MiB) per query head. Broadcast over the
    group, its products copied K and V 8 times (64 MiB each) on every step, 13-17x the plain
    kernel's time at 4096 keys on the CPU."""
    from torch.profiler import ProfilerActivity, profile

    from mha_serve.model.cached import explicit_attention

    g = torch.Generator().manual_seed(6)
    q = torch.randn(1, 64, 1, 64, generator=g)
    k, v = torch.randn(1, 8, 4096, 64, generator=g), torch.randn(1, 8, 4096, 64, generator=g)
    softcap = 5.0 if option == "softcap" else None
    sinks = torch.randn(64, generator=g) if option == "sinks" else None
    with (
        torch.inference_mode(),
        profile(activities=[ProfilerActivity.CPU], profile_memory=True) as p,
    ):
        got = explicit_attention(q, k, v, None, 0.125, softcap, sinks)
    largest = max(e.cpu_memory_usage for e in p.events())
    assert 0 < largest < k.numel() * k.element_size(), f"{largest} bytes at once"
    kx, vx = k.repeat_interleave(8, dim=1), v.repeat_interleave(8, dim=1)  # (1, 64, S, D)
    scores = (q @ kx.transpose(-2, -1)) * 0.125
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if sinks is not None:
        scores = torch.cat([scores, sinks.view(1, 64, 1, 1)], dim=-1)
    want = scores.softmax(-1)[..., :4096] @ vx
    assert_close(got, want, what="explicit kernel")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kv_heads", [6, 2, 1])
def test_sinks_by_sdpa_equal_the_explicit_kernel(dtype, kv_heads):
    """The fused path for sinks (SDPA and its logsumexp, over SINKS_BY_SDPA_MIN_SCORES
    scores per head or without GQA) against the explicit kernel, MHA, GQA and MQA, each dtype the CPU serves: a
    padded batch (padded rows see every real key, padded keys none) under a window, and
    every key (no mask). Half precision: SDPA rounds its output once before the sink's
    share scales it, so 2 units in the last place of its values (~4) are allowed."""
    from mha_serve.model import cached

    g = torch.Generator().manual_seed(7)
    B, H, R, D = 2, 6, 40, 16

    def t(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    q, k, v = t(B, H, R, D), t(B, kv_heads, R, D), t(B, kv_heads, R, D)
    sinks = torch.randn(H, generator=g) * 3
    i = torch.arange(R)
    allowed = ((i[None] <= i[:, None]) & (i[None] > i[:, None] - 7)).expand(B, 1, R, R).clone()
    allowed[1, :, :, 30:] = False  # the second sequence has 30 real keys...
    allowed[1, :, 30:, :30] = True  # ...and its padded rows see them all
    tol = {torch.float32: 1e-5, torch.bfloat16: 2 * 2**-6, torch.float16: 2 * 2**-9}[dtype]
    for mask in (allowed, None):
        fused = cached.sinks_by_sdpa(q, k, v, mask, 0.25, sinks)
        whole = torch.cat(  # row by row: one row always runs the explicit kernel
            [
                cached.explicit_attention(q[:, :, r : r + 1], k, v, m, 0.25, None, sinks)
                for r in range(R)
                for m in [None if mask is None else mask[:, :, r : r + 1]]
            ],
            dim=2,
        )
        assert fused.dtype == dtype and fused.shape == whole.shape
        assert_close(fused, whole, what=f"sinks by SDPA, mask {mask is not None}", atol=tol, rtol=0)


@pytest.mark.parametrize("option", ["sinks", "sinks_window"])
def test_sinks_over_many_scores_take_the_fused_path_and_equal_the_reference(option, monkeypatch):
    """A forward of 128 query rows over 128 keys (SINKS_BY_SDPA_MIN_SCORES per head) runs
    sinks_by_sdpa, and its output equals the float64 reference; a session's decode step (one
    row) and a short prompt (16 x 16 scores, GQA) stay explicit."""
    from mha_serve.model import cached

    calls = []
    real = cached.sinks_by_sdpa

    def counted(*args):
        calls.append(tuple(args[0].shape[2:3]) + tuple(args[1].shape[2:3]))
        return real(*args)

    monkeypatch.setattr(cached, "sinks_by_sdpa", counted)
    module = make(option)
    assert 128 * 128 >= cached.SINKS_BY_SDPA_MIN_SCORES > 16 * 16
    x = torch.randn(2, 128, 48, generator=torch.Generator().manual_seed(8))
    lengths = torch.tensor([128, 101])
    want, _ = reference(module, x, lengths=lengths, causal=True)
    with torch.no_grad():
        got = module(x, lengths=lengths, causal=True).output
        module(x[:1, :16], causal=True)
        q, k, v = module.project(x[:1])
        module.attend_cached(
            q[:, :, 127:], [(k, v)], past_lengths=[127], new_lengths=[1], first_keys=[0]
        )
    assert calls == [(128, 128)]  # the forward's; not the short prompt's nor the step's
    # (float32 sums over 128 keys of outputs up to ~10: the explicit kernel is 1.4e-5 off)
    assert_close(got, want, what="forward through sinks_by_sdpa", atol=5e-5)
