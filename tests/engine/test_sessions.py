"""Session steps in the engine: batched ragged steps equal full recompute, on both cache reads."""

from __future__ import annotations

import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mha_serve.cache import CacheExhausted, SessionBusy, SessionFull, SessionNotFound
from mha_serve.config import default_models
from mha_serve.engine import (
    Abandoned,
    DeadlinePassed,
    Engine,
    InvalidRequest,
    ModelSpec,
    TooLarge,
)
from mha_serve.engine import forward as engine_forward
from mha_serve.engine import lone_step as engine_lone_step
from mha_serve.engine import sessions as engine_sessions
from mha_serve.engine import settle as engine_settle
from mha_serve.model import AttentionConfig, cached
from tests.engine_calls import State, req, run, run_batch, torched
from tests.helpers import suite_torch_device

ATOL = 1e-5  # float32: cached steps vs one causal forward


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(
        default_models(), device=suite_torch_device(), dtype=torch.float32, max_response_bytes=2**28
    )


def seq(n: int, seed: int) -> torch.Tensor:
    return torch.randn(1, n, 512, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", ["mha", "gqa", "mqa"])
def test_ragged_batched_steps_equal_full_recompute(engine, name):
    hosted = engine.get(name)
    pasts, news = [5, 17, 33, 1], [1, 4, 2, 16]
    full = [seq(p + n, seed=i) for i, (p, n) in enumerate(zip(pasts, news, strict=True))]
    ids = []
    for i, p in enumerate(pasts):
        sid = engine.sessions.create(name, None, None).session_id
        run(engine, hosted, req(name, full[i][:, :p], session_id=sid))  # prefill alone
        ids.append(sid)
    calls = [req(name, full[i][:, p:], session_id=ids[i]) for i, p in enumerate(pasts)]
    results = run_batch(engine, hosted, calls)  # one batch: ragged new tokens, own keys each
    for i, (r, p) in enumerate(zip(results, pasts, strict=True)):
        ref = run(engine, hosted, req(name, full[i], causal=True)).output[:, p:]
        diff = (r.output - ref).abs()
        assert diff.max() < ATOL, f"session {i}: max {diff.max():.2e} mean {diff.mean():.2e}"
        assert r.batch_size == 4 and r.session.num_tokens == p + news[i]


@pytest.mark.parametrize("name", ["gqa", "mqa"])
def test_decode_steps_equal_full_recompute(engine, name):
    """Lone decode tokens of GQA/MQA (each KV head's query heads as one call's rows)."""
    hosted = engine.get(name)
    x = seq(40, seed=5)
    sid = engine.sessions.create(name, None, None).session_id
    run(engine, hosted, req(name, x[:, :30], session_id=sid))
    steps = [run(engine, hosted, req(name, x[:, t : t + 1], session_id=sid)) for t in range(30, 40)]
    ref = run(engine, hosted, req(name, x, causal=True)).output[:, 30:]
    diff = (torch.cat([s.output for s in steps], dim=1) - ref).abs()
    assert diff.max() < ATOL, f"max {diff.max():.2e} mean {diff.mean():.2e}"


@pytest.mark.parametrize(("kvh", "keys"), [(8, 50), (2, 50), (1, 1), (4, 1030), (2, 4100)])
@pytest.mark.parametrize(
    ("dtype", "atol"), [(torch.float32, 1e-6), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)]
)
def test_attend_token_matches_a_float64_statement(kvh, keys, dtype, atol):
    """One token's attention with its query heads folded onto their KV heads: query head h
    reads KV head h // (8 / kvh), every key, softmax(q k^T * scale) v, against float64
    arithmetic written out, for MHA (kvh 8), GQA and MQA, in the three dtypes; keys and
    values strided views (as the cache hands them), q an as_strided view (as decode_one's)."""
    g = torch.Generator().manual_seed(keys + kvh)
    H, D = 8, 64
    qkv = torch.randn(1, 1, (H + 2 * kvh) * D, generator=g).to(dtype)
    q = qkv.as_strided((1, H, 1, D), ((H + 2 * kvh) * D, D, D, 1))
    k = torch.randn(1, kvh, keys + 7, D, generator=g).to(dtype)[:, :, :keys]
    v = torch.randn(1, kvh, keys + 7, D, generator=g).to(dtype)[:, :, :keys]
    got = cached.attend_token(q, k, v, 0.125)
    assert got.shape == (1, H, 1, D) and got.dtype == dtype
    want = torch.empty(H, D, dtype=torch.float64)
    for h in range(H):
        kv = h // (H // kvh)
        scores = k[0, kv].double() @ q[0, h, 0].double() * 0.125  # (S,)
        want[h] = torch.softmax(scores, dim=0) @ v[0, kv].double()
    assert (got[0, :, 0].double() - want).abs().max() < atol
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, scale=0.125, enable_gqa=kvh != H
    )
    assert (got.float() - sdpa.float()).abs().max() < atol  # (the call it replaces)


