"""KVCache: sizing from a byte budget, write/append through slot mappings, read, block copies."""

import pytest
import torch

from mha_serve.cache import PAD_SLOT, KVCache, slot_mapping
from mha_serve.cache.kv_cache import _consecutive
from mha_serve.model import AttentionConfig

KVH, D, BS = 2, 4, 4
BYTES_PER_BLOCK = 2 * BS * KVH * D * 4  # float32


def make(num_blocks=8, dtype=torch.float32):
    itemsize = torch.empty((), dtype=dtype).element_size()
    budget = num_blocks * 2 * BS * KVH * D * itemsize
    return KVCache(num_kv_heads=KVH, head_dim=D, budget_bytes=budget, block_size=BS, dtype=dtype)


@pytest.mark.parametrize("budget", [BYTES_PER_BLOCK, BYTES_PER_BLOCK * 5 + 1, 10**6 + 7])
def test_sized_from_budget_and_never_over_it(budget):
    kv = KVCache(num_kv_heads=KVH, head_dim=D, budget_bytes=budget, block_size=BS)
    assert kv.bytes_per_block == BYTES_PER_BLOCK
    assert kv.num_blocks == budget // BYTES_PER_BLOCK
    assert kv.k.shape == (KVH, kv.num_blocks, BS, D) == kv.v.shape
    assert kv.nbytes == kv.k.nbytes + kv.v.nbytes <= budget
    assert budget - kv.nbytes < BYTES_PER_BLOCK


def test_budget_below_one_block_names_the_minimum():
    with pytest.raises(ValueError) as err:
        KVCache(num_kv_heads=KVH, head_dim=D, budget_bytes=BYTES_PER_BLOCK - 1, block_size=BS)
    msg = str(err.value)
    assert f"{BYTES_PER_BLOCK - 1} bytes" in msg and f"at least {BYTES_PER_BLOCK} bytes" in msg


def test_bytes_per_token_proportional_to_num_kv_heads():
    per = {
        kvh: KVCache.from_config(
            AttentionConfig(512, 8, kvh), budget_bytes=2**24, dtype=torch.bfloat16
        ).bytes_per_token
        for kvh in (8, 2, 1)
    }
    assert per[8] == 2 * 8 * 64 * 2  # K and V x heads x head_dim x bf16
    assert per[8] == 4 * per[2] == 8 * per[1]


def test_default_block_size():
    assert KVCache(num_kv_heads=1, head_dim=8, budget_bytes=2**16).block_size == 16


