"""Fixed pool of KV block ids with reference counts; pure Python, knows ids, never tensors.

A forked session shares its parent's blocks, so a block returns to the free list only
when its last reference is dropped. A block on the free list always has refcount 0.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from .errors import CacheExhausted


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be an int >= 1, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self._refcounts = [0] * num_blocks
        # FIFO: a freed block goes to the back, so ids are reused as late as possible
        # (a stale slot mapping then points at unused memory, not a fresh owner's).
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def refcount(self, block_id: int) -> int:
        self._check_id(block_id)
        return self._refcounts[block_id]

    def allocate(self, n: int) -> list[int]:
        """n blocks with refcount 1, all or nothing."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"allocate needs an int n >= 0, got {n!r}")
        if n > len(self._free):
            raise CacheExhausted(
                f"need {n} KV blocks but only {len(self._free)} of {self.num_blocks} are free",
                num_needed=n,
                num_free=len(self._free),
                num_blocks=self.num_blocks,
            )
        ids = [self._free.popleft() for _ in range(n)]
        for i in ids:
            assert self._refcounts[i] == 0, f"block {i} on the free list has refcount > 0"
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
                self._free.append(i)
                freed.append(i)
        return freed

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} is out of range 0..{self.num_blocks - 1}")
