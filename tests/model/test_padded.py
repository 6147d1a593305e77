"""MultiHeadAttention.attend_padded (a batch of sessions' steps in one kernel over keys padded
to one width) against attend_cached (one kernel per session) and against one causal forward
over each whole sequence: MHA/GQA/MQA, ragged pasts and new lengths, sliding windows, rotary
models, soft-capping, head_mask, low precision, no padding and much padding."""

import pytest
import torch

from mha_serve.model import padded, steps
from tests.model.test_incremental import VARIANTS, E, assert_close, make

# Padding columns hold this: finite (as KVCache.gather guarantees) and large, so a padded key
# that leaked into any softmax would show.
JUNK = 1e3
LOW_PRECISION_ATOL = {torch.bfloat16: 5e-2, torch.float16: 5e-3}  # against float32


def setup(module, pasts, news, *, window=None, width=None, dtype=None, seed=0):
    """Each sequence's tokens, the batch's queries, per-session K/V (attend_cached's form,
    read from the window's start) and the same padded to one width with JUNK."""
    g = torch.Generator().manual_seed(seed)
    B, T = len(pasts), max(news)
    w = module.wqkv.weight.dtype
    seqs = [torch.randn(1, p + n, E, generator=g).to(w) for p, n in zip(pasts, news, strict=True)]
    firsts = [0 if window is None else max(0, p + 1 - window) for p in pasts]
    x = torch.zeros(B, T, E, dtype=w)
    for b, (s, p, n) in enumerate(zip(seqs, pasts, news, strict=True)):
        x[b, :n] = s[0, p:]
    positions = torch.tensor(pasts)[:, None] + torch.arange(T)[None]  # (B, T)
    with torch.no_grad():
        q, _, _ = module.project(x, positions=positions)  # (B, H, T, D)
        kv = []
        for s, f in zip(seqs, firsts, strict=True):
            _, k, v = module.project(s)  # (1, KVH, p + n, D) at positions 0..
            kv.append((k[:, :, f:], v[:, :, f:]))
    S = max(k.shape[2] for k, _ in kv) if width is None else width
    c = module.config
    keys = torch.full((B, c.num_kv_heads, S, c.head_dim), JUNK, dtype=w)
    values = torch.full((B, c.num_kv_heads, S, c.head_dim), -JUNK, dtype=w)
    for b, (k, v) in enumerate(kv):
        keys[b, :, : k.shape[2]], values[b, :, : v.shape[2]] = k[0], v[0]
    if dtype is not None:
        keys, values = keys.to(dtype), values.to(dtype)
        kv = [(k.to(dtype), v.to(dtype)) for k, v in kv]
    return seqs, q, kv, keys, values, firsts


def check(module, pasts, news, *, window=None, width=None, head_mask=None, atol=1e-5):
    seqs, q, kv, keys, values, firsts = setup(module, pasts, news, window=window, width=width)
    lengths = dict(past_lengths=pasts, new_lengths=news, first_keys=firsts, head_mask=head_mask)
    with torch.no_grad():
        got = module.attend_padded(q, keys, values, **lengths).output  # (B, T, E)
        each = module.attend_cached(q, kv, **lengths).output
        assert_close(got, each, atol=atol, rtol=atol, what="padded vs per session")
        for b, (s, p, n) in enumerate(zip(seqs, pasts, news, strict=True)):
            full = module(s, causal=True, head_mask=head_mask).output[0, p:]  # (n, E)
            assert_close(got[b, :n], full, atol=atol, rtol=atol, what=f"row {b} vs forward")
            assert torch.all(got[b, n:] == 0), f"row {b}: padded tokens' rows must be 0"


