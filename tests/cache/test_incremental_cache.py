"""The cache and the model together, driven the way the engine drives them (reserve ->
project -> append -> read -> MultiHeadAttention.attend_cached -> commit): incremental equals
full recompute, batched equals alone, isolation under forks/closes/interleaving, budget
and eviction. The cache's storage starts as NaN: a stale slot read anywhere would show."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mha_serve.cache import CacheExhausted, KVCache, SessionNotFound, SessionTable
from mha_serve.model import AttentionConfig, MultiHeadAttention, init_weights

ATOL = 1e-5  # float32 cached step against float32 full causal forward
RTOL = 1e-5
BS = 4  # small blocks so short sequences cross many block boundaries
VARIANTS = {"mha": 8, "gqa": 2, "mqa": 1}  # num_kv_heads with num_heads 8


def assert_close(actual, expected, *, what):
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    diff = (actual - expected).abs()
    assert torch.allclose(actual, expected, atol=ATOL, rtol=RTOL), (
        f"{what}: max abs diff {diff.max().item():.3e}, mean {diff.mean().item():.3e}"
    )


def setup(num_kv_heads=2, *, embed_dim=64, num_blocks=256, evict=False, seed=0):
    module = MultiHeadAttention(AttentionConfig(embed_dim, 8, num_kv_heads))
    init_weights(module, seed)
    bytes_per_block = 2 * BS * num_kv_heads * module.config.head_dim * 4  # K and V, float32
    kv = KVCache.from_config(
        module.config, budget_bytes=num_blocks * bytes_per_block, block_size=BS
    )
    assert kv.num_blocks == num_blocks
    kv.k.fill_(float("nan"))  # never-written slots: reading one would poison the output
    kv.v.fill_(float("nan"))
    table = SessionTable(evict=evict)
    table.add_model("m", kv)
    return module.eval(), kv, table


def attend(module, kv, table, steps, *, need_weights=False):
    """One batched step, as the engine runs it: steps = [(session_id, x (n, E))]."""
    res = table.reserve_many([(sid, x.shape[0]) for sid, x in steps])
    for r in res:
        if isinstance(r, Exception):
            for ok in res:
                if not isinstance(ok, Exception):
                    table.rollback(ok)
            raise r
    new_lengths = [x.shape[0] for _, x in steps]
    T = max(new_lengths)
    x = torch.full((len(steps), T, module.config.embed_dim), float("nan"))  # (B, T, E)
    for b, (_, xs) in enumerate(steps):
        x[b, : xs.shape[0]] = xs  # padded tokens stay NaN: they must never leak
    try:
        with torch.no_grad():
            q, k_new, v_new = module.project(x)  # (B, H, T, D), (B, KVH, T, D) x 2
            kv.append(k_new, v_new, [r.slots for r in res])
            cached = [kv.read(r.block_table, r.start + r.num_tokens) for r in res]
            out = module.attend_cached(
                q,
                cached,
                past_lengths=[r.start for r in res],
                new_lengths=new_lengths,
                need_weights=need_weights,
            )
    except Exception:
        for r in res:
            table.rollback(r)
        raise
    for r in res:
        table.commit(r)
    return out, res


def full(module, seq, **kwargs):
    with torch.no_grad():
        return module(seq[None], causal=True, **kwargs)


def check_step(module, out, res, history, b=0, *, weights=False):
    """Output (and weights) of batch row b equal the rows of a full causal forward."""
    seq = history[res.session_id]
    start, n = res.start, res.num_tokens
    want = full(module, seq[: start + n], need_weights=weights)
    assert_close(out.output[b, :n], want.output[0, start:], what=f"{res.session_id[:6]} output")
    if weights:
        got_w = out.weights[b, :, :n, : start + n]
        assert_close(got_w, want.weights[0, :, start:], what=f"{res.session_id[:6]} weights")


def check_cached_kv(module, kv, table, history):
    """Every live session's cached K/V equal its whole history projected afresh."""
    for sid, seq in history.items():
        s = table.get(sid)
        assert s.num_tokens == seq.shape[0]
        k, v = kv.read(s.block_table, s.num_tokens)
        with torch.no_grad():
            _, k_all, v_all = module.project(seq[None])
        assert_close(k, k_all, what=f"{sid[:6]} cached K")
        assert_close(v, v_all, what=f"{sid[:6]} cached V")


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("seed", [0, 1])
def test_random_chunks_equal_one_causal_forward(variant, seed):
    module, kv, table = setup(VARIANTS[variant])
    rng = random.Random(seed)
    torch.manual_seed(seed)
    seq = torch.randn(50, 64)
    s = table.create("m")
    history = {s.id: seq}
    start = 0
    while start < len(seq):
        n = min(rng.choice([1, 1, 2, 3, 5, 9]), len(seq) - start)
        out, (res,) = attend(module, kv, table, [(s.id, seq[start : start + n])], need_weights=True)
        assert res.start == start
        check_step(module, out, res, history, weights=True)
        start += n
    check_cached_kv(module, kv, table, history)


