"""engine/graphs.py: StaticDecode's fixed-shape decode step gives the engine's batched step's
answers (output, the cache's K/V, the overflow maxima) for MHA/GQA/MQA, RoPE, a sliding
window, soft-capping and ALiBi, ragged and fragmented sessions, batches between buckets and key
widths across buckets; its padding rows touch nothing; on CUDA its graph replays equal eager."""

from __future__ import annotations

import math

import pytest
import torch

from mha_serve.engine import Engine, ModelSpec
from mha_serve.engine.attend import attend_steps
from mha_serve.engine.graphs import StaticDecode
from mha_serve.model import AttentionConfig
from mha_serve.model.overflow import bound_crossed, row_absmax_tensor, score_limit, scores_overflow
from tests.engine.test_attend import MODELS as ATTEND_MODELS
from tests.engine_calls import req, run, run_batch
from tests.helpers import suite_torch_device

ATOL = 1e-5  # float32 output: the paths differ in summation order (and GEMM batch size)
KV_ATOL = 1e-6  # the new K/V: one projection each, at another GEMM batch size,
# which may take another kernel: a few float32 ulps apart (up to 1.3e-6 at |x| ~ 2 on an
# AMD EPYC with AVX-512), so relative to the value too
KV_RTOL = 1e-5
# A bfloat16 cache: attention over bf16 K/V, whose kernel sums in another order over another
# padded width (1.3e-5 seen on the CPU)
NARROW_ATOL = 1e-4
MODELS = [
    *ATTEND_MODELS,  # mha, gqa, mqa; win (sliding window, RoPE), cap (soft-capping)
    ModelSpec("rope", AttentionConfig(64, 8, 2, rope={"theta": 100.0}), seed=6, kv_block_size=4),
    # 30 blocks of 4 tokens (512 bytes each): sessions that grow in turns must interleave.
    ModelSpec(
        "frag",
        AttentionConfig(64, 8, 2, rope={"theta": 100.0}),
        seed=7,
        kv_block_size=4,
        kv_cache_bytes=30 * 512,
    ),
    # A cache narrower than the model: K/V stored rounded, attention in the cache's dtype.
    ModelSpec(
        "narrow",
        AttentionConfig(64, 8, 2, sliding_window=40, rope={"theta": 100.0}),
        seed=8,
        kv_block_size=4,
        kv_cache_dtype="bfloat16",
    ),
]


def make_engine(device: torch.device) -> Engine:
    return Engine(
        MODELS,
        device=device,
        dtype=torch.float32,
        max_response_bytes=2**28,
        batched_attention=True,
    )


@pytest.fixture(scope="module")
def engine() -> Engine:
    return make_engine(suite_torch_device())


def tokens(n: int, seed: int, width: int, scale: float = 1.0) -> torch.Tensor:
    return scale * torch.randn(1, n, width, generator=torch.Generator().manual_seed(seed))


def sessions(engine: Engine, name: str, pasts: list[int], *, interleave: int = 0) -> list[str]:
    """Sessions of `name` holding pasts[i] tokens each; interleave > 0: prefilled in turns of
    that many tokens, so their blocks alternate in the pool (fragmented block tables)."""
    hosted = engine.get(name)
    E = hosted.spec.attention.embed_dim
    ids = [engine.sessions.create(name, None, None).session_id for _ in pasts]
    chunk = interleave or max(pasts, default=1) or 1
    for lo in range(0, max(pasts, default=0), chunk):
        for i, (sid, p) in enumerate(zip(ids, pasts, strict=True)):
            if lo < p:
                x = tokens(min(chunk, p - lo), seed=1000 * i + lo, width=E)
                run(engine, hosted, req(name, x, session_id=sid))
    return ids


def reference(hosted, cache, x, reservations):
    """Today's batched step (Sessions._forward's ops): output, q and the (4, B) maxima."""
    rotary = hosted.spec.attention.rope is not None
    positions = None
    if rotary:
        positions = torch.tensor([[r.start] for r in reservations], device=x.device)
    with torch.inference_mode():
        q, k, v = hosted.module.project(x, positions)
        k, v = k.to(cache.dtype), v.to(cache.dtype)  # as project_and_append stores them
        cache.append(k, v, [r.slots for r in reservations])
        maxima = row_absmax_tensor(q, k, v)
        B = len(reservations)
        out = attend_steps(hosted.module, cache, q, reservations, [1] * B, batched=True).output
        return out, q, torch.cat([maxima, row_absmax_tensor(out)])


def refused(hosted, cache, q, maxima, reservations) -> tuple[set[int], set[int]]:
    """Sessions._forward's rows with K/V not finite, and rows whose scores overflow."""
    cfg = hosted.spec.attention
    limit = score_limit(q.dtype, cache.dtype) / cfg.score_factor
    q_max, k_max, v_max, _ = maxima.tolist()
    overflowed, too_large = set(), set()
    for b, r in enumerate(reservations):
        if not (k_max[b] < math.inf and v_max[b] < math.inf):
            overflowed.add(b)
        elif bound_crossed(q_max[b], k_max[b], cfg.head_dim, limit):
            keys = cache.read(
                r.block_table, r.start + 1, start=r.read_start, first_block=r.first_block
            )
            if scores_overflow(
                q[b, :, :1], keys[0][0], limit, first_pos=r.start, first_key=r.read_start
            ):
                too_large.add(b)
    return overflowed, too_large