def test_weights_of_a_step_are_rows_of_the_full_causal_weights(engine):
    hosted = engine.get("gqa")
    x = seq(40, seed=9)
    sid = engine.sessions.create("gqa", None, None).session_id
    run(engine, hosted, req("gqa", x[:, :30], session_id=sid))
    step = run(
        engine,
        hosted,
        req(
            "gqa",
            x[:, 30:],
            session_id=sid,
            need_weights=True,
            weight_heads=[7, 2, 7],
            query_start=3,
            query_end=9,
        ),
    )
    ref = run(engine, hosted, req("gqa", x, causal=True, need_weights=True))
    assert step.weights.shape == (1, 3, 6, 40) and step.weight_heads == [7, 2, 7]
    torch.testing.assert_close(step.weights, ref.weights[:, [7, 2, 7], 33:39], atol=ATOL, rtol=0)


def test_contiguous_and_scattered_blocks_read_the_same(engine):
    hosted = engine.get("mha")
    pool = engine.sessions.table.pool("mha")
    a, c = (engine.sessions.create("mha", None, None).session_id for _ in range(2))
    x = seq(50, seed=3)
    # Another holder takes the block after each of a's, so a's blocks scatter (read by a
    # copy); c's single prefill gets consecutive blocks (read in place).
    fences = []
    try:
        for start in range(0, 48, 16):
            run(engine, hosted, req("mha", x[:, start : start + 16], session_id=a))
            fences += pool.allocate(1, after=engine.sessions.table.get(a).block_table[-1])
        run(engine, hosted, req("mha", x[:, :48], session_id=c))
        blocks_a = engine.sessions.table.get(a).block_table
        blocks_c = engine.sessions.table.get(c).block_table
        assert any(y != x_ + 1 for x_, y in zip(blocks_a, blocks_a[1:], strict=False))
        assert all(y == x_ + 1 for x_, y in zip(blocks_c, blocks_c[1:], strict=False))
        tail = x[:, 48:]
        out_a = run(engine, hosted, req("mha", tail, session_id=a)).output
        out_c = run(engine, hosted, req("mha", tail, session_id=c)).output
        torch.testing.assert_close(out_a, out_c, atol=ATOL, rtol=0)
    finally:  # the engine is shared by this module's tests
        pool.decref(fences)


def test_an_overflowing_step_fails_alone_and_is_not_kept(engine):
    """Batched with a healthy step, a step whose keys and values overflow gets its own error
    and leaves its session as it was; the other step is answered and kept."""
    hosted = engine.get("mha")
    good, bad = (engine.sessions.create("mha", None, None).session_id for _ in range(2))
    x = seq(9, seed=3)
    run(engine, hosted, req("mha", x[:, :8], session_id=good))
    run(engine, hosted, req("mha", x[:, :8], session_id=bad))
    huge = torch.full((1, 1, 512), 3e38)
    ok, failed = run_batch(
        engine,
        hosted,
        [req("mha", x[:, 8:], session_id=good), req("mha", huge, session_id=bad)],
    )
    assert isinstance(failed, InvalidRequest)
    assert "keys or values overflowed to inf/NaN in float32" in str(failed)
    assert engine.sessions.table.session_stats(bad).num_tokens == 8  # rolled back
    ref = run(engine, hosted, req("mha", x, causal=True)).output[:, 8:]
    assert (ok.output - ref).abs().max() < ATOL and ok.session.num_tokens == 9


