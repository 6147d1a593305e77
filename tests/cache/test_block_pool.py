"""BlockPool: all-or-nothing allocation, reference counts, never a referenced block handed out."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mha_serve.cache import BlockPool, CacheExhausted


def test_allocate_and_free():
    pool = BlockPool(4)
    assert (pool.num_free, pool.num_used) == (4, 0)
    a = pool.allocate(3)
    assert len(set(a)) == 3 and (pool.num_free, pool.num_used) == (1, 3)
    assert all(pool.refcount(i) == 1 for i in a)
    assert pool.allocate(0) == []
    assert pool.decref(a[:2]) == a[:2]
    assert (pool.num_free, pool.num_used) == (3, 1)


def test_allocate_is_all_or_nothing_with_numbers():
    pool = BlockPool(5)
    pool.allocate(3)
    with pytest.raises(CacheExhausted) as err:
        pool.allocate(3)
    assert "need 3" in str(err.value) and "2 of 5" in str(err.value)
    assert (err.value.num_needed, err.value.num_free, err.value.num_blocks) == (3, 2, 5)
    assert pool.num_free == 2, "a failed allocate must take nothing"


def test_shared_block_is_freed_at_last_reference():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.incref([b])
    assert pool.refcount(b) == 2
    assert pool.decref([b]) == []
    assert pool.num_used == 1
    assert pool.decref([b]) == [b]
    assert pool.num_used == 0 and pool.refcount(b) == 0


@pytest.mark.parametrize(
    ("action", "piece"),
    [
        (lambda p: p.decref([0]), "double free"),
        (lambda p: p.incref([1]), "free"),
        (lambda p: p.decref([7]), "0..2"),
        (lambda p: p.allocate(-1), ">= 0"),
        (lambda p: p.allocate(1, after=-1), "block id -1 is out of range 0..2"),
        (lambda p: p.allocate(1, after=3), "block id 3 is out of range 0..2"),
    ],
)
def test_misuse_is_refused(action, piece):
    pool = BlockPool(3)
    with pytest.raises(ValueError, match=piece):
        action(pool)
    assert pool.num_free == 3


def test_double_free_in_one_call_changes_nothing():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    with pytest.raises(ValueError, match="double free"):
        pool.decref([b, b])
    assert pool.refcount(b) == 1


def test_a_session_grows_in_place_and_new_runs_leave_room():
    pool = BlockPool(64)
    a = pool.allocate(4)
    assert a == [0, 1, 2, 3]  # the pool's first extent starts at block 0: no one grows into it
    b = pool.allocate(4)
    assert b == [32, 33, 34, 35]  # middle of the free extent 4..63: room for a and for b
    assert pool.allocate(3, after=a[-1]) == [4, 5, 6]
    assert pool.allocate(2, after=b[-1]) == [36, 37]


def test_growth_that_does_not_fit_in_place_goes_elsewhere_in_one_run():
    pool = BlockPool(16)
    a = pool.allocate(2)  # 0, 1
    fence = pool.allocate(1, after=a[-1])  # 2: a cannot grow in place
    grown = pool.allocate(3, after=a[-1])
    assert fence == [2] and grown == [grown[0], grown[0] + 1, grown[0] + 2]
    assert grown[0] > 2


def test_freed_blocks_merge_back_into_one_extent():
    pool = BlockPool(10)
    runs = [pool.allocate(n) for n in (3, 2, 4, 1)]
    assert pool.num_free == 0
    for run in (runs[1], runs[3], runs[0], runs[2]):
        pool.decref(run)
    assert pool.num_extents == 1 and pool.allocate(10) == list(range(10))


def test_an_allocation_is_split_only_when_no_extent_fits():
    pool = BlockPool(6)
    pool.allocate(2)  # 0, 1
    assert pool.allocate(2) == [3, 4]  # middle of 2..5
    assert sorted(pool.allocate(2)) == [2, 5]  # two extents of one block each
    assert pool.num_free == 0


def _check_extents(pool: BlockPool) -> None:
    """The free extents cover exactly the blocks with refcount 0, merged and in order."""
    free = []
    for start in pool._starts:
        free += range(start, start + pool._length[start])
    assert free == [i for i in range(pool.num_blocks) if pool.refcount(i) == 0]
    assert len(free) == pool.num_free
    ends = [s + pool._length[s] for s in pool._starts]
    assert not set(ends) & set(pool._starts), "two free extents touch: not merged"


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(["alloc", "grow", "incref", "decref"]), st.integers(0, 5)))
)
def test_never_hands_out_a_referenced_block(ops):
    pool = BlockPool(8)
    refs: dict[int, int] = {}  # the reference: block -> refcount
    for op, n in ops:
        if op in ("alloc", "grow"):
            if n > pool.num_free:
                with pytest.raises(CacheExhausted):
                    pool.allocate(n)
                continue
            after = max(refs) if op == "grow" and refs else None
            ids = pool.allocate(n, after=after)
            assert not set(ids) & set(refs), "allocated a block still referenced"
            refs.update(dict.fromkeys(ids, 1))
        elif refs:
            b = sorted(refs)[n % len(refs)]
            if op == "incref":
                pool.incref([b])
                refs[b] += 1
            else:
                pool.decref([b])
                refs[b] -= 1
                if refs[b] == 0:
                    del refs[b]
        assert pool.num_used == len(refs)
        assert all(pool.refcount(b) == r for b, r in refs.items())
        _check_extents(pool)
