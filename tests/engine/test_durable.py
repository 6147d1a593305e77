"""Sessions that outlive their place in the KV cache (issue 24), in the engine: a full cache
spills idle sessions and brings them back on their next call, bit for bit; the spill
tier's budget expires the oldest, saying so; a shutdown writes what is live and a new
engine on the directory adopts it; a spilled file that cannot be adopted ends its session
alone; owners hold through all of it."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from mha_serve.cache import SessionNotFound
from mha_serve.engine import Engine, ModelSpec
from mha_serve.model import AttentionConfig
from tests.engine_calls import attend, req

E = 32
BLOCK = 16
ATOL = 1e-5


def spec(
    name: str = "m", blocks: int = 8, window: int | None = None, block: int = BLOCK
) -> ModelSpec:
    cfg = AttentionConfig(E, 4, 2, sliding_window=window, causal=True)
    bytes_per_block = 2 * cfg.num_kv_heads * cfg.head_dim * block * 4
    return ModelSpec(
        name, cfg, seed=3, kv_cache_bytes=blocks * bytes_per_block, kv_block_size=block
    )


def engine(
    tmp_path, *specs: ModelSpec, spill_bytes: int = 1 << 22, spill: bool = True, **kw
) -> Engine:
    return Engine(
        list(specs) or [spec()],
        device=torch.device("cpu"),
        dtype=torch.float32,
        max_response_bytes=2**24,
        spill_dir=str(tmp_path / "spill") if spill else "",
        spill_bytes=spill_bytes if spill else 0,
        **kw,
    )


def tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randn(1, n, E, generator=torch.Generator().manual_seed(seed))


def test_three_times_more_sessions_than_the_cache_holds_each_step_equal_to_recompute(tmp_path):
    """24 sessions of up to 3 blocks over a cache of 8 blocks, stepped in random order:
    nothing is refused, every step equals the full causal attention of its session's
    tokens, and sessions went to disk and came back on the way."""
    e = engine(tmp_path)
    ids = [e.create_session("m").session_id for _ in range(24)]
    history = {sid: torch.zeros(1, 0, E) for sid in ids}
    rng = random.Random(0)
    restores = 0
    for i in range(120):
        sid = rng.choice(ids)
        n = rng.randint(1, 6)
        if history[sid].shape[1] + n > 3 * BLOCK:
            continue
        x = tokens(n, seed=i)
        history[sid] = torch.cat([history[sid], x], dim=1)
        spilled = e.sessions.table.spilled(sid) is not None
        out = attend(e, req("m", x, session_id=sid)).output
        restores += spilled
        ref = attend(e, req("m", history[sid], causal=True)).output[:, -n:]
        assert (out - ref).abs().max() < ATOL, f"step {i} of {sid}"
    assert restores > 10 and e.spill_info().num_sessions > 0


def test_a_restored_session_answers_bit_for_bit_what_it_would_have(tmp_path):
    """The same steps on two engines of the same seed, one that spills the session between
    its steps and brings it back: every output identical, not merely close."""
    kept, moved = engine(tmp_path / "a", spill=False), engine(tmp_path / "b")
    a, b = kept.create_session("m").session_id, moved.create_session("m").session_id
    for i, n in enumerate((7, 1, 20, 1, 3)):
        x = tokens(n, seed=10 + i)
        if i:  # spilled before each step after the first
            assert moved.spill_idle() == [b]
        want = attend(kept, req("m", x, session_id=a))
        got = attend(moved, req("m", x, session_id=b))
        assert torch.equal(got.output, want.output)
        assert got.session.num_tokens == want.session.num_tokens


def test_the_full_spill_tier_expires_its_oldest_saying_so(tmp_path):
    """Six sessions of 3 blocks over a cache of 8 blocks and a tier of about two: two in
    the cache, two spilled, and the two oldest expired from the tier, NOT_FOUND saying so;
    nothing was refused on the way."""
    e = engine(tmp_path, spill_bytes=14_000)
    ids = [e.create_session("m").session_id for _ in range(6)]
    for i, sid in enumerate(ids):
        attend(e, req("m", tokens(40, seed=i), session_id=sid))
    for sid in ids[:2]:
        with pytest.raises(SessionNotFound, match="expired from the full spill tier"):
            e.get_session(sid)
    assert [e.get_session(sid).num_tokens for sid in ids[2:]] == [40] * 4


def test_spilled_sessions_fork_truncate_read_and_close(tmp_path):
    e = engine(tmp_path)
    sid = e.create_session("m").session_id
    x = tokens(30, seed=1)
    attend(e, req("m", x, session_id=sid))
    e.spill_idle()
    assert e.get_session(sid).num_tokens == 30  # Get brings it back
    e.spill_idle()
    child = e.fork_session(sid)
    assert child.num_tokens == 30
    e.spill_idle()
    assert e.truncate_session(child.session_id, 12).num_tokens == 12
    step = attend(e, req("m", tokens(1, seed=2), session_id=child.session_id)).output
    ref = attend(e, req("m", torch.cat([x[:, :12], tokens(1, seed=2)], 1), causal=True))
    assert (step - ref.output[:, -1:]).abs().max() < ATOL
    e.spill_idle()
    e.close_session(sid)  # its file just goes
    with pytest.raises(SessionNotFound, match="was closed"):
        e.get_session(sid)
    assert e.spill_info().num_sessions == 1  # the child's


def test_a_sliding_window_session_spills_what_it_holds_and_comes_back_right(tmp_path):
    e = engine(tmp_path, spec(window=8))
    sid = e.create_session("m").session_id
    seq = tokens(60, seed=4)
    attend(e, req("m", seq[:, :50], session_id=sid))
    held = e.get_session(sid)
    assert held.first_position > 0
    e.spill_idle()
    out = attend(e, req("m", seq[:, 50:], session_id=sid))
    assert out.session.first_position >= held.first_position
    whole = attend(e, req("m", seq, causal=True)).output
    assert (out.output - whole[:, 50:]).abs().max() < ATOL


def test_reading_a_spilled_session_does_not_count_as_use_its_ttl_runs_on(tmp_path):
    """GetSession of a spilled session brings it back, and its TTL runs on from its last
    use, as for a session never spilled (a restore counted as use: a client polling its
    sessions kept the spilled ones alive past their TTL). Making room still spares a
    session just brought back, so that its call runs first."""
    now = [0.0]
    e = engine(tmp_path, spec(blocks=2), clock=lambda: now[0])
    polled = e.create_session("m", ttl_s=10.0).session_id
    attend(e, req("m", tokens(BLOCK, seed=1), session_id=polled))
    assert e.spill_idle() == [polled]
    now[0] = 5.0
    other = e.create_session("m", ttl_s=100.0).session_id
    attend(e, req("m", tokens(BLOCK, seed=2), session_id=other))
    now[0] = 8.0
    assert e.get_session(polled).num_tokens == BLOCK  # brought back (not a use): both held
    now[0] = 9.0
    big = e.create_session("m", ttl_s=100.0).session_id
    attend(e, req("m", tokens(BLOCK, seed=3), session_id=big))  # room: other goes, polled stays
    assert e.is_spilled(other) and not e.is_spilled(polled)
    now[0] = 11.0
    with pytest.raises(SessionNotFound, match="expired: idle 11.0 s"):
        e.get_session(polled)


def test_a_window_session_written_with_another_block_size_ends_saying_so(tmp_path):
    """kv_block_size changed across a restart: a sliding-window session whose first held
    position does not start a block here cannot come back whole. It ends NOT_FOUND saying
    why; adopted, the slots before that position in its first block held whatever was
    there (another session's K/V), and a truncate let its next step attend to them."""
    first = engine(tmp_path, spec(window=8))
    sid = first.create_session("m").session_id
    attend(first, req("m", tokens(50, seed=4), session_id=sid))
    assert first.get_session(sid).first_position == 2 * BLOCK
    first.spill_idle()
    first.close_spill()
    second = engine(tmp_path, spec(window=8, block=4 * BLOCK))
    other = second.create_session("m").session_id  # leaves its K/V in the blocks
    attend(second, req("m", 5 * tokens(60, seed=5), session_id=other))
    second.close_session(other)
    second.adopt_spilled()
    with pytest.raises(SessionNotFound, match="not a multiple of kv_block_size 64"):
        second.truncate_session(sid, 20)


def test_a_shutdown_writes_the_sessions_and_a_new_engine_adopts_them_ttl_and_owner_kept(
    tmp_path,
):
    first = engine(tmp_path, spec("m"), spec("n"))
    a = first.create_session("m", ttl_s=300.0, owner="token:alice").session_id
    b = first.create_session("n").session_id
    attend(first, req("m", tokens(20, seed=5), session_id=a))
    attend(first, req("n", tokens(9, seed=6), session_id=b))
    assert sorted(first.spill_idle()) == sorted([a, b])
    first.close_spill()
    second = engine(tmp_path, spec("m"), spec("n"))
    adopted, refused = second.adopt_spilled()
    assert sorted(adopted) == sorted([a, b]) and refused == []
    with pytest.raises(SessionNotFound, match="does not exist here"):
        second.get_session(a, owner="token:mallory")  # a stranger: as an unknown id
    stats = second.get_session(a, owner="token:alice")
    assert (stats.num_tokens, stats.ttl_s) == (20, 300.0)
    # the next steps equal what the first engine would have answered
    reference = engine(tmp_path / "ref", spec("m"), spec("n"), spill=False)
    r = reference.create_session("m").session_id
    attend(reference, req("m", tokens(20, seed=5), session_id=r))
    want = attend(reference, req("m", tokens(2, seed=7), session_id=r)).output
    got = attend(second, req("m", tokens(2, seed=7), session_id=a)).output
    assert torch.equal(got, want)


def test_a_spilled_file_that_cannot_be_adopted_ends_its_session_alone(tmp_path):
    e = engine(tmp_path)
    bad, good = (e.create_session("m").session_id for _ in range(2))
    for i, sid in enumerate((bad, good)):
        attend(e, req("m", tokens(10, seed=i), session_id=sid))
    e.spill_idle()
    path = e.sessions.table.spilled(bad).path
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # a damaged disk
    path.write_bytes(bytes(data))
    with pytest.raises(SessionNotFound, match="could not be brought back.*checksum"):
        attend(e, req("m", tokens(1, seed=3), session_id=bad))
    with pytest.raises(SessionNotFound, match="could not be brought back"):
        e.get_session(bad)  # gone, and says why
    assert attend(e, req("m", tokens(1, seed=4), session_id=good)).session.num_tokens == 11


def test_owners_hold_for_live_and_spilled_sessions_anonymous_ones_stay_open(tmp_path):
    e = engine(tmp_path)
    mine = e.create_session("m", owner="cert:alice").session_id
    open_ = e.create_session("m", owner="peer:ipv4:10.0.0.1").session_id
    attend(e, req("m", tokens(4, seed=1), session_id=mine))
    for spilled in (False, True):
        if spilled:
            e.spill_idle()
        for call in (
            lambda: e.get_session(mine, owner="cert:bob"),
            lambda: e.fork_session(mine, owner="cert:bob"),
            lambda: e.truncate_session(mine, 1, owner="cert:bob"),
            lambda: e.stepping(mine, owner="cert:bob").__enter__(),
            lambda: e.close_session(mine, owner="cert:bob"),
        ):
            with pytest.raises(SessionNotFound, match="does not exist here"):
                e.live(mine, "cert:bob", call)
        assert e.get_session(mine, owner="cert:alice").num_tokens == 4
        assert e.get_session(open_, owner="token:anyone").num_tokens == 0  # no identity


def test_a_session_still_stepping_at_shutdown_is_said_lost(tmp_path, caplog):
    """A session whose step was still running when the grace period ended is not written
    (its K/V are mid-step): it was lost with the process without a word."""
    e = engine(tmp_path)
    busy, idle = (e.create_session("m").session_id for _ in range(2))
    attend(e, req("m", tokens(3, seed=1), session_id=idle))
    e.sessions.claim(busy)  # its step under way
    with caplog.at_level("WARNING", logger="mha_serve.engine.sessions"):
        assert e.spill_idle() == [idle]
    assert "1 session(s) not written to the spill directory" in caplog.text


def test_a_session_whose_file_is_refused_at_start_says_why(tmp_path):
    """A file refused when a server adopts its directory (here: written for other weights)
    ends its session, whose next call said "does not exist here (never created on this
    server...)": it now says the file was refused, and why."""
    first = engine(tmp_path)
    sid = first.create_session("m", owner="token:alice").session_id
    attend(first, req("m", tokens(5, seed=1), session_id=sid))
    assert first.spill_idle() == [sid]
    first.close_spill()
    other_weights = engine(tmp_path, dataclasses.replace(spec(), seed=4))
    adopted, refused = other_weights.adopt_spilled()
    assert adopted == [] and len(refused) == 1
    with pytest.raises(SessionNotFound, match="does not exist here"):  # told its owner alone
        other_weights.get_session(sid, owner="token:mallory")
    with pytest.raises(
        SessionNotFound, match="spill file was refused when this server started.*other weights"
    ):
        other_weights.get_session(sid, owner="token:alice")


def test_a_restart_with_a_smaller_spill_budget_expires_the_oldest_to_fit(tmp_path):
    """The directory held more than the new session_spill_bytes: the adopting server kept
    it all, over its budget until the next spill; now the oldest expire at once, saying so."""
    first = engine(tmp_path)
    ids = [first.create_session("m").session_id for _ in range(3)]
    for i, sid in enumerate(ids):  # written oldest first
        attend(first, req("m", tokens(10, seed=i), session_id=sid))
    assert first.spill_idle() == ids
    each = first.spill_info().nbytes // 3
    first.close_spill()
    second = engine(tmp_path, spill_bytes=2 * each + each // 2)  # room for two
    adopted, refused = second.adopt_spilled()
    assert sorted(adopted) == sorted(ids[1:]) and refused == []
    assert second.spill_info().nbytes <= 2 * each + each // 2
    with pytest.raises(SessionNotFound, match="spilled to disk to make room"):
        second.get_session(ids[0])
