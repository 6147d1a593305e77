"""KVCache with values_are_keys (a config whose values are its keys: MLA), against a cache
that keeps V apart written with the same K as V: K alone allocated and counted (half the bytes
a token, twice the blocks a budget), every write path storing K alone and refusing a V that
is not the K tensor (nothing written), every read returning K as both, the same tensor.
Their session records: tests/cache/test_record_layouts.py."""

from __future__ import annotations

import pytest
import torch

from mha_serve.cache import KVCache, slot_mapping
from mha_serve.model import AttentionConfig

KVH, D, BS, BLOCKS = 2, 4, 4, 8
BLOCK_BYTES = BS * KVH * D * 4  # one plane (K alone), float32


def pair(blocks: int = BLOCKS) -> tuple[KVCache, KVCache]:
    """(K alone, K and V apart), the same number of blocks."""
    shared = KVCache(
        num_kv_heads=KVH,
        head_dim=D,
        budget_bytes=blocks * BLOCK_BYTES,
        block_size=BS,
        values_are_keys=True,
    )
    apart = KVCache(
        num_kv_heads=KVH, head_dim=D, budget_bytes=blocks * 2 * BLOCK_BYTES, block_size=BS
    )
    assert shared.num_blocks == apart.num_blocks == blocks
    for c in (shared, apart):
        c.k.zero_()
        c.v.zero_()
    return shared, apart


