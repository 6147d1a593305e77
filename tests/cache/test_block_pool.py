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
    ],
)
def test_misuse_is_refused(action, piece):
    pool = BlockPool(3)
    with pytest.raises(ValueError, match=piece):
        action(pool)


def test_double_free_in_one_call_changes_nothing():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    with pytest.raises(ValueError, match="double free"):
        pool.decref([b, b])
    assert pool.refcount(b) == 1


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "incref", "decref"]), st.integers(0, 5))))
def test_never_hands_out_a_referenced_block(ops):
    pool = BlockPool(8)
    refs: dict[int, int] = {}  # the reference: block -> refcount
    for op, n in ops:
        if op == "alloc":
            if n > pool.num_free:
                with pytest.raises(CacheExhausted):
                    pool.allocate(n)
                continue
            ids = pool.allocate(n)
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