def both_ways(engine, name, pasts, *, interleave=0, scales=None, **kw):
    """One decode step of sessions at `pasts`, run by today's ops and by StaticDecode from the
    same cache: (reference, static) results, the cache after each, and the cache before."""
    hosted = engine.get(name)
    cache = engine.sessions.cache(name)
    ids = sessions(engine, name, pasts, interleave=interleave)
    E = hosted.spec.attention.embed_dim
    scales = scales or [1.0] * len(pasts)
    x = torch.cat([tokens(1, 7 + i, E, s) for i, s in enumerate(scales)]).to(hosted.device)
    reservations = engine.sessions.table.reserve_many([(sid, 1) for sid in ids])
    try:
        before = cache.k.clone(), cache.v.clone()
        ref = reference(hosted, cache, x, reservations)
        ref_kv = cache.k.clone(), cache.v.clone()
        cache.k.copy_(before[0])
        cache.v.copy_(before[1])
        static = StaticDecode(hosted, cache, **kw).step(x, reservations)
        static_kv = cache.k.clone(), cache.v.clone()
        ref_refused = refused(hosted, cache, ref[1], ref[2], reservations)
        static_refused = refused(hosted, cache, static.q, static.maxima, reservations)
    finally:
        for r in reservations:
            engine.sessions.table.rollback(r)
        for sid in ids:
            engine.sessions.close(sid)
    return {
        "ref": ref,
        "static": static,
        "ref_kv": ref_kv,
        "static_kv": static_kv,
        "before": before,
        "reservations": reservations,
        "refused": (ref_refused, static_refused),
        "x": x,
    }


def assert_same(got, skip=(), atol=ATOL):
    ref_out, ref_q, ref_max = got["ref"]
    s = got["static"]
    keep = [b for b in range(ref_out.shape[0]) if b not in skip]
    diff = (s.output[keep] - ref_out[keep]).abs()
    assert diff.max() <= atol, f"output max diff {diff.max():.3g}, mean {diff.mean():.3g}"
    torch.testing.assert_close(s.q, ref_q, atol=KV_ATOL, rtol=KV_RTOL)
    torch.testing.assert_close(s.maxima[:, keep], ref_max[:, keep], atol=atol, rtol=1e-5)
    slots = [r.slots[0] for r in got["reservations"]]
    for ref_t, static_t, before in zip(got["ref_kv"], got["static_kv"], got["before"], strict=True):
        ref_t, static_t, before = (t.flatten(1, 2) for t in (ref_t, static_t, before))  # slots
        torch.testing.assert_close(static_t[:, slots], ref_t[:, slots], atol=KV_ATOL, rtol=KV_RTOL)
        # Every other slot as it was, bit for bit (unwritten memory may hold NaN).
        others = torch.ones(static_t.shape[1], dtype=torch.bool, device=static_t.device)
        others[slots] = False
        assert torch.equal(bits(static_t[:, others]), bits(before[:, others]))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


# Key counts 3, 17, 300, 1 (one past the 256-key bucket) and 6 steps: the bucket of 8.
RAGGED = [2, 16, 299, 0, 40, 5]


@pytest.mark.parametrize(
    "name", ["mha", "gqa", "mqa", "rope", "win", "cap", "sinks", "alibi", "alibi_rw", "narrow"]
)
def test_ragged_batch_matches_the_batched_step(engine, name):
    got = both_ways(engine, name, RAGGED)
    assert got["static"].output.shape == (len(RAGGED), 1, engine.get(name).spec.attention.embed_dim)
    assert_same(got, atol=NARROW_ATOL if name == "narrow" else ATOL)
    assert got["refused"] == ((set(), set()), (set(), set()))


def test_fragmented_sessions(engine):
    """Sessions prefilled in turns in a small pool: their tables are not runs of blocks."""
    got = both_ways(engine, "frag", [37, 45, 20], interleave=4)
    tables = [r.block_table for r in got["reservations"]]
    assert any(list(t) != list(range(t[0], t[0] + len(t))) for t in tables), tables
    assert_same(got)


@pytest.mark.parametrize("pasts", [[255], [256], [100, 255, 256, 511, 600]])
def test_key_widths_across_buckets(engine, pasts):
    """255 keys fit a width of 256; 256 past keys plus the new one need 512."""
    static = StaticDecode(engine.get("mqa"), engine.sessions.cache("mqa"), key_bucket=256)
    assert [static.width(n) for n in (1, 256, 257, 512, 513)] == [256, 256, 512, 512, 768]
    assert [static.bucket(n) for n in (1, 3, 5, 64)] == [1, 4, 8, 64]
    got = both_ways(engine, "mqa", pasts, key_bucket=256)
    assert_same(got)


