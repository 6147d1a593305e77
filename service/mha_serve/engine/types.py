"""The small dataclasses that cross the engine boundary: model specs, calls and results."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mha_serve.cache import SessionStats
from mha_serve.model import MultiHeadAttention
from mha_serve.spec import (  # re-exported: the engine's callers name them from here
    DEFAULT_KV_BLOCK_SIZE,
    DEFAULT_KV_CACHE_BYTES,
    DEFAULT_MAX_SEQ_LEN,
    DEFAULT_MAX_WEIGHTS_BYTES,
    DTYPE_NAMES,
    KV_CACHE_DTYPES,
    MiB,
    ModelSpec,
)

__all__ = [
    "DEFAULT_KV_BLOCK_SIZE",
    "DEFAULT_KV_CACHE_BYTES",
    "DEFAULT_MAX_SEQ_LEN",
    "DEFAULT_MAX_WEIGHTS_BYTES",
    "DTYPES",
    "KV_CACHE_DTYPES",
    "AttendCall",
    "AttendResult",
    "CacheInfo",
    "HostedModel",
    "MiB",
    "ModelSpec",
    "repeat_heads",
]

# Compute dtypes by the names the config uses ("auto" aside): the server's dtype, and a
# model's kv_cache_dtype.
DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


@dataclass
class HostedModel:
    """A loaded model: its spec, its module (eval, no grad) and where it computes."""

    spec: ModelSpec
    module: MultiHeadAttention
    device: torch.device
    dtype: torch.dtype

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.module.parameters())


@dataclass
class AttendCall:
    """One stateless Attend request, already decoded from the wire."""

    model: str
    inputs: torch.Tensor  # (B, L, E) on the CPU, float32/float16/bfloat16
    lengths: list[int] | None = None  # real length per sequence; None: all L
    causal: bool | None = None  # None: the model's default
    need_weights: bool = False
    weight_heads: list[int] | None = None  # None: all heads
    query_start: int = 0
    query_end: int = 0  # 0: to the end of the padded sequence
    weights_dtype: torch.dtype = torch.float32
    head_mask: list[float] | None = None
    output_dtype: torch.dtype | None = None  # None: the input's dtype
    session_id: str | None = None  # a session step: inputs (1, T, E) are appended to it
    # The caller's deadline (time.monotonic()), and whether it stopped waiting (set from the
    # caller's thread): a session step whose caller is gone by its end is not kept.
    deadline: float | None = None
    cancelled: bool = False
    # The caller holds the session's claim (Engine.stepping) for this step.
    claimed: bool = False
    # max |input|, set by Engine.validate (None: not validated): bounds the step's q, k, v
    # and output, so a step needs no check of its own while they are far from overflow.
    input_absmax: float | None = None

    def heads(self, num_heads: int) -> list[int]:
        """Query heads whose weights are returned, in the order asked (None: all)."""
        return self.weight_heads if self.weight_heads is not None else list(range(num_heads))


def repeat_heads(weights: torch.Tensor, heads: list[int]) -> torch.Tensor:
    """Weights computed once per distinct head (sorted(set(heads)), dim 1) -> one slice per
    entry of heads, so listing a head many times never multiplies the work."""
    unique = sorted(set(heads))
    if unique == heads:
        return weights
    return weights[:, [unique.index(h) for h in heads]]


@dataclass
class AttendResult:
    output: torch.Tensor  # (B, L, E) on the CPU in the requested dtype
    weights: torch.Tensor | None  # (B, h, R, S) on the CPU
    weight_heads: list[int] = field(default_factory=list)
    weight_query_start: int = 0
    compute_ms: float = 0.0
    batch_size: int = 0
    session: SessionStats | None = None  # the session after a step


@dataclass(frozen=True)
class CacheInfo:
    """One model's KV cache as the engine reports it (ModelInfo.kv_cache, metrics)."""

    budget_bytes: int
    block_size: int  # tokens per block
    bytes_per_token: int
    bytes_per_block: int
    num_blocks: int
    num_blocks_used: int
    num_sessions: int
    evict_idle_sessions: bool
    dtype: torch.dtype  # element type of the stored K/V
    # Blocks freed so far because they fell out of a session's sliding window (cumulative).
    num_blocks_out_of_window: int = 0