@pytest.mark.parametrize("variant", VARIANTS)
def test_batched_step_across_sessions_equals_each_alone(variant):
    module, kv, table = setup(VARIANTS[variant])
    torch.manual_seed(2)
    past, new = [0, 7, 13, 4, 1], [3, 1, 5, 2, 1]
    seqs = [torch.randn(p + n, 64) for p, n in zip(past, new, strict=True)]
    sessions = [table.create("m") for _ in seqs]
    for s, seq, p in zip(sessions, seqs, past, strict=True):
        if p:
            attend(module, kv, table, [(s.id, seq[:p])])
    steps = [(s.id, seq[p:]) for s, seq, p in zip(sessions, seqs, past, strict=True)]
    batch, res = attend(module, kv, table, steps, need_weights=True)
    history = {s.id: seq for s, seq in zip(sessions, seqs, strict=True)}
    for b, r in enumerate(res):
        check_step(module, batch, r, history, b, weights=True)
        assert torch.all(batch.output[b, r.num_tokens :] == 0)
    check_cached_kv(module, kv, table, history)


def test_fork_diverges_without_touching_the_parent():
    module, kv, table = setup(2)
    torch.manual_seed(3)
    parent = table.create("m")
    prefix = torch.randn(6, 64)  # 1.5 blocks: the fork shares a partial block
    attend(module, kv, table, [(parent.id, prefix)])
    child = table.fork(parent.id)
    history = {parent.id: prefix, child.id: prefix.clone()}
    for _ in range(3):
        for sid in (child.id, parent.id):
            x = torch.randn(3, 64)
            history[sid] = torch.cat([history[sid], x])
            out, (res,) = attend(module, kv, table, [(sid, x)])
            check_step(module, out, res, history)
    check_cached_kv(module, kv, table, history)


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_interleaved_sessions_forks_and_closes_stay_isolated(data):
    module, kv, table = setup(2, embed_dim=32, num_blocks=128)
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    history: dict[str, torch.Tensor] = {}
    for _ in range(data.draw(st.integers(4, 16), label="num_ops")):
        op = data.draw(st.sampled_from(["create", "step", "step", "step", "fork", "close"]))
        live = sorted(history)
        if op == "create" or not live:
            history[table.create("m").id] = torch.empty(0, 32)
        elif op == "step":
            ids = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=3, unique=True))
            steps = [
                (sid, torch.randn(data.draw(st.integers(1, 6)), 32, generator=gen)) for sid in ids
            ]
            for sid, x in steps:
                history[sid] = torch.cat([history[sid], x])
            out, res = attend(module, kv, table, steps, need_weights=True)
            for b, r in enumerate(res):
                check_step(module, out, r, history, b, weights=True)
        elif op == "fork":
            parent = data.draw(st.sampled_from(live))
            history[table.fork(parent).id] = history[parent].clone()
        else:
            sid = data.draw(st.sampled_from(live))
            table.close(sid)
            del history[sid]
    check_cached_kv(module, kv, table, history)
    for sid in list(history):
        table.close(sid)
    pool = table.pool("m")
    assert pool.num_used == 0
    assert all(pool.refcount(b) == 0 for b in range(pool.num_blocks))


