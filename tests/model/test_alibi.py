"""ALiBi (AttentionConfig.alibi) on every path of the module against test_families' float64
reference (slope * key position, slopes as transformers' build_alibi_tensor writes them;
Falcon-RW's form, alibi_scale and alibi_bfloat16, with each term rounded as a bfloat16 is,
written out), at 8 heads and at 12 (not a power of 2), MHA, GQA and MQA: a padded stateless batch (the
fused path's output, the weights path's, its weights, a query range, narrowed heads),
session steps over keys at absolute positions (a lone step, a step with weights, decode
steps), a ragged batch of steps one kernel per session and in one padded kernel. Refusals
and what ALiBi leaves out (decode_one, pruning)."""

from __future__ import annotations

import pytest
import torch

from mha_serve.model import AttentionConfig, MultiHeadAttention, init_weights
from mha_serve.model.alibi import alibi_slopes
from mha_serve.model.prune import prune_heads
from tests.model.test_families import assert_close, reference, reference_slopes

# (num_heads, num_kv_heads, embed_dim): 8 heads MHA/GQA/MQA, 12 heads MHA/GQA/MQA
SHAPES = {
    "8_mha": (8, 8, 64),
    "8_gqa": (8, 2, 64),
    "8_mqa": (8, 1, 64),
    "12_mha": (12, 12, 96),
    "12_gqa": (12, 4, 96),
    "12_mqa": (12, 1, 96),
}


# The bias's forms: exact (BLOOM, MPT), and Falcon-RW's (bfloat16(slope) * position rounded
# to bfloat16, scaled by the scores' 1 / sqrt(head_dim); head_dim 8 here).
FORMS = {"exact": {}, "falcon_rw": {"alibi_scale": 8**-0.5, "alibi_bfloat16": True}}


def make(
    shape: str, *, bias_max: float = 8.0, seed: int = 0, form: str = "exact"
) -> MultiHeadAttention:
    H, KVH, E = SHAPES[shape]
    config = AttentionConfig(E, H, KVH, alibi=True, alibi_bias_max=bias_max, **FORMS[form])
    module = MultiHeadAttention(config)
    init_weights(module, seed)
    with torch.no_grad():  # sharp attention: a wrong bias shows far above tolerance
        module.wqkv.weight.mul_(2.0)
    return module.eval()