def test_small_buckets_and_one_step(engine):
    got = both_ways(engine, "rope", [9], batch_buckets=(4,), key_bucket=16)
    assert_same(got)
    got = both_ways(engine, "mha", [9, 30, 2], batch_buckets=(1, 4), key_bucket=16)
    assert_same(got)


def test_matches_the_engines_own_step(engine):
    """The same step through Engine.run_batch (reserve, forward, commit): the same outputs."""
    name, pasts = "gqa", [3, 300, 17, 0, 64]
    hosted, cache = engine.get(name), engine.sessions.cache(name)
    ids = sessions(engine, name, pasts)
    x = torch.cat([tokens(1, 50 + i, 512) for i in range(len(pasts))])
    reservations = engine.sessions.table.reserve_many([(sid, 1) for sid in ids])
    before = cache.k.clone(), cache.v.clone()
    try:
        static = StaticDecode(hosted, cache).step(x.to(hosted.device), reservations).output.cpu()
    finally:
        for r in reservations:
            engine.sessions.table.rollback(r)
    cache.k.copy_(before[0])
    cache.v.copy_(before[1])
    outs = run_batch(
        engine, hosted, [req(name, x[b : b + 1], session_id=s) for b, s in enumerate(ids)]
    )
    for b, o in enumerate(outs):
        diff = (o.output[0] - static[b]).abs().max()
        assert diff <= ATOL, f"step {b}: max diff {diff:.3g}"
    for sid in ids:
        engine.sessions.close(sid)


def test_overflow_is_caught_the_same_way(engine):
    """A token whose scores overflow float32 (row 1) and one whose K/V are inf (row 2): the
    maxima refuse the same rows as today's; the others' outputs still match."""
    got = both_ways(engine, "mha", [5, 20, 8, 3], scales=[1.0, 1e20, 1e38, 1.0])
    ref_refused, static_refused = got["refused"]
    assert ref_refused == static_refused
    assert ref_refused[1] == {1} and ref_refused[0] == {2}, ref_refused
    assert_same_rows = [0, 3]
    ref_out, s = got["ref"][0], got["static"]
    diff = (s.output[assert_same_rows] - ref_out[assert_same_rows]).abs().max()
    assert diff <= ATOL


def test_refuses_what_it_does_not_run(engine):
    hosted = engine.get("mha")
    cache = engine.sessions.cache("mha")
    qk = AttentionConfig(64, 4, qk_norm={"scope": "head"})
    assert not StaticDecode.supports(qk)
    assert StaticDecode.supports(hosted.spec.attention)
    static = StaticDecode(hosted, cache, batch_buckets=(1, 2))
    with pytest.raises(ValueError, match="largest batch bucket 2"):
        static.bucket(3)
    cpu = make_engine(torch.device("cpu"))  # (the suite's device may be CUDA)
    with pytest.raises(ValueError, match="graph mode needs CUDA"):
        StaticDecode(cpu.get("mha"), cpu.sessions.cache("mha"), graph=True)
    ids = sessions(engine, "mha", [4])
    (r,) = engine.sessions.table.reserve_many([(ids[0], 2)])
    try:
        with pytest.raises(ValueError, match="one new token"):
            static.step(torch.zeros(1, 1, 512, device=hosted.device), [r])
    finally:
        engine.sessions.table.rollback(r)
        engine.sessions.close(ids[0])


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


@cuda
@pytest.mark.parametrize("name", ["gqa", "rope", "sinks", "alibi", "alibi_rw"])
def test_graph_replay_equals_eager_on_cuda(name):
    engine = make_engine(torch.device("cuda"))
    hosted, cache = engine.get(name), engine.sessions.cache(name)
    E = hosted.spec.attention.embed_dim
    eager = StaticDecode(hosted, cache)
    graphs = StaticDecode(hosted, cache, graph=True, max_graphs=2)
    answers = []
    # (4, 512) twice: one capture; then (1, 256) and (8, 512): the first graph is dropped
    # (max_graphs 2) and captured again for the last (4, 512); every answer is a copy that
    # later replays leave alone.
    batches = ([2, 16, 299], [5, 400, 7], [9], [3] * 5, [1, 300, 2])
    for k, pasts in enumerate(batches):
        ids = sessions(engine, name, pasts)
        x = torch.cat([tokens(1, 9 + i, E) for i in range(len(pasts))]).cuda()
        reservations = engine.sessions.table.reserve_many([(sid, 1) for sid in ids])
        try:
            want = eager.step(x, reservations)
            got = graphs.step(x, reservations)
        finally:
            for r in reservations:
                engine.sessions.table.rollback(r)
            for sid in ids:
                engine.sessions.close(sid)
        torch.testing.assert_close(got.output, want.output, atol=ATOL, rtol=0)
        torch.testing.assert_close(got.maxima, want.maxima, atol=ATOL, rtol=1e-5)
        answers.append((got.output, got.output.clone()))
        assert graphs.captures == [1, 1, 2, 3, 4][k], (k, graphs.captures)
    assert graphs.num_graphs == 2
    # each capture's time is counted (the bench and the log report it)
    assert 0 < graphs.longest_capture_s <= graphs.capture_s
    for kept, copy in answers:
        assert torch.equal(kept, copy)
