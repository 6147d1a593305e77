"""A session moved whole from one engine to another (issue 24: what a Ray replica that Ray
stops does with its sessions): packed as one record, received under the same id, owner,
limits and idle time, released at home; its next step on the new engine is bit-identical to
the one the old would have given. Forks, truncated and sliding-window sessions, spilled
ones, a full receiver, bad and foreign records."""

from __future__ import annotations

import pytest
import torch

from mha_serve.cache import CacheExhausted, SessionBusy, SessionExists, SessionNotFound
from mha_serve.cache.record import BadRecord
from mha_serve.engine import Engine, ModelSpec
from mha_serve.model import AttentionConfig
from tests.engine_calls import attend, req

E = 32
BLOCK = 16
ATOL = 1e-5
ALICE = "token:alice"


def spec(name: str = "m", blocks: int = 8, window: int | None = None, seed: int = 3) -> ModelSpec:
    cfg = AttentionConfig(E, 4, 2, sliding_window=window, causal=True)
    bytes_per_block = 2 * cfg.num_kv_heads * cfg.head_dim * BLOCK * 4
    return ModelSpec(
        name, cfg, seed=seed, kv_cache_bytes=blocks * bytes_per_block, kv_block_size=BLOCK
    )


def engine(*specs: ModelSpec, spill_dir: str = "", prefix: str = "") -> Engine:
    return Engine(
        list(specs) or [spec()],
        device=torch.device("cpu"),
        dtype=torch.float32,
        max_response_bytes=2**24,
        spill_dir=spill_dir,
        spill_bytes=1 << 22 if spill_dir else 0,
        session_id_prefix=prefix,
    )


def tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randn(1, n, E, generator=torch.Generator().manual_seed(seed))


def move(src: Engine, dst: Engine, sid: str) -> None:
    dst.receive_session(src.pack_session(sid))
    src.session_moved(sid, "replica 'b'")


def test_a_moved_session_answers_bit_for_bit_what_it_would_have_at_home():
    """Packed, received by another engine of the same model: its id, tokens, limits and
    owner come along, and every later step on either engine gives identical outputs; at
    home it is gone, NOT_FOUND saying where it went."""
    home, other = engine(prefix="a-"), engine(prefix="b-")
    sid = home.create_session("m", max_len=100, ttl_s=600, owner=ALICE).session_id
    attend(home, req("m", tokens(21, seed=1), session_id=sid))
    packed = home.pack_session(sid)
    got = other.receive_session(packed)
    assert (got.session_id, got.num_tokens, got.max_len, got.ttl_s) == (sid, 21, 100, 600)
    for i, n in enumerate((1, 5, 17)):  # the same steps at home and moved
        x = tokens(n, seed=10 + i)
        want = attend(home, req("m", x, session_id=sid))
        moved = attend(other, req("m", x, session_id=sid))
        assert torch.equal(moved.output, want.output)
    home.session_moved(sid, "replica 'b'")
    with pytest.raises(SessionNotFound, match="moved to replica 'b'") as gone:
        home.get_session(sid)
    assert gone.value.reason == "moved"
    assert home.cache_info("m").num_blocks_used == 0
    with pytest.raises(SessionNotFound, match="does not exist here"):  # its owner holds
        other.get_session(sid, owner="token:mallory")
    assert other.get_session(sid, owner=ALICE).num_tokens == 21 + 1 + 5 + 17


def test_forks_truncated_and_sliding_window_sessions_move_equal_to_recompute():
    """A fork (sharing its parent's blocks at home) moves with K/V of its own; a truncated
    session moves with what it kept; a sliding-window session moves with its window only
    (its first position past 0), and each next step equals the full causal recompute."""
    home = engine(spec(), spec("w", blocks=16, window=24))
    other = engine(spec(), spec("w", blocks=16, window=24))
    x = tokens(40, seed=1)
    parent = home.create_session("m").session_id
    attend(home, req("m", x, session_id=parent))
    child = home.fork_session(parent).session_id
    home.truncate_session(parent, 9)
    windowed = home.create_session("w").session_id
    w = tokens(70, seed=2)
    attend(home, req("w", w, session_id=windowed))
    assert home.get_session(windowed).first_position > 0
    for sid in (parent, child, windowed):
        move(home, other, sid)
    step = tokens(2, seed=3)
    for sid, model, history in ((parent, "m", x[:, :9]), (child, "m", x), (windowed, "w", w)):
        out = attend(other, req(model, step, session_id=sid)).output
        full = attend(other, req(model, torch.cat([history, step], 1), causal=True)).output
        assert (out - full[:, -2:]).abs().max() < ATOL, sid
    assert home.cache_info("m").num_blocks_used == 0 and home.session_ids() == []