def tokens(B: int, L: int, E: int, seed: int) -> torch.Tensor:
    return torch.randn(B, L, E, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("H", [1, 2, 3, 5, 6, 8, 12, 16, 24, 40, 64, 112])
@pytest.mark.parametrize("bias_max", [8.0, 6.0])
def test_slopes_are_transformers(H, bias_max):
    """BLOOM's closest power of 2 and its extra odd powers (bias_max 8), and MPT's
    alibi_bias_max, written out in the reference."""
    torch.testing.assert_close(
        alibi_slopes(H, bias_max).double(), reference_slopes(H, bias_max), atol=0, rtol=1e-7
    )


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [True, False])
def test_stateless_batch_equals_the_reference(shape, causal, form):
    module = make(shape, form=form)
    E = module.config.embed_dim
    x = tokens(3, 13, E, seed=1)
    lengths = torch.tensor([13, 9, 2])
    want, want_w = reference(module, x, lengths=lengths, causal=causal)
    with torch.no_grad():
        fast = module(x, lengths=lengths, causal=causal)
        slow = module(x, lengths=lengths, causal=causal, need_weights=True)
        part = module(
            x,
            lengths=lengths,
            causal=causal,
            need_weights=True,
            weight_heads=[7, 0, 3],
            query_range=(4, 11),
        )
        alone = module(x[1:2, :9], causal=causal)  # unpadded: no mask at all
    assert fast.overflow.rows() == []
    assert_close(fast.output, want, what="fused path")
    assert_close(slow.output, want, what="output with weights")
    assert_close(slow.weights, want_w, what="weights")
    assert_close(part.weights, want_w[:, [7, 0, 3], 4:11], what="narrowed weights")
    assert_close(alone.output, want[1:2, :9], what="one unpadded sequence")


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("sizes", [[6, 1, 1, 5, 1], [1] * 7, [3, 9]])
def test_session_steps_see_keys_at_session_positions(shape, sizes, form):
    """Steps over a session's keys (all of them, from position 0): the lone step's path (no
    weights), with weights (columns over absolute positions) and a ragged batch of two
    sessions; each row equals its row of the reference over the whole sequence."""
    module = make(shape, form=form)
    E = module.config.embed_dim
    L = sum(sizes)
    x = tokens(1, L, E, seed=2)
    want, want_w = reference(module, x, causal=True)
    with torch.no_grad():
        q, k, v = module.project(x)
        past = 0
        for n in sizes:
            rows = slice(past, past + n)
            kv = [(k[:, :, : past + n], v[:, :, : past + n])]
            lengths = dict(past_lengths=[past], new_lengths=[n])
            lone = module.attend_cached(q[:, :, rows], kv, **lengths)
            weighed = module.attend_cached(q[:, :, rows], kv, need_weights=True, **lengths)
            assert_close(lone.output, want[:, rows], what=f"lone step at {past}")
            assert_close(weighed.output, want[:, rows], what=f"step with weights at {past}")
            assert_close(weighed.weights, want_w[:, :, rows, : past + n], what=f"weights {past}")
            past += n


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(("pasts", "news"), [([0, 5, 11, 3], [4, 1, 3, 2]), ([7, 20, 2], [1] * 3)])
def test_a_ragged_batch_per_session_and_padded_equals_the_reference(shape, pasts, news, form):
    """Several sessions at different pasts in one step: attend_cached (a kernel per session,
    decode rows included) and attend_padded (one kernel, keys padded to one width with junk)
    give each session's rows of its reference."""
    module = make(shape, form=form)
    c = module.config
    H, KVH, D, E = c.num_heads, c.num_kv_heads, c.head_dim, c.embed_dim
    B, T = len(pasts), max(news)
    seqs = [
        tokens(1, p + n, E, seed=10 + b) for b, (p, n) in enumerate(zip(pasts, news, strict=True))
    ]
    q = torch.zeros(B, H, T, D)
    kv = []
    S = max(p + n for p, n in zip(pasts, news, strict=True))
    keys, values = torch.full((B, KVH, S, D), 1e3), torch.full((B, KVH, S, D), -1e3)
    with torch.no_grad():
        for b, (s, p, n) in enumerate(zip(seqs, pasts, news, strict=True)):
            q_b, k_b, v_b = module.project(s)
            q[b, :, :n] = q_b[0, :, p:]
            kv.append((k_b, v_b))
            keys[b, :, : p + n], values[b, :, : p + n] = k_b[0], v_b[0]
        lengths = dict(past_lengths=pasts, new_lengths=news)
        each = module.attend_cached(q, kv, **lengths).output  # (B, T, E)
        padded = module.attend_padded(q, keys, values, **lengths).output
    for b, (s, p, n) in enumerate(zip(seqs, pasts, news, strict=True)):
        want = reference(module, s, causal=True)[0][0, p:]  # (n, E)
        assert_close(each[b, :n], want, what=f"session {b} per session")
        assert_close(padded[b, :n], want, what=f"session {b} padded")
        assert torch.all(padded[b, n:] == 0) and torch.all(each[b, n:] == 0)


def test_a_window_read_starts_past_zero_and_keeps_positions():
    """With a sliding window a step reads from where its window starts (first_keys): those
    keys keep their session positions, in both kernels."""
    config = AttentionConfig(96, 12, 4, alibi=True, sliding_window=5)
    module = MultiHeadAttention(config)
    init_weights(module, 3)
    module.eval()
    x = tokens(1, 20, 96, seed=4)
    want, _ = reference(module, x, causal=True)
    with torch.no_grad():
        q, k, v = module.project(x)
        for past, n in ((9, 1), (12, 3), (19, 1)):
            first = past + 1 - 5
            kv = [(k[:, :, first : past + n], v[:, :, first : past + n])]
            rows = q[:, :, past : past + n]
            lengths = dict(past_lengths=[past], new_lengths=[n], first_keys=[first])
            got = module.attend_cached(rows, kv, **lengths).output
            padded = module.attend_padded(rows, *kv[0], **lengths).output
            assert_close(got, want[:, past : past + n], what=f"window step at {past}")
            assert_close(padded, want[:, past : past + n], what=f"padded window step at {past}")


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("shape", ["8_gqa", "12_gqa"])
def test_far_into_a_session_the_bias_is_exact(shape, form):
    """A windowed session 2^18 tokens in: its steps read 5 keys at positions ~262k. The
    softmax sees only differences of key positions, so a query or its keys placed at other
    positions (a chunk's, or 0..) give the same answer in exact arithmetic; but a bias
    slope * position of such size is rounded in float32 (ulp 2^-7 at 2^17), so only the
    difference (key - query), both at session positions, stays exact. Equals the reference
    of the same tokens at positions P.. (no RoPE: where a window starts changes nothing;
    Falcon-RW's bfloat16 terms, every one of them a bfloat16 value, subtracted exactly)."""
    H, KVH, E = SHAPES[shape]
    config = AttentionConfig(E, H, KVH, alibi=True, sliding_window=5, **FORMS[form])
    module = MultiHeadAttention(config)
    init_weights(module, 7)
    module.eval()
    x = tokens(1, 12, E, seed=8)
    P = 1 << 18  # x's token 0 is the session's token P
    want, want_w = reference(module, x, causal=True, first_position=P)
    with torch.no_grad():
        q, k, v = module.project(x)
        for t, n in ((6, 1), (7, 3), (10, 2)):  # steps at tokens P + t.. of x's t..
            first = t + 1 - 5
            kv = [(k[:, :, first : t + n], v[:, :, first : t + n])]
            rows = q[:, :, t : t + n]
            lengths = dict(past_lengths=[P + t], new_lengths=[n], first_keys=[P + first])
            lone = module.attend_cached(rows, kv, **lengths).output
            padded = module.attend_padded(rows, *kv[0], **lengths).output
            weighed = module.attend_cached(rows, kv, need_weights=True, **lengths)
            assert_close(lone, want[:, t : t + n], what=f"step at P + {t}")
            assert_close(padded, want[:, t : t + n], what=f"padded step at P + {t}")
            assert_close(
                weighed.weights[..., P + first :],
                want_w[:, :, t : t + n, first : t + n],
                what=f"weights at P + {t}",
            )