def test_small_batched_steps_run_single_threaded_and_restore_the_count(engine, monkeypatch):
    full = torch.get_num_threads()
    if full < 2:
        pytest.skip("torch runs single-threaded here: nothing to switch")
    if engine.get("gqa").device.type != "cpu":
        pytest.skip("the switch is for CPU kernels: on a GPU the step keeps torch's count")
    seen = []
    hosted = engine.get("gqa")
    assert not engine.sessions.batched_attention["gqa"]

    # The CPU's attention over the cache: attend_step alone, attend_cached batched.
    for name in ("attend_cached", "attend_step"):
        real = getattr(hosted.module, name)

        def spy(*args, real=real, **kwargs):
            seen.append(torch.get_num_threads())
            return real(*args, **kwargs)

        monkeypatch.setattr(hosted.module, name, spy)
    ids = [engine.sessions.create("gqa", None, None).session_id for _ in range(4)]
    for i, sid in enumerate(ids):
        run(engine, hosted, req("gqa", seq(8, seed=i), session_id=sid))  # one: all threads
    run_batch(engine, hosted, [req("gqa", seq(1, seed=9), session_id=sid) for sid in ids])
    long_prefill = [req("gqa", seq(300, seed=i), session_id=sid) for i, sid in enumerate(ids)]
    run_batch(engine, hosted, long_prefill)  # many new tokens: all threads
    assert seen == [full] * 4 + [1, full]
    assert torch.get_num_threads() == full


@settings(max_examples=20, deadline=None)
@given(st.data())
def test_interleaved_batched_steps_forks_truncates_and_closes_through_the_engine_stay_exact(
    data,
):
    """The engine's own path (append, in-place or copied reads, attention per session or
    batched (padded groups gathered through the block tables), the
    block pool's placement, eviction in a small cache) under random interleaving: every
    kept step equals a full recompute, forks and truncates never disturb other sessions,
    an evicted session says so, and the pool is empty at the end."""
    kvh = data.draw(st.sampled_from([8, 2, 1]), label="num_kv_heads")
    num_blocks = data.draw(st.one_of(st.just(256), st.integers(3, 16)), label="num_blocks")
    spec = ModelSpec(
        "m",
        AttentionConfig(32, 8, kvh),
        kv_block_size=4,
        kv_cache_bytes=num_blocks * 2 * 4 * kvh * 4 * 4,  # blocks of 4 tokens
    )
    eng = Engine(
        [spec],
        device=torch.device("cpu"),
        dtype=torch.float32,
        max_response_bytes=2**24,
        evict_idle_sessions=data.draw(st.booleans(), label="evict"),
        batched_attention=data.draw(st.booleans(), label="batched"),
    )
    hosted = eng.get("m")
    table = eng.sessions.table
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    history: dict[str, torch.Tensor] = {}
    pool, fences = table.pool("m"), []
    ops = ["create", "step", "step", "step", "fork", "truncate", "close", "fence"]
    for _ in range(data.draw(st.integers(4, 20), label="num_ops")):
        op = data.draw(st.sampled_from(ops))
        live = list(history)  # insertion order: ids are random, draws must not depend on them
        if op == "create" or not live:
            history[eng.sessions.create("m", None, None).session_id] = torch.empty(1, 0, 32)
        elif op == "fence":  # take the block after a session's last: its next one lands apart
            blocks = eng.sessions.table.get(data.draw(st.sampled_from(live))).block_table
            if blocks and blocks[-1] + 1 < pool.num_blocks and pool.refcount(blocks[-1] + 1) == 0:
                fences += pool.allocate(1, after=blocks[-1])
        elif op == "step":
            ids = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=4, unique=True))
            xs = [torch.randn(1, data.draw(st.integers(1, 9)), 32, generator=gen) for _ in ids]
            results = run_batch(
                eng, hosted, [req("m", x, session_id=s) for s, x in zip(ids, xs, strict=True)]
            )
            for sid, x, r in zip(ids, xs, results, strict=True):
                if isinstance(r, SessionNotFound):  # evicted for an earlier step of the batch
                    assert r.reason == "evicted", r
                    continue
                if isinstance(r, CacheExhausted | SessionFull):  # a small cache
                    continue
                assert not isinstance(r, Exception), r
                past = history[sid].shape[1]
                history[sid] = torch.cat([history[sid], x], dim=1)
                ref = run(eng, hosted, req("m", history[sid], causal=True)).output[:, past:]
                assert (r.output - ref).abs().max() < ATOL
                assert r.session.num_tokens == history[sid].shape[1]
        elif op == "fork":
            parent = data.draw(st.sampled_from(live))
            history[table.fork(parent).id] = history[parent].clone()
        elif op == "truncate":
            sid = data.draw(st.sampled_from(live))
            n = data.draw(st.integers(0, history[sid].shape[1]))
            assert table.truncate(sid, n).num_tokens == n
            history[sid] = history[sid][:, :n]
        else:
            sid = data.draw(st.sampled_from(live))
            table.close(sid)
            del history[sid]
        for sid in list(history):  # evicted to make room for a step: mirror that
            try:
                table.get(sid)
            except SessionNotFound as e:
                assert e.reason == "evicted" and "was evicted" in str(e), e
                del history[sid]
    for sid in list(history):
        table.close(sid)
    pool.decref(fences)
    assert pool.num_used == 0


