"""Paged K/V tensors of one model, sized from a budget in bytes; addressed by block id.

Layout (one model, all sessions):
    k, v: (KVH, num_blocks, block_size, D)    device of the model; dtype the model's, or
                                              narrower (the model's kv_cache_dtype)
With values_are_keys (a config whose values are its keys: MLA's k' = [rope; c]) only k is
allocated and v is k: half the bytes a token, every write stores K alone (and refuses a V
that is not that K), every read returns the one tensor as both (k, k).
A token's slot is block_id * block_size + offset; viewed flat, k is (KVH, num_slots, D).
Head-major so that a run of consecutive slots is, per head, one contiguous (P, D) matrix:
attention reads a session with consecutive blocks in place, at full speed.
Which blocks belong to which session is the session table's business, not this one's.
Writes, export, load and block copies are here; the reads (read, step_views, gather) in
reads.py.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from itertools import chain

import torch

from mha_serve.transfer import list_tensor

from .reads import Reading, _consecutive

DEFAULT_BLOCK_SIZE = 16  # tokens per block: 1/16 worst-case waste per session, few table entries
PAD_SLOT = -1  # slot mapping entry for a padded token: nothing is written


class KVCache(Reading):
    def __init__(
        self,
        *,
        num_kv_heads: int,
        head_dim: int,
        budget_bytes: int,
        block_size: int = DEFAULT_BLOCK_SIZE,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        values_are_keys: bool = False,
    ) -> None:
        if not isinstance(values_are_keys, bool):
            raise ValueError(f"values_are_keys must be a bool, got {values_are_keys!r}")
        for name, value in (
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("block_size", block_size),
            ("budget_bytes", budget_bytes),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.budget_bytes = budget_bytes
        self.dtype = dtype
        self.values_are_keys = values_are_keys
        itemsize = torch.empty((), dtype=dtype).element_size()
        # Planes a token fills: K and V, or K alone when the values are the keys (v is k).
        planes = 1 if values_are_keys else 2
        # Exactly proportional to num_kv_heads: MQA holds 1/H of MHA's.
        self.bytes_per_token = planes * num_kv_heads * head_dim * itemsize
        self.bytes_per_block = block_size * self.bytes_per_token
        self.num_blocks = budget_bytes // self.bytes_per_block
        if self.num_blocks < 1:
            what = "K alone: its values are its keys" if values_are_keys else "2: K and V"
            raise ValueError(
                f"KV cache budget {budget_bytes} bytes holds no block: one block is "
                f"{self.bytes_per_block} bytes ({what}, x block_size {block_size} x "
                f"num_kv_heads {num_kv_heads} x head_dim {head_dim} x {itemsize} bytes of "
                f"{dtype}); set the budget to at least {self.bytes_per_block} bytes"
            )
        shape = (num_kv_heads, self.num_blocks, block_size, head_dim)
        # Empty, not zeros: on the CPU untouched pages cost no memory until sessions use
        # them. A read never reaches a slot that was not written (read() stops at the
        # session's length).
        # K and V in one allocation, K's heads then V's: the new token's K and V of a lone
        # decode step are then one copy, and the session's K/V one view (step_views).
        # Values that are the keys: K's plane alone, and v the same tensor as k.
        kv = torch.empty((planes, *shape), dtype=dtype, device=device)
        self.k = kv[0]  # (each contiguous)
        self.v = self.k if values_are_keys else kv[1]
        # The same memory by slot, batch axis first: a session read is one view of each, one
        # as_strided (read() runs once per session per step, so its few torch calls add up).
        slots = self.num_blocks * block_size
        self._k_slots = self.k.view(1, num_kv_heads, slots, head_dim)
        self._v_slots = self.v.view(1, num_kv_heads, slots, head_dim)
        self._kv_slots = kv.view(1, planes * num_kv_heads, slots, head_dim)  # K's heads, V's
        # step_views' views of it, each one as_strided (a narrow is three dispatches)
        self._strides = self._kv_slots.stride()
        self._slot_strides = self._k_slots.stride()  # read()'s views (a narrow's strides)
        self._k_at = self._kv_slots.storage_offset()  # position 0 of K's first head
        # and of V's (K's own when the values are the keys)
        self._v_at = self._k_at + (planes - 1) * num_kv_heads * slots * head_dim
        # gather()'s output buffers, one pair per thread that gathers (the compute thread and
        # the event loop's may both run steps): kept, because on the CPU a fresh buffer of a
        # batch's K/V costs more in page faults than the copy itself (32 ms against 6 ms for
        # 16 MiB, 2-core CPU).
        self._scratch = threading.local()

    @classmethod
    def from_config(
        cls,
        config,  # AttentionConfig; untyped so the cache never imports the model
        *,
        budget_bytes: int,
        block_size: int = DEFAULT_BLOCK_SIZE,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> KVCache:
        return cls(
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            budget_bytes=budget_bytes,
            block_size=block_size,
            dtype=dtype,
            device=device,
            values_are_keys=config.values_are_keys,
        )

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        """Bytes the K and V tensors hold (K's alone when v is k); never more than
        budget_bytes."""
        return self.k.nbytes if self.values_are_keys else self.k.nbytes + self.v.nbytes

    def write(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store new K/V for a batch: k, v (B, KVH, T, D) as `project` returns them (v the
        k tensor itself where the values are the keys); slot_mapping (B, T) int64, PAD_SLOT
        (-1) at padded tokens (not written)."""
        KVH, D = self.num_kv_heads, self.head_dim
        B, T = slot_mapping.shape
        self._check_new(k, v, B, T, f"slot_mapping {tuple(slot_mapping.shape)}")
        slots = slot_mapping.to(self.device, torch.int64).reshape(B * T)  # (B*T,)
        keep = slots != PAD_SLOT
        slots = slots[keep]  # (N,)
        if slots.numel():
            self._check_slots(int(slots.min()), int(slots.max()))
        k_rows = k.transpose(0, 1).reshape(KVH, B * T, D)[:, keep]  # (KVH, N, D)
        self.k.view(KVH, self.num_slots, D).index_copy_(1, slots, k_rows.to(self.device))
        if not self.values_are_keys:
            v_rows = v.transpose(0, 1).reshape(KVH, B * T, D)[:, keep]  # (KVH, N, D)
            self.v.view(KVH, self.num_slots, D).index_copy_(1, slots, v_rows.to(self.device))

    def append(self, k: torch.Tensor, v: torch.Tensor, slots: Sequence[Sequence[int]]) -> None:
        """Store one step's new K/V: k, v (B, KVH, T, D) as `project` returns them (v the k
        tensor itself where the values are the keys); sequence b's first len(slots[b])
        tokens go to slots[b], later ones are padding (not written).

        A lone sequence whose slots are consecutive (every decode step, and any append
        inside its session's blocks) is two slice copies (one: K alone), no index tensors.
        """
        T = k.shape[2]
        if len(slots) == 1:
            run = slots[0]
            n = len(run)
            first = run[0] if n else -1
            if (
                0 < n <= T
                and first >= 0
                and run[-1] < self.num_slots
                and (n == 1 or _consecutive(run))
                and k.shape == v.shape == (1, self.num_kv_heads, T, self.head_dim)
                and k.dtype == v.dtype == self.dtype
                and (v is k or not self.values_are_keys)  # (else _check_new says why)
            ):
                # narrow: one view op each side (a slice is two), a copy each
                self._k_slots.narrow(2, first, n).copy_(k if n == T else k.narrow(2, 0, n))
                if not self.values_are_keys:
                    self._v_slots.narrow(2, first, n).copy_(v if n == T else v.narrow(2, 0, n))
                return
        self._append_rows(k, v, slots)

    def _append_rows(
        self, k: torch.Tensor, v: torch.Tensor, slots: Sequence[Sequence[int]]
    ) -> None:
        """append of a batch: write()'s checks made on the host lists and one index tensor
        sent to the device, so that it never waits for the device (write() reads its slots'
        range back and selects the real tokens by a mask: a sync for each on CUDA)."""
        KVH, D, T = self.num_kv_heads, self.head_dim, k.shape[2]
        B = len(slots)
        self._check_new(k, v, B, T, f"{B} slot list(s) of at most {T}")
        counts = list(map(len, slots))
        # No padded token (decode steps, equal steps): every row of k is written, in order.
        every = bool(counts) and min(counts) == T == max(counts)
        if every:
            flat = list(chain.from_iterable(slots))  # the real tokens' cache slots
        else:
            flat, rows = [], []  # and their rows b * T + t in k
            for b, s in enumerate(slots):
                if len(s) > T:
                    raise ValueError(f"session {b} has {len(s)} slots but width is {T}")
                flat.extend(s)
                rows.extend(range(b * T, b * T + len(s)))
        if not flat:
            return
        self._check_slots(min(flat), max(flat))
        index = list_tensor(flat if every else [flat, rows], self.device)  # (N,) | (2, N)
        slot_index = index if every else index[0]
        planes = ((self.k, k),) if self.values_are_keys else ((self.k, k), (self.v, v))
        for store, new in planes:
            rows = new.transpose(0, 1).reshape(KVH, B * T, D)  # (KVH, B*T, D)
            if not every:
                rows = rows.index_select(1, index[1])  # (KVH, N, D)
            store.view(KVH, self.num_slots, D).index_copy_(1, slot_index, rows)

    def _check_new(self, k: torch.Tensor, v: torch.Tensor, B: int, T: int, what: str) -> None:
        KVH, D = self.num_kv_heads, self.head_dim
        for name, t in (("k", k), ("v", v)):
            if t.shape != (B, KVH, T, D):
                raise ValueError(
                    f"{name} must be (B, KVH, T, D) = ({B}, {KVH}, {T}, {D}) to match "
                    f"{what}, got {tuple(t.shape)}"
                )
            if t.dtype != self.dtype:
                raise ValueError(f"{name} has dtype {t.dtype} but the cache holds {self.dtype}")
        if self.values_are_keys and not same_tensor(k, v):
            raise ValueError(
                "this cache stores K alone (the model's values are its keys), so v must be "
                "the k tensor itself; a v of its own would be dropped, not stored"
            )

    def _check_slots(self, lo: int, hi: int) -> None:
        if lo < 0 or hi >= self.num_slots:
            raise ValueError(
                f"slot_mapping has slots in [{lo}, {hi}] "
                f"outside 0..{self.num_slots - 1} (or {PAD_SLOT} for padding)"
            )

    def export(
        self, block_table: Sequence[int], num_tokens: int, first_block: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A session's K and V as it holds them, positions first_block * block_size ..
        num_tokens - 1: host copies (KVH, n, D) that outlive its blocks (a spill); one
        copy, returned as both, where the values are the keys."""
        start = first_block * self.block_size
        k, v = self.read(block_table, num_tokens, start=start, first_block=first_block)
        k = k[0].to("cpu", copy=True).contiguous()
        return (k, k) if self.values_are_keys else (k, v[0].to("cpu", copy=True).contiguous())

    def load(
        self,
        block_ids: Sequence[int],
        first_block: int,
        first_position: int,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """Writes K and V (KVH, n, D) of positions first_position .. into a session's blocks:
        block_ids[i] is its logical block first_block + i (a restore). v is k where the
        values are the keys."""
        n, bs = k.shape[1], self.block_size
        if n == 0:
            return
        slots = [
            block_ids[p // bs - first_block] * bs + p % bs
            for p in range(first_position, first_position + n)
        ]
        mapping = torch.tensor([slots], dtype=torch.int64)  # (1, n)
        k_new = k.unsqueeze(0).to(self.device)  # (1, KVH, n, D)
        v_new = k_new if self.values_are_keys and same_tensor(k, v) else v.unsqueeze(0)
        self.write(k_new, v_new.to(self.device), mapping)

    def copy_block(self, src: int, dst: int) -> None:
        """Copy-on-write: dst gets src's K and V (all block_size slots)."""
        for i in (src, dst):
            if not 0 <= i < self.num_blocks:
                raise ValueError(f"block id {i} is out of range 0..{self.num_blocks - 1}")
        self.k[:, dst].copy_(self.k[:, src])
        if not self.values_are_keys:
            self.v[:, dst].copy_(self.v[:, src])


def same_tensor(k: torch.Tensor, v: torch.Tensor) -> bool:
    """v is k, or a view of the very same elements (no value compared: no device sync)."""
    return v is k or (
        v.data_ptr() == k.data_ptr()
        and v.shape == k.shape
        and v.stride() == k.stride()
        and v.dtype == k.dtype
        and v.device == k.device
    )


def slot_mapping(slots: Sequence[Sequence[int]], width: int | None = None) -> torch.Tensor:
    """(B, T) int64 from one slot list per session, padded with PAD_SLOT to width
    (default: the longest list), ready for KVCache.write."""
    B = len(slots)
    T = max((len(s) for s in slots), default=0) if width is None else width
    for b, s in enumerate(slots):
        if len(s) > T:
            raise ValueError(f"session {b} has {len(s)} slots but width is {T}")
    rows = [list(s) + [PAD_SLOT] * (T - len(s)) for s in slots]
    return torch.tensor(rows, dtype=torch.int64).view(B, T)  # (B, T)
