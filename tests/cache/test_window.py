"""A sliding-window model's sessions keep only what a future step can still attend to:
blocks wholly before the next step's window are freed (and counted), at any length, past
the pool's own size; reads start where the window does and return the right positions;
forks keep what they share; truncation back inside what is held works, back past it is
refused naming the lengths that work; rollbacks and closes give every block back."""

from __future__ import annotations

import pytest
import torch

from mha_serve.cache import InvalidSessionArgument, KVCache, SessionFull, SessionTable
from mha_serve.cache.window import first_needed_block, read_start, shortest_truncate

BS = 4  # tokens per block
W = 6  # the window: a query sees itself and the 5 keys before it


def make(num_blocks=8, window=W):
    kv = KVCache(num_kv_heads=1, head_dim=2, budget_bytes=num_blocks * BS * 16, block_size=BS)
    table = SessionTable()
    table.add_model("m", kv, window=window)
    return table, kv


def step(table, kv, sid, n):
    """Appends n tokens whose K and V are their positions (k = (p, p), v = (-p, -p)), and
    returns the step's read (K, V) from its reservation, as the engine reads it."""
    res = table.reserve(sid, n)
    pos = torch.arange(res.start, res.start + n, dtype=torch.float32)
    k = pos[None, None, :, None].expand(1, 1, n, 2)
    kv.append(k, -k, [res.slots])
    read = kv.read(
        res.block_table, res.start + n, start=res.read_start, first_block=res.first_block
    )
    table.commit(res)
    return res, read


def held(num_tokens):
    """Blocks a session of num_tokens tokens holds: from its next step's window on."""
    return -(-num_tokens // BS) - first_needed_block(num_tokens, W, BS)


def test_a_session_past_its_window_holds_only_the_blocks_the_window_needs():
    """Decode 60 tokens one by one in a pool of 8 blocks (32 tokens): the session holds at
    most ceil((W - 1) / BS) + 1 blocks at any length, every freed block is counted, and each
    step reads exactly its window's positions."""
    table, kv = make()
    s = table.create("m")
    for total in range(1, 61):
        res, (k, v) = step(table, kv, s.id, 1)
        start = read_start(total - 1, W)
        assert res.read_start == start
        assert k[0, 0, :, 0].tolist() == list(range(start, total)), f"read at {total}"
        assert v[0, 0, :, 0].tolist() == [-p for p in range(start, total)]
        assert s.num_blocks == held(total) <= -(-(W - 1) // BS) + 1
        stats = table.stats()["m"]
        assert stats.num_blocks_used == s.num_blocks
        allocated = -(-total // BS)
        assert stats.num_blocks_out_of_window == allocated - held(total)
        assert table.session_stats(s.id).first_position == s.first_block * BS
    assert s.num_tokens == 60 > 8 * BS, "longer than the whole pool holds"
    table.close(s.id)
    assert table.pool("m").num_used == 0


@pytest.mark.parametrize("sizes", [[9, 1, 1, 7, 1, 13], [3] * 12, [17, 2, 20]])
def test_chunked_steps_read_their_window_and_free_the_rest(sizes):
    table, kv = make(num_blocks=16)
    s = table.create("m")
    total = 0
    for n in sizes:
        res, (k, _) = step(table, kv, s.id, n)
        assert k[0, 0, :, 0].tolist() == list(range(read_start(total, W), total + n))
        total += n
        assert s.num_blocks == held(total)


def test_a_step_larger_than_the_pool_is_full_but_a_long_session_is_not():
    table, kv = make(num_blocks=4)  # 16 tokens
    s = table.create("m")
    for _ in range(10):
        step(table, kv, s.id, 5)  # 50 tokens, in steps the pool holds with the window
    with pytest.raises(SessionFull, match="all that the KV cache of model 'm' holds"):
        table.reserve(s.id, 20)  # its blocks from the window on, and 20 more: 6 blocks
    assert table.session_stats(s.id).num_tokens == 50


def test_a_fork_keeps_the_blocks_it_shares_while_its_parent_slides():
    table, kv = make(num_blocks=16)
    parent = table.create("m")
    step(table, kv, parent.id, 10)
    child = table.fork(parent.id)
    assert child.first_block == parent.first_block and child.block_table == parent.block_table
    shared = list(child.block_table)
    before = table.stats()["m"].num_blocks_out_of_window
    for _ in range(12):
        step(table, kv, parent.id, 1)
    # the parent dropped the shared blocks; the child holds them, so none was freed
    assert not set(shared) & set(parent.block_table)
    assert all(table.pool("m").refcount(b) == 1 for b in shared)
    freed = table.stats()["m"].num_blocks_out_of_window - before
    # the parent's own blocks became free: its copy of the partial block 2 (positions 8..11,
    # copied on its first write after the fork) and block 3; the shared block 1 did not
    assert freed == 2
    _, (k, _) = step(table, kv, child.id, 1)  # the child still reads its own past
    assert k[0, 0, :, 0].tolist() == list(range(5, 11))
    assert child.num_blocks == held(11)


def test_truncate_back_inside_what_is_held_and_refused_past_it():
    table, kv = make(num_blocks=16)
    s = table.create("m")
    step(table, kv, s.id, 30)  # keeps positions 24.. (next window 25..30): block 6 on
    assert s.first_block == first_needed_block(30, W, BS) == 6
    shortest = shortest_truncate(s.first_block, W, BS)
    assert shortest == 24 + W - 1 == 29
    with pytest.raises(InvalidSessionArgument) as err:
        table.truncate(s.id, 28)
    message = str(err.value)
    assert "before position 24" in message and "to 0 or to 29..30 tokens" in message
    assert s.num_tokens == 30, "a refused truncate changes nothing"
    table.truncate(s.id, 29)
    _, (k, _) = step(table, kv, s.id, 2)  # tokens 29 and 30 (new values at 29)
    assert k[0, 0, :, 0].tolist() == list(range(24, 31))
    table.truncate(s.id, 0)  # always possible: nothing to see
    assert (s.num_tokens, s.first_block, s.num_blocks) == (0, 0, 0)
    _, (k, _) = step(table, kv, s.id, 3)
    assert k[0, 0, :, 0].tolist() == [0, 1, 2]


def test_rollback_after_sliding_and_close_give_every_block_back():
    table, kv = make()
    s = table.create("m")
    step(table, kv, s.id, 13)
    res = table.reserve(s.id, 7)
    table.rollback(res)
    assert s.num_tokens == 13 and s.num_blocks == held(13)
    table.close(s.id)
    assert table.pool("m").num_used == 0


def test_without_a_window_nothing_is_freed():
    table, kv = make(window=None)
    s = table.create("m")
    for _ in range(6):
        step(table, kv, s.id, 4)
    assert s.first_block == 0 and s.num_blocks == 6
    assert table.stats()["m"].num_blocks_out_of_window == 0
    assert shortest_truncate(0, None, BS) == 1