def test_a_session_closed_while_its_step_runs_answers_alone(engine, monkeypatch):
    """The closed session's step answers NOT_FOUND; the other step of the batch is kept and
    nothing stays pinned or allocated."""
    hosted = engine.get("gqa")
    keep, gone = (engine.sessions.create("gqa", None, None).session_id for _ in range(2))
    x = seq(6, seed=4)
    for sid in (keep, gone):
        run(engine, hosted, req("gqa", x[:, :5], session_id=sid))
    pool = engine.sessions.table.pool("gqa")
    blocks_of_gone = list(engine.sessions.table.get(gone).block_table)
    real = engine_forward.attend_steps  # batched or per session

    def close_meanwhile(*args, **kwargs):
        engine.sessions.table.close(gone)  # as a CloseSession RPC would, mid-forward
        return real(*args, **kwargs)

    monkeypatch.setattr(engine_forward, "attend_steps", close_meanwhile)
    ok, closed = run_batch(
        engine, hosted, [req("gqa", x[:, 5:], session_id=s) for s in (keep, gone)]
    )
    assert isinstance(closed, SessionNotFound) and "closed" in str(closed)
    assert ok.session.num_tokens == 6
    assert all(pool.refcount(b) == 0 for b in blocks_of_gone)  # freed when its step ended
    monkeypatch.undo()
    again = run(engine, hosted, req("gqa", x[:, :1], session_id=keep))  # not left busy
    assert again.session.num_tokens == 7
    engine.sessions.table.close(keep)


@pytest.mark.parametrize(
    ("module", "where"),
    [(engine_forward, "attend_steps"), (engine_sessions, "one_thread_is_enough")],
    ids=["attend_steps", "one_thread_is_enough"],
)
def test_a_failing_forward_keeps_nothing_and_restores_the_thread_count(
    engine, monkeypatch, module, where
):
    """A failure anywhere between reserving and settling (in the forward, or before it)."""
    hosted = engine.get("gqa")
    ids = [engine.sessions.create("gqa", None, None).session_id for _ in range(4)]
    for i, sid in enumerate(ids):
        run(engine, hosted, req("gqa", seq(3, seed=i), session_id=sid))
    pool = engine.sessions.table.pool("gqa")
    used, threads = pool.num_used, torch.get_num_threads()

    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    monkeypatch.setattr(module, where, broken)
    calls = [req("gqa", seq(14, seed=9), session_id=sid) for sid in ids]  # new blocks
    with pytest.raises(RuntimeError, match="device lost"):
        run_batch(engine, hosted, calls)
    assert pool.num_used == used and torch.get_num_threads() == threads
    assert all(engine.sessions.table.get(s).num_tokens == 3 for s in ids)
    monkeypatch.undo()
    assert all(run(engine, hosted, c).session.num_tokens == 17 for c in calls)  # none left busy


