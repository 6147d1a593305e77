"""Paged KV cache: block pool (ids, refcounts), per-model K/V storage under a byte
budget, and the session table that maps sessions to blocks. Knows nothing of gRPC."""

from .block_pool import BlockPool
from .errors import (
    CacheError,
    CacheExhausted,
    ClientQuotaExceeded,
    InvalidSessionArgument,
    SessionBusy,
    SessionFull,
    SessionNotFound,
)
from .kv_cache import DEFAULT_BLOCK_SIZE, PAD_SLOT, KVCache, slot_mapping
from .sessions import SessionTable
from .types import BlockStorage, ModelCacheStats, Reservation, Session, SessionStats

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
    "SessionFull",
    "SessionNotFound",
    "SessionStats",
    "SessionTable",
    "slot_mapping",
]