def test_exhausted_budget_is_an_error_and_corrupts_no_one():
    module, kv, table = setup(2, num_blocks=6)
    assert kv.nbytes <= kv.budget_bytes
    torch.manual_seed(4)
    a, b = table.create("m"), table.create("m")
    history = {a.id: torch.randn(5, 64), b.id: torch.randn(12, 64)}  # 2 + 3 blocks of 6
    attend(module, kv, table, [(a.id, history[a.id]), (b.id, history[b.id])])
    with pytest.raises(CacheExhausted, match="needs 2 more block"):
        attend(module, kv, table, [(a.id, torch.randn(8, 64))])
    check_cached_kv(module, kv, table, history)
    c = table.create("m")
    with pytest.raises(CacheExhausted, match="needs 1 more block"):  # a takes the last block
        attend(module, kv, table, [(a.id, torch.randn(4, 64)), (c.id, torch.randn(1, 64))])
    check_cached_kv(module, kv, table, history)  # a's reservation was rolled back
    assert table.pool("m").num_used == 5 and kv.nbytes <= kv.budget_bytes
    _, (res,) = attend(module, kv, table, [(c.id, torch.randn(1, 64))])
    assert res.num_new_blocks == 1 and table.pool("m").num_free == 0


def test_eviction_frees_lru_sessions_that_then_say_evicted():
    module, kv, table = setup(1, num_blocks=4, evict=True)
    torch.manual_seed(5)
    old, recent = table.create("m"), table.create("m")
    attend(module, kv, table, [(old.id, torch.randn(8, 64))])
    attend(module, kv, table, [(recent.id, torch.randn(4, 64))])
    new = table.create("m")
    history = {new.id: torch.randn(5, 64)}
    out, (res,) = attend(module, kv, table, [(new.id, history[new.id])])  # 2 blocks, 1 free
    check_step(module, out, res, history)
    with pytest.raises(SessionNotFound, match="evicted to free KV-cache memory") as err:
        attend(module, kv, table, [(old.id, torch.randn(1, 64))])
    assert err.value.reason == "evicted"
    table.get(recent.id)
    assert kv.nbytes <= kv.budget_bytes