def test_write_then_read_roundtrip_with_padding():
    kv = make()
    kv.k.zero_()  # storage starts uninitialised; zero it to see what write() touched
    kv.v.zero_()
    torch.manual_seed(0)
    # session 0: blocks [5, 2], 6 tokens; session 1: block [7], 3 tokens
    tables, lengths = [[5, 2], [7]], [6, 3]
    slots = [
        [5 * BS + p if p < BS else 2 * BS + p - BS for p in range(6)],
        [7 * BS + p for p in range(3)],
    ]
    k = torch.randn(2, KVH, 6, D)
    v = torch.randn(2, KVH, 6, D)
    kv.write(k, v, slot_mapping(slots))
    for b, (table, n) in enumerate(zip(tables, lengths, strict=True)):
        rk, rv = kv.read(table, n)
        assert rk.shape == rv.shape == (1, KVH, n, D)
        assert torch.equal(rk[0], k[b, :, :n]) and torch.equal(rv[0], v[b, :, :n])
    # padded tokens (slot -1) were not written anywhere
    used = {s // BS for row in slots for s in row}
    others = [b for b in range(kv.num_blocks) if b not in used]
    assert torch.all(kv.k[:, others] == 0) and torch.all(kv.v[:, others] == 0)


@pytest.mark.parametrize(
    "slots",
    [
        [[9, 10, 11]],  # one sequence, consecutive slots: the slice-copy path
        [[9]],  # a decode token
        [[3, 4, 8]],  # one sequence across non-adjacent blocks: the index path
        [[9, 10], [20]],  # a batch, the second sequence padded
        [[9], [20], [3]],  # a batch of decode tokens: every row written, no rows listed
        [[9, 10], [21, 22]],  # a batch of equal steps
    ],
)
def test_append_stores_what_write_stores(slots):
    T = max(len(s) for s in slots)
    k = torch.randn(len(slots), KVH, T, D)
    v = torch.randn(len(slots), KVH, T, D)
    fast, reference = make(), make()
    for kv in (fast, reference):
        kv.k.zero_()
        kv.v.zero_()
    fast.append(k, v, slots)
    reference.write(k, v, slot_mapping(slots, T))
    assert torch.equal(fast.k, reference.k) and torch.equal(fast.v, reference.v)
    assert fast.k.count_nonzero() > 0


@pytest.mark.parametrize(
    ("call", "piece"),
    [
        (
            lambda kv: kv.append(torch.zeros(1, KVH, 2, D), torch.zeros(1, KVH, 2, D), [[31, 32]]),
            "outside 0..31",
        ),
        (
            lambda kv: kv.append(torch.zeros(1, 3, 1, D), torch.zeros(1, 3, 1, D), [[0]]),
            "(1, 2, 1, 4)",
        ),
        (
            lambda kv: kv.append(
                torch.zeros(1, KVH, 1, D), torch.zeros(1, KVH, 1, D, dtype=torch.float64), [[0]]
            ),
            "float64",
        ),
    ],
)
def test_append_misuse_is_explained_and_writes_nothing(call, piece):
    kv = make()
    kv.k.zero_()
    kv.v.zero_()
    with pytest.raises(ValueError) as err:
        call(kv)
    assert piece in str(err.value), f"{piece!r} not in {str(err.value)!r}"
    assert kv.k.count_nonzero() == 0 and kv.v.count_nonzero() == 0


@pytest.mark.parametrize("table", [[2, 3, 4], [5, 1, 6]], ids=["consecutive", "scattered"])
def test_read_returns_a_sessions_positions_in_place_when_its_blocks_are_consecutive(table):
    kv = make()
    kv.k.normal_()
    kv.v.normal_()
    length = 2 * BS + 1  # into the third block
    k, v = kv.read(table, length)
    assert k.shape == v.shape == (1, KVH, length, D)
    want = torch.cat([kv.k[:, b] for b in table], dim=1)[:, :length]  # (KVH, len, D)
    assert torch.equal(k[0], want)
    in_place = k.untyped_storage().data_ptr() == kv.k.untyped_storage().data_ptr()
    assert in_place == (table == [2, 3, 4]), "views for consecutive blocks, a copy otherwise"


@pytest.mark.parametrize(("start", "length"), [(0, 1), (1, 3), (3, 2 * BS + 1), (BS, 3 * BS)])
def test_read_in_place_is_the_narrow_of_the_slots(start, length):
    """read() of consecutive blocks makes its views in one as_strided each: the very views
    narrow() makes of the cache's slots (shape, strides, offset, values)."""
    kv = make()
    kv.k.normal_()
    kv.v.normal_()
    table = [2, 3, 4]
    k, v = kv.read(table, length, start=start)
    first, n = table[0] * BS + start, length - start
    slots = kv.num_blocks * BS
    for got, cache in ((k, kv.k), (v, kv.v)):
        want = cache.view(1, KVH, slots, D).narrow(2, first, n)
        assert got.shape == want.shape and got.stride() == want.stride()
        assert got.storage_offset() == want.storage_offset() and torch.equal(got, want)


@pytest.mark.parametrize(
    "ids", [[], [4], [4, 5], [4, 6], [5, 4], [1, 2, 3], [1, 2, 4], [1, 3, 3], (7, 8, 9, 10)]
)
def test_consecutive_is_its_plain_definition(ids):
    assert _consecutive(ids) == all(b == ids[0] + i for i, b in enumerate(ids))


@pytest.mark.parametrize("table", [[], [3]])
def test_read_of_empty_past(table):
    k, v = make().read(table, 0)
    assert k.shape == v.shape == (1, KVH, 0, D)


def test_copy_block():
    kv = make()
    kv.k[:, 1].normal_()
    kv.v[:, 1].normal_()
    kv.copy_block(1, 6)
    assert torch.equal(kv.k[:, 6], kv.k[:, 1]) and torch.equal(kv.v[:, 6], kv.v[:, 1])


def test_slot_mapping_pads():
    assert slot_mapping([[4, 5], [9]]).tolist() == [[4, 5], [9, PAD_SLOT]]
    assert slot_mapping([[1]], width=3).tolist() == [[1, PAD_SLOT, PAD_SLOT]]


@pytest.mark.parametrize(
    ("call", "piece"),
    [
        (
            lambda kv: kv.write(
                torch.zeros(1, KVH, 2, D), torch.zeros(1, KVH, 2, D), torch.tensor([[0, 99]])
            ),
            "outside 0..31",
        ),
        (
            lambda kv: kv.write(
                torch.zeros(1, 3, 2, D), torch.zeros(1, 3, 2, D), torch.tensor([[0, 1]])
            ),
            "(1, 2, 2, 4)",
        ),
        (
            lambda kv: kv.write(
                torch.zeros(1, KVH, 1, D, dtype=torch.float64),
                torch.zeros(1, KVH, 1, D),
                torch.tensor([[0]]),
            ),
            "float64",
        ),
        (lambda kv: kv.read([1], 5), "5 tokens need 2 block(s)"),
        (lambda kv: kv.copy_block(0, 8), "0..7"),
    ],
)
def test_misuse_names_the_numbers(call, piece):
    with pytest.raises(ValueError) as err:
        call(make())
    assert piece in str(err.value), f"{piece!r} not in {str(err.value)!r}"


def test_gather_pads_each_read_with_its_own_last_key():
    """gather equals read row by row (consecutive and scattered blocks, a sliding window's
    later start), and each row's padding repeats its own last key and value: finite, never
    another session's nor an unwritten slot."""
    kv = make(num_blocks=12)
    kv.k.copy_(torch.randn(kv.k.shape))
    kv.v.copy_(torch.randn(kv.v.shape))
    reads = [
        ([2, 3, 4], 0, 11, 0),  # consecutive, from position 0
        ([9, 0, 7], 1, 10, 0),  # scattered, from position 1
        ([5, 6], 9, 15, 2),  # a window's session: blocks from logical block 2, read from 9
        ([11], 4, 5, 1),  # one key
    ]
    width = 13
    k, v = kv.gather(reads, width)
    assert k.shape == v.shape == (4, KVH, width, D) and k.is_contiguous()
    for b, (table, start, length, first_block) in enumerate(reads):
        rk, rv = kv.read(table, length, start=start, first_block=first_block)  # (1, KVH, n, D)
        n = length - start
        assert torch.equal(k[b, :, :n], rk[0]) and torch.equal(v[b, :, :n], rv[0]), f"row {b}"
        pad_k, pad_v = k[b, :, n:], v[b, :, n:]  # (KVH, width - n, D)
        assert torch.equal(pad_k, rk[0, :, -1:].expand_as(pad_k)), f"row {b}: padding"
        assert torch.equal(pad_v, rv[0, :, -1:].expand_as(pad_v)), f"row {b}: padding"


def test_gather_reuses_its_buffers_and_names_bad_reads():
    kv = make(num_blocks=4)
    kv.k.normal_()
    kv.v.normal_()
    big = kv.gather([([0, 1], 0, 8, 0), ([2, 3], 0, 8, 0)], 8)[0]
    small = kv.gather([([1], 0, 3, 0)], 4)[0]
    assert small.data_ptr() == big.data_ptr(), "one buffer per thread, grown only when short"
    with pytest.raises(ValueError, match=r"read 0: positions 0\.\.8 .* width 4"):
        kv.gather([([0, 1], 0, 9, 0)], 4)
    with pytest.raises(ValueError, match="read 1: positions 0..4"):
        kv.gather([([0], 0, 2, 0), ([0], 0, 5, 0)], 8)
