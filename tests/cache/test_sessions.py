"""SessionTable bookkeeping: reserve/commit/rollback, forks with copy-on-write, max_len,
TTL, LRU eviction, pinning, why-not-found messages, stats. No model here (see
test_incremental_cache.py for the numbers)."""

import pytest
import torch

from mha_serve.cache import (
    CacheExhausted,
    InvalidSessionArgument,
    KVCache,
    SessionBusy,
    SessionFull,
    SessionNotFound,
    SessionTable,
)

BS = 4  # tokens per block


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(num_blocks=8, *, evict=False, max_len=None, ttl_s=None, clock=None):
    kv = KVCache(num_kv_heads=1, head_dim=2, budget_bytes=num_blocks * BS * 16, block_size=BS)
    assert kv.num_blocks == num_blocks
    table = SessionTable(evict=evict, default_ttl_s=ttl_s, clock=clock or Clock())
    table.add_model("m", kv, max_len=max_len)
    return table, kv


def append(table, sid, n):
    res = table.reserve(sid, n)
    table.commit(res)
    return res


def assert_all_free(table):
    pool = table.pool("m")
    assert pool.num_used == 0 and pool.num_free == pool.num_blocks
    assert all(pool.refcount(b) == 0 for b in range(pool.num_blocks))


def test_reserve_gives_slots_block_by_block_and_commit_counts_tokens():
    table, _ = make()
    s = table.create("m")
    res = table.reserve(s.id, 6)
    assert res.start == 0 and res.num_tokens == 6 and res.num_new_blocks == 2
    b0, b1 = res.block_table
    assert res.slots == (b0 * BS, b0 * BS + 1, b0 * BS + 2, b0 * BS + 3, b1 * BS, b1 * BS + 1)
    assert s.num_tokens == 0 and s.in_use == 1, "uncommitted tokens do not count"
    table.commit(res)
    assert s.num_tokens == 6 and s.in_use == 0
    res = append(table, s.id, 3)  # fills b1, opens a third block
    assert res.start == 6 and res.num_new_blocks == 1
    assert res.slots[:2] == (b1 * BS + 2, b1 * BS + 3)
    assert s.num_tokens == 9 and s.num_blocks == 3 == table.pool("m").num_used


def test_rollback_frees_the_new_blocks_and_keeps_num_tokens():
    table, _ = make()
    s = table.create("m")
    append(table, s.id, 3)
    res = table.reserve(s.id, 6)
    assert table.pool("m").num_used == 3
    table.rollback(res)
    assert s.num_tokens == 3 and s.num_blocks == 1 and s.in_use == 0
    assert table.pool("m").num_used == 1
    with pytest.raises(ValueError, match="pending"):
        table.commit(res)
    assert append(table, s.id, 2).start == 3


def test_one_step_in_flight_per_session():
    table, _ = make()
    s = table.create("m")
    table.reserve(s.id, 1)
    with pytest.raises(SessionBusy, match="in flight"):
        table.reserve(s.id, 1)


@pytest.mark.parametrize(
    ("session_max", "model_max", "piece"),
    [(10, None, "past its max_len 10"), (None, 10, "past its max_len 10 (the model's)")],
)
def test_max_len_checked_before_allocating(session_max, model_max, piece):
    table, _ = make(max_len=model_max)
    s = table.create("m", max_len=session_max)
    append(table, s.id, 8)
    used = table.pool("m").num_used
    with pytest.raises(SessionFull) as err:
        table.reserve(s.id, 3)
    assert "holds 8 tokens; appending 3 would make 11" in str(err.value)
    assert piece in str(err.value)
    assert table.pool("m").num_used == used and s.in_use == 0
    append(table, s.id, 2)  # exactly max_len is fine


