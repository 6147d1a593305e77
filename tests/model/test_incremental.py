"""MultiHeadAttention.attend_cached, the engine's session step, against one causal forward
over the whole sequence: chunked, batched across ragged sessions, padding, weights. The
"cache" here is a plain concatenation of what `project` returned; tests/cache and
tests/engine run the same method over the paged cache."""

import pytest
import torch
import torch.nn.functional as F

from mha_serve.model import AttentionConfig, MultiHeadAttention, init_weights

ATOL = 1e-5  # float32 step against float32 forward: same math, different summation order
RTOL = 1e-5
VARIANTS = {"mha": 8, "gqa": 2, "mqa": 1}  # num_kv_heads with num_heads 8
E = 64
# Rotary models: positions must continue from the cached length for steps to equal forward.
ROPES = {
    "none": None,
    "rope": {"theta": 100.0},
    "yarn": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8},
}


def assert_close(actual, expected, *, what, atol=ATOL, rtol=RTOL):
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    diff = (actual.double() - expected.double()).abs()
    assert torch.allclose(actual.double(), expected.double(), atol=atol, rtol=rtol), (
        f"{what}: max abs diff {diff.max().item():.3e}, mean {diff.mean().item():.3e} "
        f"(atol {atol}, rtol {rtol})"
    )


def make(num_kv_heads=2, seed=0, **config):
    module = MultiHeadAttention(AttentionConfig(E, 8, num_kv_heads, **config))
    init_weights(module, seed)
    return module.eval()


def step(module, x, k, v, **kwargs):
    """One step of one sequence, as the engine runs it: project the new tokens x (1, n, E)
    at their absolute positions, append their K/V to the cached k, v (1, KVH, P, D), attend."""
    P, n = k.shape[2], x.shape[1]
    q, k_new, v_new = module.project(x, positions=torch.arange(P, P + n))
    k, v = torch.cat([k, k_new], 2), torch.cat([v, v_new], 2)  # (1, KVH, P+n, D)
    out = module.attend_cached(q, [(k, v)], past_lengths=[P], new_lengths=[n], **kwargs)
    return out, k, v


def empty_past(module):
    c = module.config
    return torch.zeros(1, c.num_kv_heads, 0, c.head_dim, dtype=module.wqkv.weight.dtype)


def run_chunks(module, x, sizes, **kwargs):
    """Step x (1, L, E) through in chunks; returns outputs, weights per chunk, K, V."""
    k = v = empty_past(module)
    outs, weights = [], []
    start = 0
    for n in sizes:
        out, k, v = step(module, x[:, start : start + n], k, v, **kwargs)
        outs.append(out.output)
        weights.append(out.weights)
        start += n
    return outs, weights, k, v


@pytest.mark.parametrize("rope", ROPES)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("sizes", [[1] * 6, [5, 1, 1, 7], [13], [3, 4, 6]])
def test_chunked_steps_equal_one_causal_forward(variant, sizes, rope):
    module = make(VARIANTS[variant], rope=ROPES[rope])
    torch.manual_seed(1)
    L = sum(sizes)
    x = torch.randn(1, L, E)
    with torch.no_grad():
        full = module(x, causal=True, need_weights=True)
        outs, weights, k, v = run_chunks(module, x, sizes, need_weights=True)
    start = 0
    for i, n in enumerate(sizes):
        end = start + n
        assert_close(outs[i], full.output[:, start:end], what=f"{variant} chunk {i} output")
        assert_close(
            weights[i], full.weights[:, :, start:end, :end], what=f"{variant} chunk {i} weights"
        )
        start = end
    _, k_all, v_all = module.project(x)
    assert_close(k, k_all, what="stepped K")
    assert_close(v, v_all, what="stepped V")


