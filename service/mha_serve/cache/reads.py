"""How KVCache reads the sessions it holds: one session's K and V, in place when its blocks
are consecutive (read, step_views), the whole cache token-major (by_token), where reads lie
(runs), and several sessions' K and V padded into one batch (gather). Part of KVCache
(kv_cache.py), kept in a file of its own; its state (the tensors, their views and strides,
the gather buffers) is KVCache's. Where the values are the keys (values_are_keys: v is k),
every read returns K as both, the same tensor: read, gather and by_token read K once, and
step_views, whose slot holds K then V, declines."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mha_serve.transfer import list_tensor


class Reading:
    """KVCache's reads (mixed into it; its state is the cache's)."""

    def read(
        self,
        block_table: Sequence[int],
        length: int,
        *,
        start: int = 0,
        first_block: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One session's K and V at positions start..length-1, (1, KVH, length - start, D)
        each, where block_table[i] holds positions (first_block + i) * block_size onwards
        (a sliding-window session's earlier blocks are gone): views into the cache (read
        them, never write) when those blocks are consecutive, as a session's usually are;
        else one copy of them. (k, k), one tensor, where the values are the keys."""
        KVH, D, bs = self.num_kv_heads, self.head_dim, self.block_size
        lo = start // bs - first_block  # block_table index of the block holding `start`
        hi = -(-length // bs) - first_block  # one past the block holding length - 1
        if not 0 <= start <= length or lo < 0 or len(block_table) < hi:
            raise ValueError(
                f"the session has {len(block_table)} block(s) from position "
                f"{first_block * bs}; positions {start}..{length - 1}: {length - start} tokens "
                f"need {hi - lo} block(s) of {bs}, from its block {first_block + lo}"
            )
        ids = block_table[lo:hi] if start < length else []
        offset, n = start % bs, length - start
        if _consecutive(ids):
            # narrow(2, first, n) of _k_slots and _v_slots, each as one as_strided
            at = (ids[0] * bs + offset) * D if ids else 0
            shape, strides = (1, KVH, n, D), self._slot_strides
            k = self._k_slots.as_strided(shape, strides, self._k_at + at)  # (1, KVH, n, D)
            if self.values_are_keys:
                return k, k
            v = self._v_slots.as_strided(shape, strides, self._v_at + at)
            return k, v
        table = torch.tensor(list(ids), dtype=torch.int64, device=self.device)
        k = self.k.index_select(1, table).view(KVH, len(ids) * bs, D)[:, offset : offset + n]
        k = k.unsqueeze(0)  # (1, KVH, n, D)
        if self.values_are_keys:
            return k, k
        v = self.v.index_select(1, table).view(KVH, len(ids) * bs, D)[:, offset : offset + n]
        return k, v.unsqueeze(0)

    def step_views(
        self, block_table: Sequence[int], slot: int, length: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """A lone one-token step's views of the cache, no copy: the new token's K and V
        slot (1, 2 KVH, 1, D), K's heads then V's, to write in one copy, and the session's K
        and V at positions 0..length-1 (1, KVH, length, D) each, to read once written (as
        read() returns them), where block_table holds positions 0.. in consecutive blocks
        and `slot` is position length - 1's (what append() and read() do for such a step,
        in three view ops). None otherwise, nothing done: append() and read() then; always
        where the values are the keys (the cache holds no V's heads to write)."""
        if self.values_are_keys:
            return None
        bs = self.block_size
        needed = -(-length // bs)
        ids = block_table[:needed]
        first = ids[0] * bs if ids else -1
        if length < 1 or len(ids) != needed or slot != first + length - 1:
            return None
        if first < 0 or slot >= self.num_slots or not _consecutive(ids):
            return None
        kvs, strides, D = self._kv_slots, self._strides, self.head_dim
        shape = (1, self.num_kv_heads, length, D)
        k = kvs.as_strided(shape, strides, self._k_at + first * D)
        v = kvs.as_strided(shape, strides, self._v_at + first * D)
        return (
            kvs.as_strided((1, 2 * self.num_kv_heads, 1, D), strides, self._k_at + slot * D),
            k,
            v,
        )

    def by_token(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V token-major, (num_slots, KVH, D) each: views of the same memory (strides
        D, num_slots * D, 1), for kernels that take a sequence as rows of (KVH, D) (flash
        attention's varlen forward, engine/attend.py). (k, k) where the values are the keys."""
        KVH, D = self.num_kv_heads, self.head_dim
        k = self.k.view(KVH, self.num_slots, D).transpose(0, 1)
        if self.values_are_keys:
            return k, k
        return k, self.v.view(KVH, self.num_slots, D).transpose(0, 1)

    def runs(self, reads: Sequence[tuple[Sequence[int], int, int, int]]) -> list[int | None]:
        """Where each read lies in one run of slots: reads[b] = (block_table, start, length,
        first_block) as read() takes them; the slot of position start when positions
        start..length-1 sit in consecutive blocks (they are then slots first..first +
        length - start - 1 of every head), None when they do not (read() would copy)."""
        bs = self.block_size
        out: list[int | None] = []
        for b, read in enumerate(reads):
            ids = self._read_blocks(b, *read)
            out.append(ids[0] * bs + read[1] % bs if _consecutive(ids) else None)
        return out

    def _read_blocks(
        self,
        b: int,
        table: Sequence[int],
        start: int,
        length: int,
        first_block: int,
        width: int | None = None,
    ) -> Sequence[int]:
        """The block ids that hold read b's positions start..length-1 (runs' and gather's
        reads; at most width of them when given), or ValueError saying why they cannot."""
        bs = self.block_size
        lo = start // bs - first_block
        hi = -(-length // bs) - first_block
        wide = width is not None and length - start > width
        if not 0 <= start < length or lo < 0 or len(table) < hi or wide:
            raise ValueError(
                f"read {b}: positions {start}..{length - 1} of a session with "
                f"{len(table)} block(s) from position {first_block * bs} do not fit "
                f"{hi - lo} block(s) of {bs} from its block {first_block + lo}"
                + ("" if width is None else f" and width {width}")
            )
        return table[lo:hi]

    def gather(
        self, reads: Sequence[tuple[Sequence[int], int, int, int]], width: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Several sessions' K and V padded into one batch, one index_select each:
        reads[b] = (block_table, start, length, first_block) as read() takes them. Returns k,
        v (B, KVH, width, D), contiguous: row b's positions start..length-1 in columns
        0..length-start-1, its later columns a copy of its last key and value (finite: never
        an unwritten slot nor another session's), so masked padding cannot turn an output
        into NaN. width >= every length - start. The tensors live in this thread's scratch
        buffers: read them before this thread's next gather, never write them. Where the
        values are the keys, one index_select and (k, k), one tensor."""
        KVH, D, bs = self.num_kv_heads, self.head_dim, self.block_size
        B = len(reads)
        bases, counts, scattered = [], [], []  # scattered: rows whose blocks are not consecutive
        for b, (table, start, length, first_block) in enumerate(reads):
            # _read_blocks' blocks, its checks passed here (once per row per step)
            lo, hi = start // bs - first_block, -(-length // bs) - first_block
            if not (0 <= start < length and lo >= 0 and hi <= len(table)) or length - start > width:
                self._read_blocks(b, table, start, length, first_block, width)  # raises: why
            ids = table[lo:hi]
            bases.append(ids[0] * bs + start % bs)
            counts.append(length - start)
            if not _consecutive(ids):
                scattered.append((b, ids, start % bs))
        # One host tensor, one copy: each row's first slot and count, then for the
        # scattered rows their row, offset and block ids (padded with their last).
        data = bases + counts
        S = len(scattered)
        M = max((len(ids) for _, ids, _ in scattered), default=0)
        if S:
            data += [b for b, _, _ in scattered] + [offset for _, _, offset in scattered]
            for _, ids, _ in scattered:
                data += list(ids) + [ids[-1]] * (M - len(ids))
        host = list_tensor(data, self.device)  # (2B + S (2 + M),)
        j = torch.arange(width, device=self.device)[None]  # (1, width)
        last = host[B : 2 * B, None] - 1  # (B, 1): each row's last column
        slots = host[:B, None] + torch.minimum(j, last)  # (B, width)
        if S:  # fragmented sessions: through their block ids
            rows, offsets = host[2 * B : 2 * B + S], host[2 * B + S : 2 * B + 2 * S]
            blocks = host[2 * B + 2 * S :].view(S, M)  # (S, M)
            # (S, width): positions from each one's first block's start
            pos = offsets[:, None] + torch.minimum(j, last.index_select(0, rows))
            slots.index_copy_(0, rows, blocks.gather(1, pos // bs) * bs + pos % bs)
        heads = torch.arange(KVH, device=self.device) * self.num_slots  # (KVH,)
        index = (heads[None, :, None] + slots[:, None, :]).view(-1)  # (B * KVH * width,)
        k_out, v_out = self._buffers(B * KVH * width)
        torch.index_select(self.k.view(KVH * self.num_slots, D), 0, index, out=k_out)
        keys = k_out.view(B, KVH, width, D)
        if self.values_are_keys:
            return keys, keys
        torch.index_select(self.v.view(KVH * self.num_slots, D), 0, index, out=v_out)
        return keys, v_out.view(B, KVH, width, D)

    def _buffers(self, rows: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This thread's gather buffers, (rows, D) each, grown when too small: K's alone
        (and None) where the values are the keys."""
        held = getattr(self._scratch, "kv", None)
        if held is None or held[0].shape[0] < rows:
            D, planes = self.head_dim, "k" if self.values_are_keys else "kv"
            held = tuple(torch.empty(rows, D, dtype=self.dtype, device=self.device) for _ in planes)
            self._scratch.kv = held
        return held[0][:rows], (held[1][:rows] if len(held) > 1 else None)


def _consecutive(ids: Sequence[int]) -> bool:
    """ids[i] == ids[0] + i throughout (one list comparison, in C; none for the one or two
    blocks of most decode steps' reads)."""
    n = len(ids)
    if n < 3:
        return n < 2 or ids[1] == ids[0] + 1
    return list(ids) == list(range(ids[0], ids[0] + n))