def test_a_lone_step_that_fails_or_loses_its_session_keeps_nothing(engine, monkeypatch):
    """A step alone takes its own path (Sessions._run_alone): a failure in its forward
    rolls its reservation back, a session closed while it runs answers NOT_FOUND and frees
    its blocks, and a step that follows is kept as if neither had happened."""
    hosted = engine.get("gqa")
    pool = engine.sessions.table.pool("gqa")
    sid, gone = (engine.sessions.create("gqa", None, None).session_id for _ in range(2))
    x = seq(20, seed=5)
    for s in (sid, gone):
        run(engine, hosted, req("gqa", x[:, :15], session_id=s))
    used = pool.num_used
    module = hosted.module  # a lone step's attention: attend_step, or decode_one (one token)
    real = {name: getattr(module, name) for name in ("attend_step", "decode_one")}
    calls = []

    def batch_path(*args, **kwargs):
        raise AssertionError("a lone step whose bounds clear it took the batch's path")

    monkeypatch.setattr(engine_sessions.Sessions, "_forward", batch_path)

    def broken(*args, **kwargs):
        calls.append("broken")
        raise RuntimeError("device lost")

    for name in real:
        monkeypatch.setattr(module, name, broken)
    for new in (x[:, 15:17], x[:, 15:16]):  # two tokens (a new block), one (decode_one)
        with pytest.raises(RuntimeError, match="device lost"):  # (the batch's error: run raises it)
            run_batch(engine, hosted, [req("gqa", new, session_id=sid)])
    assert calls == ["broken"] * 2 and pool.num_used == used
    assert engine.sessions.table.get(sid).num_tokens == 15
    blocks_of_gone = list(engine.sessions.table.get(gone).block_table)

    def close_meanwhile(name):
        def closing(*args, **kwargs):
            calls.append(name)
            engine.sessions.table.close(gone)  # as a CloseSession RPC would, mid-forward
            return real[name](*args, **kwargs)

        return closing

    for name in real:
        monkeypatch.setattr(module, name, close_meanwhile(name))
    (closed,) = run_batch(engine, hosted, [req("gqa", x[:, 15:16], session_id=gone)])
    assert calls[-1] == "decode_one"
    assert isinstance(closed, SessionNotFound) and "closed" in str(closed)
    assert all(pool.refcount(b) == 0 for b in blocks_of_gone)
    monkeypatch.undo()
    kept = run(engine, hosted, req("gqa", x[:, 15:20], session_id=sid))  # not left busy
    alone = engine.sessions.create("gqa", None, None).session_id
    whole = run(engine, hosted, req("gqa", x, session_id=alone))
    assert kept.session.num_tokens == 20
    torch.testing.assert_close(
        torch.from_numpy(kept.output.numpy()), torch.from_numpy(whole.output.numpy())[:, 15:]
    )


def test_a_step_whose_output_overflows_only_in_the_dtype_asked_fails_alone(engine):
    hosted = engine.get("mha")
    sid = engine.sessions.create("mha", None, None).session_id
    x = seq(4, seed=6) * 1e6  # finite in float32; outputs far beyond float16's 65504
    run(engine, hosted, req("mha", x[:, :3], session_id=sid))
    narrow = req("mha", x[:, 3:], session_id=sid, output_dtype=torch.float16)
    (failed,) = run_batch(engine, hosted, [narrow])
    assert isinstance(failed, InvalidRequest) and "overflowed to NaN/Inf in float16" in str(failed)
    assert engine.sessions.table.session_stats(sid).num_tokens == 3  # not kept
    (ok,) = run_batch(engine, hosted, [req("mha", x[:, 3:], session_id=sid)])
    assert ok.output.dtype == torch.float32 and ok.session.num_tokens == 4


@pytest.mark.parametrize("gone", ["cancelled", "deadline"])
def test_a_step_whose_caller_is_gone_is_not_kept(engine, gone):
    """A caller that cancelled, or whose deadline passed, before its step was kept never
    hears the reply: the step is rolled back (its retry must not find it appended already);
    the other step of the batch is kept."""
    hosted = engine.get("gqa")
    kept_id, gone_id = (engine.sessions.create("gqa", None, None).session_id for _ in range(2))
    x = seq(6, seed=9)
    for sid in (kept_id, gone_id):
        run(engine, hosted, req("gqa", x[:, :4], session_id=sid))
    late = req("gqa", x[:, 4:5], session_id=gone_id)
    state = State()  # as serving's ticket: prepared before the caller left
    steps = [req("gqa", x[:, 4:5], session_id=kept_id), late]
    batch = [engine.prepare(steps[0]), engine.prepare(late, state)]
    if gone == "cancelled":
        state.cancelled = True
    else:
        state.deadline = time.monotonic() - 1e-3
    kept, abandoned = (torched(r) for r in engine.run_batch(hosted, batch))
    assert isinstance(abandoned, Abandoned) and "nothing of it was kept" in str(abandoned)
    assert isinstance(abandoned, DeadlinePassed) == (gone == "deadline")
    assert engine.sessions.table.session_stats(gone_id).num_tokens == 4
    assert kept.session.num_tokens == 5
    retry = run(engine, hosted, req("gqa", x[:, 4:5], session_id=gone_id))
    assert retry.session.num_tokens == 5
    torch.testing.assert_close(retry.output, kept.output, rtol=0, atol=ATOL)  # same tokens