def test_create_refuses_bad_arguments():
    table, _ = make(max_len=100)
    for kwargs, piece in [
        ({"max_len": 101}, "max_len 101 is past the max_seq_len 100 of model 'm'"),
        ({"max_len": 0}, ">= 1"),
        ({"ttl_s": -1}, "> 0"),
    ]:
        with pytest.raises(InvalidSessionArgument, match=piece):
            table.create("m", **kwargs)
    with pytest.raises(InvalidSessionArgument, match=r"no KV cache; models with one: \['m'\]"):
        table.create("nope")
    with pytest.raises(InvalidSessionArgument, match=">= 1"):
        table.reserve(table.create("m").id, 0)


def test_fork_shares_blocks_and_copies_the_partial_one_on_write():
    table, kv = make()
    parent = table.create("m")
    append(table, parent.id, 6)  # one full block, one partial (2 of 4)
    full, partial = parent.block_table
    kv.k[:, partial].fill_(7.0)
    child = table.fork(parent.id)
    pool = table.pool("m")
    assert child.block_table == [full, partial] and child.num_tokens == 6
    assert pool.refcount(full) == pool.refcount(partial) == 2 and pool.num_used == 2

    res = table.reserve(child.id, 3)  # writes into the partial block: copy it first
    copy = child.block_table[1]
    assert copy != partial and child.block_table[0] == full
    assert torch.equal(kv.k[:, copy], kv.k[:, partial]), "the copy holds the shared tokens"
    assert all(s // BS != partial for s in res.slots), "the child never writes the shared block"
    assert pool.refcount(partial) == 1 and pool.refcount(full) == 2
    table.commit(res)

    res = table.reserve(parent.id, 2)  # the partial block is the parent's alone now: no copy
    assert parent.block_table == [full, partial] and res.num_new_blocks == 0
    table.commit(res)


def test_fork_of_block_aligned_session_copies_nothing():
    table, _ = make()
    parent = table.create("m")
    append(table, parent.id, 8)
    child = table.fork(parent.id)
    res = table.reserve(child.id, 1)
    assert res.block_table[:2] == tuple(parent.block_table) and res.num_new_blocks == 1
    assert table.pool("m").num_used == 3


def test_close_frees_at_once_and_accounting_returns_to_zero():
    table, _ = make()
    a = table.create("m")
    append(table, a.id, 7)
    b = table.fork(a.id)
    append(table, b.id, 5)
    c = table.fork(b.id)
    table.close(a.id)
    # b copied a's partial block on write; all of b's 3 blocks are shared with c
    assert table.pool("m").num_used == 3
    table.close(b.id)
    table.close(c.id)
    assert_all_free(table)
    assert len(table) == 0


def test_closing_a_session_mid_step_frees_it_when_the_step_ends():
    table, _ = make()
    s = table.create("m")
    res = table.reserve(s.id, 5)
    table.close(s.id)
    assert table.pool("m").num_used == 2, "blocks a running step writes stay held"
    with pytest.raises(SessionNotFound, match="was closed"):  # the step's caller hears it
        table.commit(res)
    assert_all_free(table)
    with pytest.raises(SessionNotFound, match="was closed"):
        table.get(s.id)


def test_not_found_says_why():
    clock = Clock()
    table, _ = make(4, evict=True, clock=clock)
    closed, expiring, victim = (table.create("m", ttl_s=ttl) for ttl in (None, 5, None))
    table.close(closed.id)
    append(table, victim.id, 8)
    clock.now += 6
    big = table.create("m")
    append(table, big.id, 16)  # needs all 4 blocks: victim is evicted
    cases = {
        "nope": ("unknown", "does not exist here"),
        closed.id: ("closed", "was closed"),
        expiring.id: ("expired", "idle 6.0 s, past its TTL of 5 s"),
        victim.id: ("evicted", "evicted to free KV-cache memory for model 'm'"),
    }
    for sid, (reason, piece) in cases.items():
        with pytest.raises(SessionNotFound) as err:
            table.get(sid)
        assert err.value.reason == reason and piece in str(err.value), str(err.value)
        assert err.value.session_id == sid


def test_gone_ids_are_remembered_up_to_a_bound():
    table = SessionTable(max_remembered=2)
    table.add_model("m", KVCache(num_kv_heads=1, head_dim=2, budget_bytes=1024, block_size=BS))
    ids = [table.create("m").id for _ in range(3)]
    for sid in ids:
        table.close(sid)
    reasons = []
    for sid in ids:
        with pytest.raises(SessionNotFound) as err:
            table.get(sid)
        reasons.append(err.value.reason)
    assert reasons == ["unknown", "closed", "closed"]


def test_ttl_expiry_counts_from_last_use_and_spares_pinned():
    clock = Clock()
    table, _ = make(clock=clock, ttl_s=10)
    idle, busy, pinned = (table.create("m") for _ in range(3))
    for s in (idle, busy, pinned):
        append(table, s.id, 1)
    clock.now += 8
    append(table, busy.id, 1)
    table.pin(pinned.id)
    clock.now += 3
    assert table.expire() == [idle.id]
    assert table.pool("m").num_used == 2
    table.unpin(pinned.id)
    assert table.expire(clock.now + 100) == [busy.id, pinned.id]
    assert_all_free(table)


def test_exhausted_without_eviction_raises_with_numbers_and_changes_nothing():
    table, _ = make(4)
    a, b = table.create("m"), table.create("m")
    append(table, a.id, 9)  # 3 blocks
    with pytest.raises(CacheExhausted) as err:
        table.reserve(b.id, 5)  # needs 2, 1 free
    msg = str(err.value)
    assert "needs 2 more block(s) of 4 tokens but 1 of 4 are free" in msg
    assert "budget 256 bytes, 64 bytes per block" in msg and "eviction is off" in msg
    assert (err.value.num_needed, err.value.num_free) == (2, 1)
    assert b.num_blocks == 0 and b.in_use == 0 and a.num_tokens == 9
    assert table.pool("m").num_used == 3


def test_eviction_takes_least_recently_used_unpinned_sessions():
    clock = Clock()
    table, _ = make(6, evict=True, clock=clock)
    s = [table.create("m") for _ in range(4)]
    for i in (2, 0, 3, 1):  # use order: s2 oldest, then s0, s3, s1
        append(table, s[i].id, 4)
        clock.now += 1
    table.pin(s[2].id)
    new = table.create("m")
    append(table, new.id, 12)  # 3 blocks, 2 free: evict s0 (s2 is pinned), then enough
    assert [x.id in {y.session_id for y in table.stats()["m"].sessions} for x in s] == [
        False,
        True,
        True,
        True,
    ]
    with pytest.raises(SessionNotFound, match="evicted"):
        table.reserve(s[0].id, 1)


def test_eviction_evicts_nothing_when_it_could_not_free_enough():
    table, _ = make(4, evict=True)
    a, c = table.create("m"), table.create("m")
    append(table, a.id, 8)
    append(table, c.id, 4)
    table.pin(c.id)  # a step in flight: never evicted
    b = table.fork(a.id)  # shares both of a's blocks: evicting a frees nothing
    with pytest.raises(CacheExhausted, match="eviction cannot free enough"):
        table.reserve(b.id, 8)  # needs 2 more, 1 free
    table.get(a.id)  # still there


def test_reserve_many_pins_the_whole_batch_before_making_room():
    clock = Clock()
    table, _ = make(3, evict=True, clock=clock)
    a, b = table.create("m"), table.create("m")
    append(table, a.id, 4)
    clock.now += 1
    append(table, b.id, 4)
    # a needs 2 blocks (1 free): evicting b would help, but b is in the batch.
    results = table.reserve_many([(a.id, 5), (b.id, 1), ("nope", 1), (b.id, 1)])
    assert isinstance(results[0], CacheExhausted)
    assert results[1].session_id == b.id
    assert isinstance(results[2], SessionNotFound) and isinstance(results[3], SessionBusy)
    assert a.in_use == 0 and b.in_use == 1  # only b's reservation pins now
    table.commit(results[1])


def test_stats_and_fragmentation_by_hand():
    table, _ = make(8)
    a = table.create("m")
    append(table, a.id, 6)  # blocks: [4 tokens, 2 tokens]
    b = table.fork(a.id)
    append(table, b.id, 1)  # b copies the partial block: [shared 4, own 3]
    c = table.create("m")
    append(table, c.id, 1)  # [1 token]
    st = table.stats()["m"]
    # used blocks: a's 2, b's copy, c's 1 = 4 blocks = 16 slots holding 4+2+3+1 = 10 tokens
    assert (st.num_blocks_used, st.num_blocks_free, st.num_blocks) == (4, 4, 8)
    assert st.num_tokens == 6 + 7 + 1 and st.num_tokens_stored == 10
    assert st.fragmentation == pytest.approx(6 / 16)
    assert st.bytes_used == 4 * 64 and st.budget_bytes == 8 * 64 and st.num_sessions == 3
    per = {x.session_id: (x.num_tokens, x.num_blocks, x.bytes_held) for x in st.sessions}
    assert per == {a.id: (6, 2, 128), b.id: (7, 2, 128), c.id: (1, 1, 64)}
    assert table.session_stats(b.id).bytes_held == 128
    for s in (a, b, c):
        table.close(s.id)
    st = table.stats()["m"]
    assert (st.num_blocks_used, st.num_tokens, st.fragmentation) == (0, 0, 0.0)


def test_eviction_spares_sessions_that_would_free_nothing():
    """An empty session holds no block: evicting it frees nothing, so the older empty one
    stays while the session that frees a block goes."""
    clock = Clock()
    table, _ = make(2, evict=True, clock=clock)
    empty = table.create("m")
    clock.now += 1
    b = table.create("m")
    append(table, b.id, 4)
    clock.now += 1
    a = table.create("m")
    append(table, a.id, 4)
    clock.now += 1
    append(table, a.id, 1)  # needs a block, none free: b's is the one to take
    table.get(empty.id)
    with pytest.raises(SessionNotFound, match="evicted"):
        table.get(b.id)


def test_a_fork_and_its_parent_are_evicted_together_when_only_both_free_a_block():
    clock = Clock()
    table, _ = make(2, evict=True, clock=clock)
    parent = table.create("m")
    append(table, parent.id, 4)  # one full block, shared with the fork below
    clock.now += 1
    child = table.fork(parent.id)
    clock.now += 1
    a = table.create("m")
    append(table, a.id, 4)
    clock.now += 1
    append(table, a.id, 1)
    for gone in (parent.id, child.id):
        with pytest.raises(SessionNotFound, match="evicted"):
            table.get(gone)
    assert table.get(a.id).num_tokens == 5


def test_evicting_the_other_holder_of_a_shared_partial_block_lets_a_fork_write_in_place():
    clock = Clock()
    table, _ = make(1, evict=True, clock=clock)
    parent = table.create("m")
    append(table, parent.id, 2)  # a partial block
    clock.now += 1
    child = table.fork(parent.id)
    clock.now += 1
    shared = tuple(table.get(child.id).block_table)
    res = table.reserve(child.id, 1)  # a private copy needs a block: none free, but ...
    table.commit(res)
    with pytest.raises(SessionNotFound, match="evicted"):  # ... its only other holder went
        table.get(parent.id)
    assert res.block_table == shared  # written in place, no copy
    assert table.get(child.id).num_tokens == 3


def test_a_step_past_all_the_cache_could_hold_is_out_of_range_not_exhausted():
    """RESOURCE_EXHAUSTED says retry later; a step no eviction could ever fit is refused as
    OUT_OF_RANGE with the cache's capacity."""
    table, _ = make(4, evict=True)
    s = table.create("m")
    append(table, s.id, 3)
    with pytest.raises(SessionFull, match="KV cache of model 'm' holds: 4 blocks of 4 tokens"):
        table.reserve(s.id, 14)  # 17 tokens: 5 blocks of the 4 there are
    assert table.get(s.id).num_tokens == 3 and table.pool("m").num_used == 1


def test_truncate_keeps_the_first_tokens_and_frees_the_blocks_past_them():
    table, _ = make(8)
    s = table.create("m")
    append(table, s.id, 10)  # 3 blocks of 4
    assert table.truncate(s.id, 5).num_tokens == 5
    assert table.get(s.id).num_blocks == 2 and table.pool("m").num_used == 2
    res = table.reserve(s.id, 2)  # positions 5, 6: in the kept partial block, no copy
    assert res.start == 5 and res.num_new_blocks == 0
    table.commit(res)
    assert table.truncate(s.id, 0).num_tokens == 0 and table.pool("m").num_used == 0
    table.close(s.id)
    assert_all_free(table)


def test_truncate_refuses_bad_counts_and_a_session_with_a_step_in_flight():
    table, _ = make(8)
    s = table.create("m")
    append(table, s.id, 3)
    for bad, fragment in ((4, "holds 3 tokens: it cannot be truncated to 4"), (-1, ">= 0")):
        with pytest.raises(InvalidSessionArgument, match=fragment):
            table.truncate(s.id, bad)
    res = table.reserve(s.id, 1)
    with pytest.raises(SessionBusy, match="in flight"):
        table.truncate(s.id, 1)
    table.commit(res)
    assert table.get(s.id).num_tokens == 4


def test_truncating_into_a_block_a_fork_shares_copies_it_before_the_next_append():
    table, _ = make(8)
    parent = table.create("m")
    append(table, parent.id, 7)  # blocks: full, partial (3 of 4)
    child = table.fork(parent.id)
    table.truncate(parent.id, 5)  # keeps both blocks, still shared with the fork
    shared = table.get(parent.id).block_table[1]
    res = table.reserve(parent.id, 1)  # writes position 5: into a private copy
    assert res.block_table[1] != shared and table.get(child.id).block_table[1] == shared
    table.commit(res)
    assert table.get(child.id).num_tokens == 7


@pytest.mark.parametrize("finish", ["commit", "rollback"])
def test_a_step_longer_than_the_ttl_is_no_idle_time_however_it_ends(finish):
    clock = Clock()
    table, _ = make(clock=clock)
    s = table.create("m", ttl_s=2.0)
    res = table.reserve(s.id, 3)
    clock.now += 3.0  # the step runs past the TTL: the session is pinned, not idle
    getattr(table, finish)(res)
    clock.now += 0.1  # a retry right after the answer (a rolled-back step's error)
    assert table.get(s.id).num_tokens == (3 if finish == "commit" else 0)
    clock.now += 2.0
    with pytest.raises(SessionNotFound, match="expired: idle 2.1 s"):
        table.get(s.id)


def test_exhausted_does_not_count_a_copy_the_expiry_made_unneeded():
    clock = Clock()
    table, _ = make(2, clock=clock)
    a, c = table.create("m"), table.create("m")
    append(table, a.id, 2)  # a partial block...
    table.fork(a.id, ttl_s=1.0)  # ...shared with a fork that expires below
    append(table, c.id, 4)  # the pool is full
    clock.now += 5
    with pytest.raises(CacheExhausted) as err:
        table.reserve(a.id, 3)  # one new block; a's last block is its own once the fork expired
    assert err.value.num_needed == 1 and "needs 1 more block(s)" in str(err.value)
    assert table.pool("m").refcount(table.get(a.id).block_table[0]) == 1


class FailingCopy(KVCache):
    fail = False

    def copy_block(self, src: int, dst: int) -> None:
        if self.fail:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        super().copy_block(src, dst)


def test_a_failed_copy_on_write_leaks_no_block_and_leaves_no_pin():
    kv = FailingCopy(num_kv_heads=1, head_dim=2, budget_bytes=8 * BS * 16, block_size=BS)
    table = SessionTable(clock=Clock())
    table.add_model("m", kv)
    parent, other = table.create("m"), table.create("m")
    append(table, parent.id, 2)
    child = table.fork(parent.id)  # shares the partial block: parent's next step copies it
    append(table, other.id, 1)
    used = table.pool("m").num_used
    kv.fail = True
    with pytest.raises(RuntimeError, match="CUDA error"):  # other's reservation is undone too
        table.reserve_many([(other.id, 4), (parent.id, 3)])
    assert table.pool("m").num_used == used
    for s in (parent, other, child):
        s = table.get(s.id)
        assert s.in_use == 0 and s.pending is None
    assert (table.get(parent.id).num_tokens, table.get(other.id).num_tokens) == (2, 1)
    kv.fail = False
    append(table, parent.id, 3)  # the session works after the error
    for s in (parent, other, child):
        table.close(s.id)
    assert_all_free(table)


def test_on_end_hears_every_session_end_with_its_reason():
    clock = Clock()
    table, _ = make(2, evict=True, clock=clock)
    ended: list[str] = []
    table.on_end = ended.append
    closed, lru, ttl = table.create("m"), table.create("m"), table.create("m", ttl_s=1.0)
    table.close(closed.id)
    append(table, lru.id, 4)
    append(table, ttl.id, 4)
    clock.now += 0.5
    table.get(ttl.id)  # not use: its TTL counts from its step
    clock.now += 1.0
    with pytest.raises(SessionNotFound, match="expired"):
        table.get(ttl.id)  # expired by a lookup
    other = table.create("m")
    append(table, other.id, 8)  # both blocks: lru is evicted
    assert ended == ["closed", "expired", "evicted"]


def test_a_failing_on_end_hook_leaves_the_table_whole():
    table, _ = make(4)

    def broken(reason: str) -> None:
        raise RuntimeError("metrics backend hiccup")

    table.on_end = broken
    s = table.create("m")
    append(table, s.id, 5)
    table.close(s.id)  # the hook's error is logged, not raised
    assert_all_free(table)
    with pytest.raises(SessionNotFound, match="was closed"):
        table.get(s.id)


def test_one_busy_rule_covers_a_claimed_step_from_receipt_to_answer():
    """claim() at receipt makes the session busy for another step, an unclaimed reserve and
    a truncate, until release(); the claimer's own reserve goes ahead."""
    table, _ = make()
    s = table.create("m")
    append(table, s.id, 3)
    table.claim(s.id)
    with pytest.raises(SessionBusy, match="one at a time"):
        table.claim(s.id)
    with pytest.raises(SessionBusy, match="one at a time"):
        table.reserve(s.id, 1)
    with pytest.raises(SessionBusy, match="truncate it once the step is answered"):
        table.truncate(s.id, 1)
    res = table.reserve(s.id, 2, claimed=True)
    assert table.commit(res).num_tokens == 5
    table.release(s.id)
    assert table.truncate(s.id, 1).num_tokens == 1
    # A step whose caller left released its claim; its reservation is still pending: a new
    # step may claim (it queues behind), not reserve until that one is rolled back.
    table.claim(s.id)
    gone = table.reserve(s.id, 1, claimed=True)
    table.release(s.id)
    table.claim(s.id)
    with pytest.raises(SessionBusy):
        table.reserve(s.id, 1, claimed=True)
    table.rollback(gone)
    table.commit(table.reserve(s.id, 1, claimed=True))
    table.close(s.id)
    table.release(s.id)  # the session went while claimed: releasing it is no error
    assert_all_free(table)


def test_a_claimed_session_is_pinned_until_its_step_is_answered():
    """A step waiting in the queue (claimed, not yet reserved) never finds its session
    expired or evicted; once answered, the session ages and can go as usual."""
    clock = Clock()
    table, _ = make(2, evict=True, clock=clock)
    s = table.create("m", ttl_s=5)
    append(table, s.id, 2 * BS)  # both blocks
    table.claim(s.id)
    clock.now += 60
    assert table.expire() == []  # past its TTL, but claimed
    other = table.create("m")
    with pytest.raises(CacheExhausted):  # eviction may not take the claimed session
        table.reserve(other.id, 1)
    table.release(s.id)
    assert table.get(s.id).num_tokens == 2 * BS  # idle time starts at the release
    clock.now += 6
    assert table.expire() == [s.id]


def test_the_engines_state_is_carried_never_read():
    """Session.engine_state, the engine's per-session state (its key bound): set by a commit
    that brings one, kept by one that does not, shared (the same object) by a fork, kept by
    a truncate that leaves tokens and dropped by one that leaves none; a reservation carries
    what the step found, and a fork's later steps never change its parent's."""
    table, _ = make()
    s = table.create("m")
    assert s.engine_state is None
    first, second = object(), object()
    table.commit(table.reserve(s.id, 3), engine_state=first)
    assert s.engine_state is first
    append(table, s.id, 2)  # no state brought: kept
    assert s.engine_state is first
    child = table.fork(s.id)
    assert child.engine_state is first
    res = table.reserve(child.id, 1)
    assert res.engine_state is first
    table.commit(res, engine_state=second)
    assert (child.engine_state, s.engine_state) == (second, first)
    table.truncate(s.id, 1)
    assert s.engine_state is first  # it holds for any prefix of the K/V
    table.truncate(s.id, 0)
    assert s.engine_state is None
    res = table.reserve(s.id, 2)
    assert res.engine_state is None
    table.rollback(res)


def test_reserve_many_holds_claimed_sessions_by_their_claims_without_pins(monkeypatch):
    """Served steps are claimed from receipt to answer: a claim holds a session as a pin
    does, so the batch pins only its unclaimed members, and making room for one still
    never evicts another."""
    clock = Clock()
    table, _ = make(3, evict=True, clock=clock)
    a, b, c = table.create("m"), table.create("m"), table.create("m")
    append(table, a.id, 4)
    clock.now += 1
    append(table, b.id, 4)
    pins: list[str] = []
    real_pin = table.pin
    monkeypatch.setattr(table, "pin", lambda sid: (pins.append(sid), real_pin(sid))[1])
    for s in (a, b):
        table.claim(s.id)
    # a needs 2 blocks (1 free): evicting b would help, but b is in the batch, claimed.
    results = table.reserve_many([(a.id, 5, True), (b.id, 1, True), (c.id, 1)])
    assert pins == [c.id]  # the unclaimed one only
    assert isinstance(results[0], CacheExhausted)  # b was not evicted for it
    assert results[1].session_id == b.id  # b took the free block
    assert isinstance(results[2], CacheExhausted)  # nothing left to evict: all held
    table.commit(results[1])
    for s in (a, b):
        table.release(s.id)
    assert table.get(b.id).num_tokens == 5 and table.get(a.id).num_tokens == 4
    assert a.in_use == b.in_use == c.in_use == 0  # c's pin went with the batch


def test_a_session_made_with_a_ttl_shorter_than_its_making_is_answered_then_expires():
    """create/fork answer with the session as made (made_stats), however short its TTL;
    the next call finds it expired, as any session idle past its TTL."""

    class Ticking(Clock):  # every reading a second later: each call takes longer than the TTL
        def __call__(self) -> float:
            self.now += 1.0
            return self.now

    table, _ = make(ttl_s=0.5, clock=Ticking())
    made = table.create("m")
    assert table.made_stats(made).session_id == made.id
    with pytest.raises(SessionNotFound, match="expired"):
        table.session_stats(made.id)
    parent = table.create("m", ttl_s=100.0)
    child = table.fork(parent.id, ttl_s=0.5)
    assert table.made_stats(child).num_tokens == 0
    with pytest.raises(SessionNotFound, match="expired"):
        table.get(child.id)
