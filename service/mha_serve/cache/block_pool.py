"""Fixed pool of KV block ids with reference counts; pure Python, knows ids, never tensors.

A forked session shares its parent's blocks, so a block is free again only when its last
reference is dropped. A free block always has refcount 0.

Placement keeps each session's blocks consecutive where it can, because attention reads a
session whose blocks are consecutive in place (views into the cache) and must copy the
others' K/V on every step. Free blocks are kept as extents (runs of consecutive ids):
- a session grows in place when the blocks after its last one are free (`after`);
- a new run goes to the largest extent, in its middle unless the extent starts the pool,
  so that the session before it and the new one both have room to grow;
- only when no extent is big enough is an allocation split across extents, largest first.
A freed block is reusable at once: the session table hands out slots only under its lock,
through reservations that are committed or rolled back, so no stale mapping outlives them.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

from .errors import CacheExhausted


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be an int >= 1, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self._refcounts = [0] * num_blocks
        self._starts = [0]  # sorted starts of the free extents
        self._length = {0: num_blocks}  # free extent start -> length
        self._end = {num_blocks: 0}  # free extent end (exclusive) -> start
        self._num_free = num_blocks

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_used(self) -> int:
        return self.num_blocks - self._num_free

    @property
    def num_extents(self) -> int:
        """Runs of consecutive free blocks (1 for an empty pool)."""
        return len(self._starts)

    def refcount(self, block_id: int) -> int:
        self._check_id(block_id)
        return self._refcounts[block_id]

    def allocate(self, n: int, *, after: int | None = None) -> list[int]:
        """n blocks with refcount 1, all or nothing. after: the block the new ones should
        follow (a session's last block); they do when the n blocks after it are free."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"allocate needs an int n >= 0, got {n!r}")
        if n > self._num_free:
            raise CacheExhausted(
                f"need {n} KV blocks but only {self._num_free} of {self.num_blocks} are free",
                num_needed=n,
                num_free=self._num_free,
                num_blocks=self.num_blocks,
            )
        if n == 0:
            return []
        if after is not None:
            self._check_id(after)
        if after is not None and self._length.get(after + 1, 0) >= n:
            ids = self._take(after + 1, n)
        else:
            largest = max(self._starts, key=self._length.__getitem__)
            length = self._length[largest]
            if length >= n:  # in the middle, so the session before it can grow too
                ids = self._take(largest + (0 if largest == 0 else (length - n) // 2), n)
            else:  # split, largest extents first
                ids = []
                by_size = sorted(self._starts, key=self._length.__getitem__, reverse=True)
                for start in by_size:
                    if len(ids) == n:
                        break
                    ids += self._take(start, min(n - len(ids), self._length[start]))
        for i in ids:
            assert self._refcounts[i] == 0, f"block {i} was free with refcount > 0"
            self._refcounts[i] = 1
        return ids

    def incref(self, ids: Iterable[int]) -> None:
        """One more reference to each (already allocated) block, e.g. a fork."""
        ids = list(ids)
        for i in ids:
            self._check_id(i)
            if self._refcounts[i] == 0:
                raise ValueError(f"incref of block {i}, which is free (refcount 0)")
        for i in ids:
            self._refcounts[i] += 1

    def decref(self, ids: Iterable[int]) -> list[int]:
        """Drop one reference to each block; returns the ids that became free."""
        ids = list(ids)
        for i in ids:
            self._check_id(i)
        drops: dict[int, int] = {}
        for i in ids:
            drops[i] = drops.get(i, 0) + 1
        over = {i: n for i, n in drops.items() if n > self._refcounts[i]}
        if over:
            raise ValueError(
                "decref below zero (double free): "
                + ", ".join(
                    f"block {i} has {self._refcounts[i]} ref(s), dropped {n}"
                    for i, n in over.items()
                )
            )
        freed = []
        for i in ids:
            self._refcounts[i] -= 1
            if self._refcounts[i] == 0:
                self._give_back(i)
                freed.append(i)
        return freed

    def _take(self, start: int, n: int) -> list[int]:
        """Blocks start..start+n-1, all inside one free extent."""
        first = self._starts[bisect.bisect_right(self._starts, start) - 1]
        length = self._length[first]
        assert first <= start and start + n <= first + length, "not inside one free extent"
        self._remove(first)
        if start > first:
            self._insert(first, start - first)
        if start + n < first + length:
            self._insert(start + n, first + length - start - n)
        self._num_free -= n
        return list(range(start, start + n))

    def _give_back(self, i: int) -> None:
        """Block i is free again: merged with the free extents on either side."""
        start, length = i, 1
        if i in self._end:  # an extent ends right before i
            start = self._end[i]
            length += self._length[start]
            self._remove(start)
        if i + 1 in self._length:  # an extent starts right after i
            length += self._length[i + 1]
            self._remove(i + 1)
        self._insert(start, length)
        self._num_free += 1

    def _insert(self, start: int, length: int) -> None:
        bisect.insort(self._starts, start)
        self._length[start] = length
        self._end[start + length] = start

    def _remove(self, start: int) -> None:
        del self._starts[bisect.bisect_left(self._starts, start)]
        del self._end[start + self._length.pop(start)]

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} is out of range 0..{self.num_blocks - 1}")
