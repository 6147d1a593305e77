"""Paged KV cache: block pool (ids, refcounts), per-model K/V storage under a byte
budget, and the session table that maps sessions to blocks. Knows nothing of gRPC.

The torch-using names load on first use (PEP 562), so that the errors and the small
dataclasses (`mha_serve.cache.errors`, `mha_serve.cache.types`) import without torch: a
frontend worker reads them and never loads torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mha_serve.lazy import lazy_attributes

from .errors import (
    CacheError,
    CacheExhausted,
    ClientQuotaExceeded,
    InvalidSessionArgument,
    SessionBusy,
    SessionExists,
    SessionFull,
    SessionNotFound,
    SessionSpilled,
    SpillFull,
)
from .types import (
    BlockStorage,
    ModelCacheStats,
    Reservation,
    Session,
    SessionStats,
    SpillInfo,
)

# name -> submodule that defines it
_LAZY = {
    "BlockPool": "block_pool",
    "DEFAULT_BLOCK_SIZE": "kv_cache",
    "PAD_SLOT": "kv_cache",
    "KVCache": "kv_cache",
    "slot_mapping": "kv_cache",
    "SessionTable": "sessions",
    "SpillDirInUse": "spill",
    "SpillStore": "spill",
    "SpillTier": "spill",
}

if TYPE_CHECKING:
    from .block_pool import BlockPool
    from .kv_cache import DEFAULT_BLOCK_SIZE, PAD_SLOT, KVCache, slot_mapping
    from .sessions import SessionTable
    from .spill import SpillDirInUse, SpillStore, SpillTier


__getattr__ = lazy_attributes(__name__, _LAZY, globals())


__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "PAD_SLOT",
    "BlockPool",
    "BlockStorage",
    "CacheError",
    "CacheExhausted",
    "ClientQuotaExceeded",
    "InvalidSessionArgument",
    "KVCache",
    "ModelCacheStats",
    "Reservation",
    "Session",
    "SessionBusy",
    "SessionExists",
    "SessionFull",
    "SessionNotFound",
    "SessionSpilled",
    "SessionStats",
    "SessionTable",
    "SpillDirInUse",
    "SpillFull",
    "SpillInfo",
    "SpillStore",
    "SpillTier",
    "slot_mapping",
]
