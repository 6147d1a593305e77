"""The small dataclasses that cross the engine boundary: model specs, calls and results."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mha_serve.batching.batcher import BatchPolicy
from mha_serve.cache import SessionStats
from mha_serve.model import AttentionConfig

MiB = 2**20
DEFAULT_MAX_SEQ_LEN = 4096
# 8 heads x 1024 x 1024 x fp32 for one sequence: larger asks must narrow heads/rows/dtype.
DEFAULT_MAX_WEIGHTS_BYTES = 64 * MiB
# A model's batch settings default to the batcher's own (one place for those numbers).
_BATCH = BatchPolicy()
# KV-cache sessions: MHA at embed_dim 512 in float32 holds 4 KiB per token, so 128 MiB is
# 32768 tokens (GQA with 2 KV heads: 131072; MQA: 262144). 0 turns sessions off.
DEFAULT_KV_CACHE_BYTES = 128 * MiB
DEFAULT_KV_BLOCK_SIZE = 16  # tokens per cache block
# Compute dtypes by the names the config uses ("auto" aside): the server's dtype, and a
# model's kv_cache_dtype.
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# The cache's element type: "auto" stores K/V in the model's dtype (exact); a narrower one
# holds more tokens per byte and reads fewer bytes per step, at a parity cost (docs/api.md).
KV_CACHE_DTYPES = ("auto", *DTYPES)


@dataclass(frozen=True)
class ModelSpec:
    """One hosted model as the config file describes it."""

    name: str
    attention: AttentionConfig
    seed: int = 0  # seeded initialisation when there is no checkpoint
    checkpoint: str | None = None  # safetensors file (ours or nn.MultiheadAttention's)
    max_seq_len: int = DEFAULT_MAX_SEQ_LEN
    max_batch_size: int = _BATCH.max_batch_size  # sequences per forward (and per request)
    max_weights_bytes: int = DEFAULT_MAX_WEIGHTS_BYTES
    max_batch_tokens: int = _BATCH.max_batch_tokens
    max_queue_delay_ms: float = _BATCH.max_queue_delay_s * 1e3
    max_queue_requests: int = _BATCH.max_queue_requests
    max_queue_tokens: int = _BATCH.max_queue_tokens
    min_batch_fill: float = _BATCH.min_batch_fill
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES
    kv_block_size: int = DEFAULT_KV_BLOCK_SIZE
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"model name {self.name!r} must be non-empty letters, digits, - or _")
        if (
            not isinstance(self.max_queue_delay_ms, int | float)
            or not 0 <= self.max_queue_delay_ms <= 1000
        ):
            raise ValueError(
                f"model {self.name!r}: max_queue_delay_ms must be in 0..1000, got {self.max_queue_delay_ms!r}"
            )
        if not isinstance(self.min_batch_fill, int | float) or not 0 <= self.min_batch_fill <= 1:
            raise ValueError(
                f"model {self.name!r}: min_batch_fill must be in 0..1 (1: only equal lengths share a batch), got {self.min_batch_fill!r}"
            )
        if not isinstance(self.kv_cache_bytes, int) or self.kv_cache_bytes < 0:
            raise ValueError(
                f"model {self.name!r}: kv_cache_bytes must be 0 (no sessions) or more, got {self.kv_cache_bytes!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"model {self.name!r}: kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)} "
                f"(auto: the model's dtype), got {self.kv_cache_dtype!r}"
            )
        for key in (
            "kv_block_size",
            "max_seq_len",
            "max_batch_size",
            "max_weights_bytes",
            "max_batch_tokens",
            "max_queue_requests",
            "max_queue_tokens",
        ):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(
                    f"model {self.name!r}: {key} must be a positive integer, got {value!r}"
                )


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