def _decode_pair(config, num_kv_heads, dtype, kv_dtype, num_blocks):
    """A module and two equal caches (zeros, then the same random prefix in every slot)."""
    module = MultiHeadAttention(AttentionConfig(64, 8, num_kv_heads, **config))
    init_weights(module, 5)
    module = module.to(dtype).eval()
    c = module.config
    caches = []
    for _ in range(2):
        kv = KVCache(
            num_kv_heads=num_kv_heads,
            head_dim=c.head_dim,
            budget_bytes=num_blocks * 2 * BS * num_kv_heads * c.head_dim * kv_dtype.itemsize,
            block_size=BS,
            dtype=kv_dtype,
        )
        g = torch.Generator().manual_seed(7)
        kv.k.copy_(torch.randn(kv.k.shape, generator=g))
        kv.v.copy_(torch.randn(kv.v.shape, generator=g))
        caches.append(kv)
    return module, caches


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("past", [0, 9, 1100])  # 1100: past a block table of 256 entries
@pytest.mark.parametrize(
    "family",
    [
        {},
        {"rope": {"theta": 100.0}},
        {"rope": {"theta": 100.0}, "qk_norm": {"scope": "head"}},
        {"rope": {"theta": 100.0}, "sliding_window": 1101},  # every key still in view
        {"rope": {"theta": 100.0, "interleaved": True, "partial": 0.5}},  # GLM's
        # Gemma 4's global layers: proportional RoPE, q/k norm, V normed as it is written
        {
            "rope": {"theta": 100.0, "type": "proportional", "partial": 0.25},
            "qk_norm": {"scope": "head"},
            "v_norm": True,
        },
    ],
    ids=["plain", "rope", "rope_qk_norm", "rope_window", "rope_partial_pairs", "v_norm"],
)
def test_decode_one_is_the_plain_lone_step_exactly(variant, dtype, bias, past, family):
    """KVCache.step_views + MultiHeadAttention.decode_one (the engine's lone decode step in
    one call) against project -> append -> read -> attend_step: the same output and the
    same cache, bit for bit; with RoPE, q and K rotated at the token's position; with a
    q/k norm per head (Qwen3's), q's and K's heads normed by their own gains first; with a
    value norm (Gemma 4's), V's heads normed before they are written."""
    num_blocks = 300
    module, (fast, plain) = _decode_pair(
        {"bias": bias, **family}, VARIANTS[variant], dtype, dtype, num_blocks
    )
    if module.q_norm is not None:  # gains of their own, q's unlike K's
        g = torch.Generator().manual_seed(11)
        with torch.no_grad():
            module.q_norm.copy_(torch.rand(module.q_norm.shape, generator=g) + 0.5)
            module.k_norm.copy_(torch.rand(module.k_norm.shape, generator=g) * 3)
    first_block = 3  # a session's blocks need not start at block 0
    table = list(range(first_block, first_block + past // BS + 1))
    slot = table[past // BS] * BS + past % BS
    x = torch.randn(1, 1, 64, generator=torch.Generator().manual_seed(past)).to(dtype)
    with torch.inference_mode():
        views = fast.step_views(table, slot, past + 1)
        assert views is not None
        got = module.decode_one(x, *views)
        q, k, v = module.project(x, torch.tensor([past]))
        plain.append(k, v, [(slot,)])
        keys, values = plain.read(table, past + 1)
        want = module.attend_step(q, keys, values, past, 0)
    assert got is not None and got.shape == (1, 1, 64) and got.dtype == dtype
    assert torch.equal(got, want), (got - want).abs().max()
    assert torch.equal(fast.k, plain.k) and torch.equal(fast.v, plain.v)


@pytest.mark.parametrize(
    "config",
    [
        {"sliding_window": 4},
        {"softcap": 5.0},
        {"rope": {"theta": 100.0}, "qk_norm": {"scope": "projection"}},
        {"sinks": True},
    ],
    ids=["window", "softcap", "qk_norm_projection", "sinks"],
)
def test_decode_one_declines_other_configs_and_a_narrower_cache_writing_nothing(config):
    """For any config it is not for (a window: once the session is longer than it), or a
    cache narrower than the model, decode_one is None and has written nothing: the engine
    then takes the plain calls."""
    cases = [(config, torch.float32), ({}, torch.bfloat16)]  # (the model float32)
    for cfg, kv_dtype in cases:
        module, (kv, _) = _decode_pair(cfg, 2, torch.float32, kv_dtype, 8)
        before_k, before_v = kv.k.clone(), kv.v.clone()
        with torch.inference_mode():
            views = kv.step_views([0, 1], 5, 6)
            assert views is not None
            assert module.decode_one(torch.randn(1, 1, 64), *views) is None
        assert torch.equal(kv.k, before_k) and torch.equal(kv.v, before_v)


def test_step_views_only_for_consecutive_blocks_and_the_last_positions_slot():
    """step_views is None where read() would copy (blocks not consecutive) or where the
    slot is not position length - 1's: append() and read() then."""
    _, (kv, _) = _decode_pair({}, 2, torch.float32, torch.float32, 8)
    assert kv.step_views([2, 3], 2 * BS + BS + 1, BS + 2) is not None
    assert kv.step_views([2, 4], 4 * BS + 1, BS + 2) is None  # not consecutive
    assert kv.step_views([2, 3], 3 * BS + 2, BS + 2) is None  # another position's slot
    assert kv.step_views([2, 3], 2 * BS + 2 * BS + 1, 2 * BS + 2) is None  # past the table
    assert kv.step_views([9], 9 * BS, 1) is None  # past the cache's slots (8 blocks)
    assert kv.step_views([], 0, 0) is None
    kv_slot, keys, values = kv.step_views([5, 6], 5 * BS + 3, 4)
    assert kv_slot.shape == (1, 4, 1, 8)  # K's 2 heads, then V's
    assert keys.shape == values.shape == (1, 2, 4, 8)
    # the views share the cache: the slot is position 3 of both
    assert kv_slot[:, :2].data_ptr() == keys[:, :, 3:].data_ptr()
    assert kv_slot[:, 2:].data_ptr() == values[:, :, 3:].data_ptr()
    k_new, v_new = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8)
    kv_slot.copy_(torch.cat([k_new, v_new], dim=1))  # decode_one's one copy
    assert torch.equal(kv.k.view(2, -1, 8)[:, 5 * BS + 3], k_new.view(2, 8))
    assert torch.equal(kv.v.view(2, -1, 8)[:, 5 * BS + 3], v_new.view(2, 8))
    reads = kv.read([5, 6], 4)
    assert torch.equal(keys, reads[0]) and torch.equal(values, reads[1])