def keys(B: int, T: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(B, KVH, T, D, generator=torch.Generator().manual_seed(seed))


def same_reads(shared: KVCache, apart: KVCache, table: list[int], n: int, start: int = 0) -> None:
    """shared reads (k, k), one tensor, equal to apart's K and V."""
    k, v = shared.read(table, n, start=start)
    want_k, want_v = apart.read(table, n, start=start)
    assert v is k
    assert torch.equal(k, want_k) and torch.equal(v, want_v)


def test_only_k_is_allocated_and_counted_a_budget_holds_twice_the_tokens():
    budget = 10**5 + 3
    shared = KVCache(num_kv_heads=KVH, head_dim=D, budget_bytes=budget, values_are_keys=True)
    apart = KVCache(num_kv_heads=KVH, head_dim=D, budget_bytes=budget)
    assert shared.bytes_per_token == KVH * D * 4 == apart.bytes_per_token // 2
    assert shared.bytes_per_block * 2 == apart.bytes_per_block
    assert shared.num_blocks == budget // shared.bytes_per_block
    assert shared.num_slots >= 2 * apart.num_slots
    assert shared.v is shared.k
    # one plane of storage, under the budget, less than a block left over
    assert shared.k.untyped_storage().nbytes() == shared.nbytes == shared.k.nbytes <= budget
    assert budget - shared.nbytes < shared.bytes_per_block


def test_from_config_sets_it_for_mla_alone():
    mla = AttentionConfig(
        48, 4, rope={}, mla={"kv_lora_rank": 24, "rope_dim": 8, "nope_dim": 12, "v_head_dim": 10}
    )
    cache = KVCache.from_config(mla, budget_bytes=2**16)
    assert cache.values_are_keys and cache.bytes_per_token == 32 * 4
    assert not KVCache.from_config(AttentionConfig(48, 4, 1), budget_bytes=2**16).values_are_keys


def test_a_budget_below_one_block_says_k_alone():
    with pytest.raises(ValueError, match="K alone: its values are its keys") as err:
        KVCache(
            num_kv_heads=KVH,
            head_dim=D,
            budget_bytes=BLOCK_BYTES - 1,
            block_size=BS,
            values_are_keys=True,
        )
    assert f"at least {BLOCK_BYTES} bytes" in str(err.value)
    with pytest.raises(ValueError, match="values_are_keys must be a bool"):
        KVCache(num_kv_heads=KVH, head_dim=D, budget_bytes=2**16, values_are_keys=1)


def test_every_write_path_stores_what_a_cache_of_k_and_v_holds():
    """write (padded), append (a lone run, and a padded batch: index copies), load, and a
    copy-on-write block copy: every read of the shared cache equals the apart one's."""
    shared, apart = pair()
    k = keys(2, 5, seed=1)
    mapping = slot_mapping([[4, 5, 6, 7, 8], [20, 21]], width=5)  # blocks 1-2, block 5
    for c in (shared, apart):
        c.write(k, k, mapping)
    same_reads(shared, apart, [1, 2], 5)
    same_reads(shared, apart, [5], 2)
    k1 = keys(1, 3, seed=2)
    for c in (shared, apart):
        c.append(k1, k1, [[9, 10, 11]])  # a lone consecutive run: slice copies
    same_reads(shared, apart, [1, 2], 8)
    kb = keys(2, 2, seed=3)
    for c in (shared, apart):
        c.append(kb, kb, [[12], [22, 23]])  # a padded batch: index copies
    same_reads(shared, apart, [1, 2, 3], 9)
    same_reads(shared, apart, [5], 4)
    every = keys(2, 1, seed=4)
    for c in (shared, apart):
        c.append(every, every, [[13], [24]])  # every row written: no row index
    same_reads(shared, apart, [1, 2, 3], 10)
    same_reads(shared, apart, [5, 6], 5)
    host = keys(1, 6, seed=5)[0]  # (KVH, 6, D): a restore of positions 4..9
    for c in (shared, apart):
        c.load([0, 7, 6], 1, 4, host, host)
    same_reads(shared, apart, [3, 0, 7, 6], 10, start=4)
    for c in (shared, apart):
        c.copy_block(1, 4)
    same_reads(shared, apart, [4, 2], 8)


def test_a_v_that_is_not_the_k_tensor_is_refused_and_nothing_is_written():
    """Equal values are not enough: a V of its own would be dropped, so every write path
    refuses it (before writing anything); a view of K's very memory is K."""
    shared, _ = pair()
    k = keys(1, 3, seed=6)
    calls = {
        "append (a lone run)": lambda v: shared.append(k, v, [[0, 1, 2]]),
        "append (a batch)": lambda v: shared.append(k.expand(2, -1, -1, -1), v, [[0], [4]]),
        "write": lambda v: shared.write(k, v, slot_mapping([[0, 1, 2]])),
        "load": lambda v: shared.load([0], 0, 0, k[0], v[0]),
    }
    for what, call in calls.items():
        v = k.clone()
        if what == "append (a batch)":
            v = v.expand(2, -1, -1, -1)
        with pytest.raises(ValueError, match="v must be the k tensor itself") as err:
            call(v)
        assert "would be dropped" in str(err.value), what
        assert not shared.k.any(), f"{what} wrote something before refusing"
    shared.append(k, k.view_as(k), [[0, 1, 2]])  # a view of the same memory: K itself
    got, _ = shared.read([0], 3)
    assert torch.equal(got, k)


def test_every_read_returns_k_as_both_the_same_tensor():
    """read (consecutive blocks: views; scattered: one copy), gather (in place and
    scattered rows), by_token, export: K and V the same tensor, equal to the apart cache's;
    step_views declines (its slot holds K's heads then V's)."""
    shared, apart = pair()
    k = keys(1, 12, seed=7)
    slots = [[4 + p for p in range(8)] + [28, 29, 30, 31]]  # blocks 1, 2, then 7
    for c in (shared, apart):
        c.append(k, k, slots)
    same_reads(shared, apart, [1, 2, 7], 12)  # scattered: a copy
    same_reads(shared, apart, [1, 2], 8, start=2)  # consecutive: views
    reads = [([1, 2, 7], 0, 12, 0), ([1, 2], 3, 8, 0)]
    got_k, got_v = shared.gather(reads, width=12)
    want_k, want_v = apart.gather(reads, width=12)
    assert got_v is got_k and torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    by_k, by_v = shared.by_token()
    assert by_v is by_k and torch.equal(by_k, apart.by_token()[1])
    ek, ev = shared.export([1, 2, 7], 12)
    assert ev is ek and ek.device.type == "cpu" and torch.equal(ek, apart.export([1, 2, 7], 12)[1])
    assert ek.untyped_storage().data_ptr() != shared.k.untyped_storage().data_ptr()
    assert shared.step_views([1, 2], 4 + 7, 8) is None
    assert apart.step_views([1, 2], 4 + 7, 8) is not None