@pytest.mark.parametrize("rope", ROPES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_batched_ragged_step_equals_each_alone(variant, rope):
    module = make(VARIANTS[variant], rope=ROPES[rope])
    torch.manual_seed(2)
    past_lengths = [0, 5, 11, 3]
    new_lengths = [4, 1, 3, 2]
    B, T = len(past_lengths), max(new_lengths)
    seqs = [torch.randn(1, p + n, E) for p, n in zip(past_lengths, new_lengths, strict=True)]
    x = torch.full((B, T, E), float("nan"))  # padded tokens are junk: never seen
    for b, (seq, p, n) in enumerate(zip(seqs, past_lengths, new_lengths, strict=True)):
        x[b, :n] = seq[0, p:]
    positions = torch.tensor(past_lengths)[:, None] + torch.arange(T)[None]  # (B, T)
    with torch.no_grad():
        q, k_new, v_new = module.project(x, positions=positions)
        kv = []
        for b, (seq, p, n) in enumerate(zip(seqs, past_lengths, new_lengths, strict=True)):
            _, k, v = module.project(seq[:, :p])  # (1, KVH, p, D)
            kv.append(
                (
                    torch.cat([k, k_new[b : b + 1, :, :n]], 2),
                    torch.cat([v, v_new[b : b + 1, :, :n]], 2),
                )
            )
        batch = module.attend_cached(
            q, kv, past_lengths=past_lengths, new_lengths=new_lengths, need_weights=True
        )
        S = max(p + n for p, n in zip(past_lengths, new_lengths, strict=True))
        assert batch.weights.shape == (B, 8, T, S)
        for b, (seq, p, n) in enumerate(zip(seqs, past_lengths, new_lengths, strict=True)):
            full = module(seq, causal=True, need_weights=True)
            assert_close(batch.output[b, :n], full.output[0, p:], what=f"session {b} output")
            assert torch.all(batch.output[b, n:] == 0), "padded rows must be exactly 0"
            assert_close(
                batch.weights[b, :, :n, : p + n], full.weights[0, :, p:], what=f"session {b} w"
            )
            assert torch.all(batch.weights[b, :, :, p + n :] == 0), "columns past the end"
            assert torch.all(batch.weights[b, :, n:] == 0), "padded rows of weights"
            _, k_all, v_all = module.project(seq)  # positions 0..p+n-1
            assert_close(k_new[b, :, :n], k_all[0, :, p:], what=f"session {b} k_new")
            assert_close(v_new[b, :, :n], v_all[0, :, p:], what=f"session {b} v_new")
        assert not torch.isnan(batch.output).any() and not torch.isnan(batch.weights).any()


def test_weights_rows_are_causal_distributions():
    module = make(1)
    torch.manual_seed(3)
    with torch.no_grad():
        _, w, _, _ = run_chunks(module, torch.randn(1, 9, E), [4, 5], need_weights=True)
    w = w[1][0]  # (H, 5, 9): rows are absolute positions 4..8
    assert_close(w.sum(-1), torch.ones(8, 5), what="row sums")
    for t in range(5):
        assert torch.all(w[:, t, 4 + t + 1 :] == 0), f"row {t} sees the future"
        assert torch.all(w[:, t, : 4 + t + 1] > 0)


def test_narrowed_heads_and_head_mask_match_forward():
    module = make(2)
    torch.manual_seed(4)
    x = torch.randn(1, 7, E)
    gate = torch.ones(8)
    gate[[1, 6]] = 0.0
    with torch.no_grad():
        full = module(x, causal=True, need_weights=True, weight_heads=[6, 0], head_mask=gate)
        outs, weights, _, _ = run_chunks(
            module, x, [3, 4], need_weights=True, weight_heads=[6, 0], head_mask=gate
        )
    assert_close(torch.cat(outs, 1), full.output, what="head-masked output")
    assert_close(weights[1], full.weights[:, :, 3:], what="weights of heads [6, 0]")


def test_sdpa_does_all_embeddings_with_bool_mask_only_when_needed(monkeypatch):
    calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append({"query": args[0].shape, **kwargs})
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(
        MultiHeadAttention, "_softmax", lambda *a: pytest.fail("weights path ran unasked")
    )
    module = make(2)
    c = module.config
    k = torch.randn(1, c.num_kv_heads, 8, c.head_dim)
    q = torch.randn(1, 8, 3, c.head_dim)
    with torch.no_grad():
        module.attend_cached(
            q[:, :, :1], [(k[:, :, :6], k[:, :, :6])], past_lengths=[5], new_lengths=[1]
        )  # decode
        module.attend_cached(
            q, [(k[:, :, :3], k[:, :, :3])], past_lengths=[0], new_lengths=[3]
        )  # prefill
        module.attend_cached(q, [(k, k)], past_lengths=[5], new_lengths=[3])  # a chunk
    assert [c.get("attn_mask") is None for c in calls] == [True, True, False]
    assert [c.get("is_causal", False) for c in calls] == [False, True, False]
    # The decode token's 8 query heads as 4 rows of each of its 2 KV heads (no enable_gqa:
    # the CPU kernel would read the keys once per query head); the others broadcast KV heads.
    assert [c.get("enable_gqa", False) for c in calls] == [False, True, True]
    assert calls[0]["query"] == (1, 2, 4, c.head_dim)
    assert calls[2]["attn_mask"].shape == (1, 1, 3, 8)
    assert calls[2]["attn_mask"].dtype == torch.bool


def test_no_weights_unless_asked():
    module = make()
    out, k, v = step(module, torch.randn(1, 2, E), empty_past(module), empty_past(module))
    assert out.weights is None
    assert k.shape == v.shape == (1, 2, 2, 8)


def _kv(p, kvh=2, d=8):
    return torch.zeros(1, kvh, p, d)


@pytest.mark.parametrize(
    ("kwargs", "pieces"),
    [
        ({"kv": [(_kv(5, kvh=3), _kv(5))]}, ["keys", "(1, 2, 5, 8)", "(1, 3, 5, 8)"]),
        ({"kv": [(_kv(5), _kv(5, d=4))]}, ["values", "(1, 2, 5, 8)", "(1, 2, 5, 4)"]),
        ({"kv": [(_kv(6), _kv(6))]}, ["2 + 3 positions", "(1, 2, 6, 8)"]),
        ({"past_lengths": [2, 2]}, ["batch 1", "2"]),
        ({"new_lengths": [0]}, ["new 0", "new_len=3"]),
        ({"new_lengths": [4]}, ["new 4", "new_len=3"]),
        ({"q": torch.zeros(1, 4, 3, 8)}, ["num_heads=8", "(1, 4, 3, 8)"]),
        ({"need_weights": True, "weight_heads": [8]}, ["[8]", "0..7"]),
        ({"head_mask": torch.ones(3)}, ["(8,)", "(3,)"]),
    ],
)
def test_bad_arguments_name_the_numbers(kwargs, pieces):
    module = make(2)
    args = {
        "q": torch.zeros(1, 8, 3, 8),
        "kv": [(_kv(5), _kv(5))],
        "past_lengths": [2],
        "new_lengths": [3],
        **kwargs,
    }
    with pytest.raises(ValueError) as err:
        module.attend_cached(args.pop("q"), args.pop("kv"), **args)
    for piece in pieces:
        assert piece in str(err.value), f"{piece!r} not in {str(err.value)!r}"


LOW_PRECISION_ATOL = {torch.bfloat16: 5e-2, torch.float16: 5e-3}  # against float32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_step_matches_float32(dtype):
    module = make(2)
    low = make(2).to(dtype)
    torch.manual_seed(6)
    x = torch.randn(1, 9, E)
    try:
        with torch.no_grad():
            got, got_w, _, _ = run_chunks(low, x.to(dtype), [5, 1, 3], need_weights=True)
    except RuntimeError as e:  # a CPU build without this dtype's kernels; anything else fails
        if "not implemented" not in str(e).lower():
            raise
        pytest.skip(f"SDPA in {dtype} unsupported on CPU here: {e}")
    with torch.no_grad():
        want = module(x, causal=True, need_weights=True)
    atol = LOW_PRECISION_ATOL[dtype]
    assert got[0].dtype == dtype and got_w[0].dtype == torch.float32
    assert_close(torch.cat(got, 1), want.output, atol=atol, rtol=0, what=f"{dtype} output")
    assert_close(got_w[2], want.weights[:, :, 6:], atol=atol, rtol=0, what=f"{dtype} weights")


def test_rope_positions_matter_and_padding_keeps_real_positions():
    """A rotary module's output depends on where tokens sit; a padded batch row equals the
    sequence alone (its real tokens keep positions 0..n-1)."""
    module = make(2, rope={"theta": 100.0})
    torch.manual_seed(7)
    x = torch.randn(2, 6, E)
    with torch.no_grad():
        q0, k0, _ = module.project(x[:1])
        q3, k3, _ = module.project(x[:1], positions=torch.arange(3, 9))
        scores0 = (q0 @ k0.repeat_interleave(4, 1).transpose(-1, -2))[0, :, 4, 1]
        scores3 = (q3 @ k3.repeat_interleave(4, 1).transpose(-1, -2))[0, :, 4, 1]
        assert_close(scores0, scores3, what="scores depend on relative positions only")
        assert (q0 - q3).abs().max() > 1e-2, "shifted positions rotate q differently"
        padded = module(x, lengths=torch.tensor([6, 4]), causal=True, need_weights=True)
        alone = module(x[1:, :4], causal=True, need_weights=True)
    assert_close(padded.output[1, :4], alone.output[0], what="padded row output")
    assert_close(padded.weights[1, :, :4, :4], alone.weights[0], what="padded row weights")
    assert torch.all(padded.output[1, 4:] == 0)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(
    "config",
    [{}, {"sliding_window": 4}, {"softcap": 5.0}, {"rope": {"theta": 100.0}}, {"sinks": True}],
    ids=["plain", "window", "softcap", "rope", "sinks"],
)
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_attend_step_equals_attend_cached_exactly(variant, config, n, kv_dtype):
    """attend_step (the engine's lone step) is attend_cached of one sequence without its
    lists: exactly the same output as attend_cached's own path for one sequence (here taken
    with a head mask of ones, which multiplies by 1.0), any family option, a window's read
    from past its first key, keys narrower than q."""
    module = make(VARIANTS[variant], seed=3, **config)
    c = module.config
    past = 9
    first = 0 if c.sliding_window is None else past + 1 - c.sliding_window
    g = torch.Generator().manual_seed(n)
    with torch.inference_mode():
        q = torch.randn(1, 8, n, c.head_dim, generator=g)
        keys = torch.randn(1, c.num_kv_heads, past + n - first, c.head_dim, generator=g)
        values = torch.randn(keys.shape, generator=g)
        keys, values = keys.to(kv_dtype), values.to(kv_dtype)
        got = module.attend_step(q, keys, values, past, first)
        want = module.attend_cached(
            q, [(keys, values)], past_lengths=[past], new_lengths=[n], first_keys=[first],
            head_mask=torch.ones(8),
        ).output  # fmt: skip
        plain = module.attend_cached(
            q, [(keys, values)], past_lengths=[past], new_lengths=[n], first_keys=[first]
        ).output
    assert got.shape == (1, n, E)
    assert torch.equal(got, want), (got - want).abs().max()
    assert torch.equal(plain, got)
    with pytest.raises(ValueError, match="keys must be"):
        module.attend_step(q, keys[:, :, 1:], values[:, :, 1:], past, first)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(
    ("config", "pasts", "firsts"),
    [
        ({}, [9, 0, 30], [0, 0, 0]),
        # Rows whose token sees every key read (the first two), and one whose window cuts
        # its read (the last): each row on its own path, the batch still exact.
        ({"sliding_window": 4}, [2, 9, 9], [0, 6, 0]),
        ({"sliding_window": 4}, [9, 2, 0], [0, 0, 0]),
        ({"softcap": 5.0}, [9, 0, 30], [0, 0, 0]),
        ({"sinks": True, "sliding_window": 4}, [2, 9, 9], [0, 6, 0]),
    ],
    ids=["plain", "window-cut-last", "window-cut-first", "softcap", "sinks"],
)
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_a_decode_batch_attends_as_each_row_does_exactly(variant, config, pasts, firsts, kv_dtype):
    """attend_cached of a batch of decode rows (one token each, no weights) runs
    attend_token's kernel on the batch's queries grouped once: exactly the output of its
    loop row by row through attend_one, which it takes when asked for weights."""
    module = make(VARIANTS[variant], seed=5, **config)
    c = module.config
    g = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        q = torch.randn(len(pasts), 8, 1, c.head_dim, generator=g)
        kv = []
        for past, first in zip(pasts, firsts, strict=True):
            keys = torch.randn(1, c.num_kv_heads, past + 1 - first, c.head_dim, generator=g)
            kv.append((keys.to(kv_dtype), torch.randn(keys.shape, generator=g).to(kv_dtype)))
        args = {"past_lengths": pasts, "new_lengths": [1] * len(pasts), "first_keys": firsts}
        got = module.attend_cached(q, kv, **args).output
        want = module.attend_cached(q, kv, need_weights=True, weight_heads=[0], **args).output
    assert got.shape == (len(pasts), 1, E)
    assert torch.equal(got, want), (got - want).abs().max()