def test_decode_one_leaves_alibi_to_the_step():
    """decode_one's kernel (SDPA without a mask) takes no bias: it writes nothing and says so,
    and the caller's step answers."""
    module = make("8_gqa")
    assert not module.decodes_in_one
    x = tokens(1, 6, 64, seed=5)
    with torch.no_grad():
        q, k, v = module.project(x)
        slot = torch.full((1, 4, 1, 8), 7.0)
        assert module.decode_one(x[:, 5:], slot, k, v) is None
    assert torch.all(slot == 7.0)


def test_slopes_follow_the_module_and_stay_float32():
    module = make("12_gqa")
    slopes = module.alibi.slopes.clone()
    module.to(torch.bfloat16)
    assert module.alibi.slopes.dtype == torch.float32 and torch.equal(module.alibi.slopes, slopes)
    module.to("meta")
    assert module.alibi.slopes.device.type == "meta"
    assert not any("alibi" in name for name in module.state_dict())


def test_low_precision_stays_near_float32():
    """The bias is added to float32 scores (never in the model's dtype)."""
    module = make("12_gqa")
    x = tokens(2, 40, 96, seed=6)
    for dtype in (torch.bfloat16, torch.float16):
        narrow = MultiHeadAttention(module.config, dtype=dtype)
        narrow.load_state_dict(module.state_dict())
        with torch.no_grad():
            want = module(x, causal=True).output
            got = narrow(x.to(dtype), causal=True).output.float()
        assert_close(got, want, what=f"{dtype}", atol=5e-2, rtol=5e-2)


def test_the_config_round_trips_and_refuses_what_it_cannot_do():
    c = AttentionConfig(96, 12, alibi=True, alibi_bias_max=6)
    assert c.alibi_bias_max == 6.0 and AttentionConfig.from_dict(c.to_dict()) == c
    assert not {"alibi_scale", "alibi_bfloat16"} & set(c.to_dict())  # (written only when set)
    rw = AttentionConfig(96, 12, alibi=True, alibi_scale=1, alibi_bfloat16=True)
    assert rw.alibi_scale == 1.0 and AttentionConfig.from_dict(rw.to_dict()) == rw
    assert rw.to_dict()["alibi_bfloat16"] is True
    assert "alibi" not in AttentionConfig(96, 12).to_dict()
    assert "alibi_bias_max" not in AttentionConfig(96, 12).to_dict()
    for kwargs, piece in (
        ({"alibi_scale": 0.5}, "alibi_scale is set but alibi is not"),
        ({"alibi_bfloat16": True}, "alibi_bfloat16 is set but alibi is not"),
        ({"alibi": True, "alibi_scale": 0.0}, "alibi_scale must be a finite number > 0"),
        ({"alibi": True, "alibi_scale": True}, "alibi_scale must be a number > 0"),
        ({"alibi": True, "alibi_bfloat16": 1}, "alibi_bfloat16 must be a bool"),
        ({"alibi": 1}, "alibi must be a bool"),
        ({"alibi": True, "alibi_bias_max": 0}, "alibi_bias_max must be a finite number > 0"),
        ({"alibi": True, "alibi_bias_max": "8"}, "alibi_bias_max must be a number"),
        ({"alibi": True, "softcap": 30.0}, "alibi with softcap or sinks is not supported"),
        ({"alibi": True, "sinks": True}, "alibi with softcap or sinks is not supported"),
    ):
        with pytest.raises(ValueError) as err:
            AttentionConfig(96, 12, **kwargs)
        assert piece in str(err.value), str(err.value)


def test_pruning_an_alibi_model_is_refused():
    """Slopes come from the head count: 11 heads' slopes are not 12 heads' minus one."""
    with pytest.raises(ValueError, match="ALiBi slopes come from its head count"):
        prune_heads(make("12_mha"), [3])