def test_a_failure_while_settling_rolls_back_only_the_steps_not_kept(engine, monkeypatch):
    """Should settling a batch fail (a bug, or a late device error at the finiteness sync),
    no step is left pending (its session would answer busy, ABORTED, for good), the steps
    not kept answer that error, and a step already kept keeps its answer."""
    hosted = engine.get("mqa")
    ids = [engine.sessions.create("mqa", None, None).session_id for _ in range(2)]
    x = seq(4, seed=11)
    for sid in ids:
        run(engine, hosted, req("mqa", x[:, :2], session_id=sid))

    def fail(*_):
        raise RuntimeError("device error")

    # Before any step is kept: where rows' outputs are made (per row, or per batch where
    # every row takes its view of the batch's host copy).
    monkeypatch.setattr(engine_settle, "step_outputs", fail)
    monkeypatch.setattr(engine_settle, "_row_views", fail)
    results = run_batch(engine, hosted, [req("mqa", x[:, 2:3], session_id=s) for s in ids])
    assert [str(r) for r in results] == ["device error"] * 2
    monkeypatch.undo()
    commits, table = [], engine.sessions.table
    real = table.commit

    def second_fails(res, **kw):  # after the first step is kept
        commits.append(res)
        if len(commits) == 2:
            raise RuntimeError("bug")
        return real(res, **kw)

    monkeypatch.setattr(table, "commit", second_fails)
    first, second = run_batch(engine, hosted, [req("mqa", x[:, 2:3], session_id=s) for s in ids])
    monkeypatch.undo()
    assert first.session.num_tokens == 3 and str(second) == "bug"
    # Neither is left busy; the first step was kept, the second (its commit failed) was not.
    for sid, kept in zip(ids, (4, 3), strict=True):
        step = run(engine, hosted, req("mqa", x[:, 3:4], session_id=sid))
        assert step.session.num_tokens == kept


@pytest.mark.parametrize("alone", [True, False], ids=["lone step", "batch"])
def test_a_deadline_passing_while_the_reply_is_built_still_rolls_the_step_back(
    engine, monkeypatch, alone
):
    """The caller-gone check runs last, after the reply's tensors are made (weights can
    take milliseconds), right before the step is kept: in a batch (Sessions._settle) and
    for a lone step (Sessions._run_alone), whose reply is its output's array_of."""
    hosted = engine.get("gqa")
    sid, other = (engine.sessions.create("gqa", None, None).session_id for _ in range(2))
    # Where the reply's arrays are made: per row, or per batch (_row_views: every row's view
    # of the batch's host copy).
    state = State()
    if alone:  # its own array_of, or step_outputs' (an output to convert first)
        places = [(engine_lone_step, "array_of"), (engine_settle, "array_of")]
    else:
        places = [(engine_settle, "step_outputs"), (engine_settle, "_row_views")]
    for module, where in places:
        real = getattr(module, where)

        def slow(*args, real=real):  # the reply's tensors are made: the deadline passes
            state.deadline = time.monotonic() + 0.01
            time.sleep(0.05)
            return real(*args)

        monkeypatch.setattr(module, where, slow)
    calls = [req("gqa", seq(2, seed=12), session_id=sid)]
    if not alone:
        calls.append(req("gqa", seq(2, seed=13), session_id=other))
    result, *rest = run_batch(engine, hosted, calls, [state, State()][: len(calls)])
    assert isinstance(result, DeadlinePassed)
    assert engine.sessions.table.session_stats(sid).num_tokens == 0
    assert [r.session.num_tokens for r in rest] == [2] * (not alone)  # the other step: kept