FAMILIES = {
    "plain": {},
    "rope": {"rope": {"theta": 100.0}},
    "window": {"sliding_window": 4},
    "rope+window": {"rope": {"theta": 100.0}, "sliding_window": 6},
    "softcap": {"softcap": 5.0},
    "sinks+window": {"sinks": True, "rope": {"theta": 100.0}, "sliding_window": 6},
    # Gemma 4's local layers: q/k norm, values normed when projected, scale 1, a window
    "v_norm+window": {
        "rope": {"theta": 100.0},
        "qk_norm": {"scope": "head"},
        "v_norm": True,
        "softmax_scale": 1.0,
        "sliding_window": 6,
    },
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_ragged_steps_equal_per_session_and_forward(variant, family):
    config = FAMILIES[family]
    module = make(VARIANTS[variant], **config)
    window = config.get("sliding_window")
    check(module, [0, 5, 11, 3, 20], [4, 1, 3, 2, 1], window=window)  # prefill to decode
    check(module, [7, 30, 2, 19], [1, 1, 1, 1], window=window)  # decode, ragged pasts


@pytest.mark.parametrize("variant", VARIANTS)
def test_no_padding_needs_no_mask(variant, monkeypatch):
    """Decode rows that all read the width exactly: no mask, so the fastest kernel runs."""
    module = make(VARIANTS[variant])
    masks = []
    real = padded.padded_mask
    monkeypatch.setattr(steps, "padded_mask", lambda *a: masks.append(real(*a)) or masks[-1])
    check(module, [9, 9, 9], [1, 1, 1])
    assert masks == [None]
    check(module, [9, 8, 9], [1, 1, 1])  # one row one key short: masked
    assert masks[-1] is not None and masks[-1].shape == (3, 1, 1, 10)


@pytest.mark.parametrize("variant", VARIANTS)
def test_much_padding_and_head_mask(variant):
    module = make(VARIANTS[variant])
    gate = torch.tensor([1.0, 0.0, 0.5, 1.0, 2.0, 0.0, 1.0, 1.0])
    check(module, [1, 40, 0], [1, 1, 2], width=96, head_mask=gate)  # row 0: 2 keys of 96


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_matches_float32(dtype):
    module, low = make(2, sliding_window=8), make(2, sliding_window=8).to(dtype)
    pasts, news = [0, 12, 5], [3, 1, 2]
    *_, want = _outputs(module, pasts, news, window=8)
    try:
        *_, got = _outputs(low, pasts, news, window=8, dtype=dtype)
    except RuntimeError as e:  # a CPU build without this dtype's kernels; anything else fails
        if "not implemented" not in str(e).lower():
            raise
        pytest.skip(f"SDPA in {dtype} unsupported on CPU here: {e}")
    assert got.dtype == dtype
    assert_close(got, want, atol=LOW_PRECISION_ATOL[dtype], rtol=0, what=f"{dtype} padded")


def test_a_narrower_cache_equals_per_session():
    """bfloat16 K/V under a float32 model (kv_cache_dtype): both paths round the queries to
    the keys' dtype and return the model's."""
    module = make(2)
    pasts, news = [3, 17, 0], [1, 2, 3]
    each, got = _outputs(module, pasts, news, dtype=torch.bfloat16)
    assert got.dtype == torch.float32
    assert_close(got, each, atol=1e-2, rtol=0, what="bfloat16 cache: padded vs per session")


def _outputs(module, pasts, news, *, window=None, dtype=None):
    """(attend_cached, attend_padded) outputs of one ragged batch; K/V in dtype when given."""
    _, q, kv, keys, values, firsts = setup(module, pasts, news, window=window, dtype=dtype)
    lengths = dict(past_lengths=pasts, new_lengths=news, first_keys=firsts)
    with torch.no_grad():
        each = module.attend_cached(q, kv, **lengths).output
        return each, module.attend_padded(q, keys, values, **lengths).output


@pytest.mark.parametrize(
    ("change", "piece"),
    [
        (dict(past_lengths=[3]), "past_lengths, new_lengths and first_keys have 1, 2 and 2"),
        (dict(new_lengths=[2, 1]), "new_lengths must be in [1, new_len=1]"),
        (dict(past_lengths=[3, 9]), "10 keys (positions 0..9) do not fit keys' 8 columns"),
        (dict(keys=torch.zeros(2, 2, 8, 4)), "keys must be (batch=2, 2, keys, 8)"),
        (dict(values=torch.zeros(1, 2, 8, 8)), "values must be (batch=2, 2, keys, 8)"),
    ],
)
def test_bad_arguments_name_the_numbers(change, piece):
    module = make(2)
    c = module.config
    args = dict(
        q=torch.zeros(2, 8, 1, c.head_dim),
        keys=torch.zeros(2, 2, 8, c.head_dim),
        values=torch.zeros(2, 2, 8, c.head_dim),
        past_lengths=[3, 5],
        new_lengths=[1, 1],
        first_keys=[0, 0],
    )
    args.update(change)
    with pytest.raises(ValueError) as err:
        module.attend_padded(**args)
    assert piece in str(err.value), f"{piece!r} not in {str(err.value)!r}"