def test_a_spilled_session_moves_from_its_file_and_lands_spilled_when_the_cache_is_full(tmp_path):
    """A session in the spill tier packs from its file; a receiver whose cache is full of
    busy sessions (nothing to spill) takes it into its own spill tier; one without a spill
    tier refuses it (CacheExhausted), the session still whole at home."""
    home = engine(spill_dir=str(tmp_path / "home"), prefix="a-")
    sid = home.create_session("m").session_id
    x = tokens(30, seed=1)
    attend(home, req("m", x, session_id=sid))
    assert home.spill_idle() == [sid]
    packed = home.pack_session(sid)
    full = engine(spec(blocks=2), prefix="c-")
    hog = full.create_session("m").session_id
    attend(full, req("m", tokens(32, seed=5), session_id=hog))
    with pytest.raises(CacheExhausted):
        full.receive_session(packed)
    assert home.get_session(sid).num_tokens == 30  # still home, brought back whole
    home.spill_idle()
    spilling = engine(spec(blocks=2), spill_dir=str(tmp_path / "other"), prefix="b-")
    hog = spilling.create_session("m").session_id
    attend(spilling, req("m", tokens(32, seed=5), session_id=hog))
    with spilling.stepping(hog):  # busy: making room cannot spill it
        assert spilling.receive_session(packed).num_tokens == 30
    assert spilling.is_spilled(sid)
    home.session_moved(sid, "replica 'b'")
    assert home.spill_info().num_sessions == 0  # its file went
    step = tokens(1, seed=9)
    out = attend(spilling, req("m", step, session_id=sid)).output  # brought back on its call
    full_ref = attend(spilling, req("m", torch.cat([x, step], 1), causal=True)).output
    assert (out - full_ref[:, -1:]).abs().max() < ATOL


def test_idle_time_goes_on_across_a_move():
    """The record carries the session's idle time: a TTL already past on arrival is
    refused as expired (NOT_FOUND saying so); one not yet past goes on counting."""
    home, other = engine(), engine()
    sid = home.create_session("m", ttl_s=60).session_id
    packed = home.pack_session(sid)
    wall = other.sessions.table._wall
    other.sessions.table._wall = lambda: wall() + 61
    with pytest.raises(SessionNotFound, match="expired while it moved") as late:
        other.receive_session(packed)
    assert late.value.reason == "expired"
    other.sessions.table._wall = lambda: wall() + 30
    other.receive_session(packed)
    s = other.sessions.table._sessions[sid]
    assert 30 <= other.sessions.table._clock() - s.last_used_s < 40


def test_a_busy_session_does_not_pack_and_an_id_held_already_is_refused():
    home, other = engine(), engine()
    sid = home.create_session("m").session_id
    with home.stepping(sid), pytest.raises(SessionBusy, match="moves once idle"):
        home.pack_session(sid)
    packed = home.pack_session(sid)
    other.receive_session(packed)
    with pytest.raises(SessionExists, match="already held here"):
        other.receive_session(packed)


def test_records_of_other_weights_models_or_damaged_bytes_are_refused_saying_why():
    home = engine()
    sid = home.create_session("m").session_id
    attend(home, req("m", tokens(5, seed=1), session_id=sid))
    packed = home.pack_session(sid)
    with pytest.raises(BadRecord, match="other weights or shape"):
        engine(spec(seed=4)).receive_session(packed)
    with pytest.raises(BadRecord, match="not served here"):
        engine(spec("n")).receive_session(packed)
    flipped = bytearray(packed)
    flipped[-3] ^= 0x40
    with pytest.raises(BadRecord, match="checksum"):
        engine().receive_session(bytes(flipped))
    with pytest.raises(BadRecord, match="too short|truncated"):
        engine().receive_session(packed[:20])
    assert home.get_session(sid).num_tokens == 5  # nothing moved: still whole at home


def test_session_ids_lists_live_and_spilled_least_recently_used_first(tmp_path):
    e = engine(spill_dir=str(tmp_path / "s"))
    a, b, c = (e.create_session("m").session_id for _ in range(3))
    attend(e, req("m", tokens(3, seed=1), session_id=a))
    e.spill_idle()
    e.get_session(b)
    assert set(e.session_ids()) == {a, b, c} and e.session_ids()[-1] == b