def test_weights_are_checked_again_against_the_session_as_it_is_when_the_step_runs():
    """Validation sized the weights by the session then; a step of the same session kept
    since (queued ahead) makes them larger: refused then, with nothing kept."""
    spec = ModelSpec("tiny", AttentionConfig(32, 4, 2), max_weights_bytes=200)
    engine = Engine(
        [spec], device=torch.device("cpu"), dtype=torch.float32, max_response_bytes=2**20
    )
    hosted = engine.get("tiny")
    sid = engine.sessions.create("tiny", None, None).session_id
    x = torch.randn(1, 20, 32, generator=torch.Generator().manual_seed(13))
    run(engine, hosted, req("tiny", x[:, :8], session_id=sid))
    late = req("tiny", x[:, 18:19], session_id=sid, need_weights=True)
    engine.prepare(late)  # 4 heads x 1 row x 9 keys x 4 bytes = 144 <= 200
    run(engine, hosted, req("tiny", x[:, 8:18], session_id=sid))  # now 18 tokens
    with pytest.raises(TooLarge, match="19 keys"):  # 304 bytes
        run(engine, hosted, late)
    assert engine.sessions.table.session_stats(sid).num_tokens == 18


@pytest.mark.parametrize("name", ["mha", "gqa", "mqa"])
def test_a_truncated_session_equals_a_recompute_of_what_it_kept(engine, name):
    """Speculative decoding: 6 draft tokens appended, 2 accepted, the rest rolled back by
    truncate; the next tokens attend only to what was kept. A fork taken before the rewind
    keeps all of its tokens (the shared partial block is copied before the next write)."""
    hosted = engine.get(name)
    x = seq(30, seed=14)
    draft = seq(6, seed=15)
    sid = engine.sessions.create(name, None, None).session_id
    run(engine, hosted, req(name, x[:, :18], session_id=sid))
    run(engine, hosted, req(name, draft, session_id=sid))  # 24 tokens
    fork = engine.sessions.table.fork(sid).id
    engine.sessions.table.truncate(sid, 20)  # keeps 18 + the first 2 draft tokens
    kept = torch.cat([x[:, :18], draft[:, :2]], dim=1)
    step = run(engine, hosted, req(name, x[:, 20:30], session_id=sid))
    ref = run(engine, hosted, req(name, torch.cat([kept, x[:, 20:30]], 1), causal=True))
    assert (step.output - ref.output[:, 20:]).abs().max() < ATOL
    assert step.session.num_tokens == 30
    forked = run(engine, hosted, req(name, x[:, 29:30], session_id=fork))
    ref = run(engine, hosted, req(name, torch.cat([x[:, :18], draft, x[:, 29:30]], 1), causal=True))
    assert (forked.output - ref.output[:, 24:]).abs().max() < ATOL


def test_a_session_claimed_for_a_step_refuses_another_step_and_a_truncate_until_answered(
    engine,
):
    sessions = engine.sessions
    sid = sessions.create("gqa", None, None).session_id
    with sessions.stepping(sid):
        with (
            pytest.raises(SessionBusy, match="already has a step in flight"),
            sessions.stepping(sid),
        ):
            pass
        with pytest.raises(SessionBusy, match="truncate it once the step is answered"):
            sessions.truncate(sid, 0)
    with pytest.raises(RuntimeError), sessions.stepping(sid):  # released on an error too
        raise RuntimeError("the step failed")
    with sessions.stepping(sid):
        pass
    assert sessions.truncate(sid, 0).num_tokens == 0
    sessions.table.close(sid)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B", [1, 3])
def test_row_views_are_rows_of_each_whole_row(dtype, B):
    """_settle's rows of a batch's host copy, made in one pass (_row_views), are what
    _rows_of makes of each whole row: the same values, shape, dtype, C-contiguous views."""
    host = torch.randn(B, 2, 8).to(dtype)
    rows = engine_settle.array_of(host)
    for b, view in enumerate(engine_settle._row_views(rows)):
        want = engine_settle._rows_of(rows, b, 2)
        assert view.dtype == want.dtype and view.data.shape == want.data.shape == (1, 2, 8)
        assert view.data.flags.c_contiguous and (view.data == want.data).all()
        assert view.data.base is not None  # a view of the batch's memory, no copy
