"""What the config describes, as plain dataclasses: a hosted model (ModelSpec) and its batch
policy. No torch here, so reading and checking a config (and `mha-serve --help`) never
loads it; the engine, the batcher and the config all take these from this one place."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mha_serve.model.config import AttentionConfig

MiB = 2**20

# Batch limits (per model, overridable in the config). Measured on the 2-core CPU machine:
# see docs/benchmarks.md for why these values.
DEFAULT_MAX_BATCH_SIZE = 64  # sequences in one forward
DEFAULT_MAX_BATCH_TOKENS = 32768  # padded tokens (sequences x longest) in one forward
DEFAULT_MAX_QUEUE_DELAY_S = 0.002  # how long the first request of a batch may wait for company
DEFAULT_MAX_QUEUE_REQUESTS = 1024
DEFAULT_MAX_QUEUE_TOKENS = 1 << 20
DEFAULT_MIN_BATCH_FILL = 0.8  # at most 20% of a batch's positions are padding

DEFAULT_MAX_SEQ_LEN = 4096
# 8 heads x 1024 x 1024 x fp32 for one sequence: larger asks must narrow heads/rows/dtype.
DEFAULT_MAX_WEIGHTS_BYTES = 64 * MiB
# KV-cache sessions: MHA at embed_dim 512 in float32 holds 4 KiB per token, so 128 MiB is
# 32768 tokens (GQA with 2 KV heads: 131072; MQA: 262144). 0 turns sessions off.
DEFAULT_KV_CACHE_BYTES = 128 * MiB
DEFAULT_KV_BLOCK_SIZE = 16  # tokens per cache block
# Compute dtypes by the names the config uses ("auto" aside): the server's dtype, and a
# model's kv_cache_dtype (engine.types.DTYPES maps them to torch).
DTYPE_NAMES = ("float32", "float16", "bfloat16")
# The cache's element type: "auto" stores K/V in the model's dtype (exact); a narrower one
# holds more tokens per byte and reads fewer bytes per step, at a parity cost (docs/api.md).
KV_CACHE_DTYPES = ("auto", *DTYPE_NAMES)


@dataclass(frozen=True)
class BatchPolicy:
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE
    max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS
    max_queue_delay_s: float = DEFAULT_MAX_QUEUE_DELAY_S
    max_queue_requests: int = DEFAULT_MAX_QUEUE_REQUESTS
    max_queue_tokens: int = DEFAULT_MAX_QUEUE_TOKENS
    # Real tokens / padded tokens a batch must keep. Attention costs the padded length, so
    # on the CPU a batch mixing 16- and 512-token sequences runs slower than the sequences
    # one by one (docs/batching.md); unequal lengths wait for a batch of their own.
    min_batch_fill: float = DEFAULT_MIN_BATCH_FILL

    def admits(self, sequences: int, real_tokens: int, longest: int, item: Any) -> bool:
        """Whether item (.sequences, .length, .tokens) may join a batch of `sequences`
        sequences, `real_tokens` of them real, padded to `longest`."""
        total = sequences + item.sequences
        new_longest = max(longest, item.length)
        return (
            total <= self.max_batch_size
            and total * new_longest <= self.max_batch_tokens
            and real_tokens + item.tokens >= self.min_batch_fill * total * new_longest
        )

    def __post_init__(self) -> None:
        for key in ("max_batch_size", "max_batch_tokens", "max_queue_requests", "max_queue_tokens"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{key} must be a positive integer, got {value!r}")
        fill = self.min_batch_fill
        if isinstance(fill, bool) or not isinstance(fill, int | float) or not 0 <= fill <= 1:
            raise ValueError(
                f"min_batch_fill must be in 0..1 (1: only equal lengths share a batch), "
                f"got {fill!r}"
            )
        delay = self.max_queue_delay_s
        if isinstance(delay, bool) or not isinstance(delay, int | float) or not 0 <= delay <= 1:
            raise ValueError(
                f"max_queue_delay_s must be in 0..1 s (a model's max_queue_delay_ms must be in "
                f"0..1000), got {delay!r}; a few milliseconds is typical"
            )


@dataclass(frozen=True)
class ModelSpec:
    """One hosted model as the config file describes it."""

    name: str
    attention: AttentionConfig
    seed: int = 0  # seeded initialisation when there is no checkpoint
    # A safetensors file (ours or nn.MultiheadAttention's), or a Hugging Face model
    # directory (config.json + safetensors) whose attention of layer `layer` is served.
    checkpoint: str | None = None
    layer: int | None = None  # with a Hugging Face directory: which layer (0-based)
    max_seq_len: int = DEFAULT_MAX_SEQ_LEN
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE  # sequences per forward (and per request)
    max_weights_bytes: int = DEFAULT_MAX_WEIGHTS_BYTES
    max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS
    max_queue_delay_ms: float = DEFAULT_MAX_QUEUE_DELAY_S * 1e3
    max_queue_requests: int = DEFAULT_MAX_QUEUE_REQUESTS
    max_queue_tokens: int = DEFAULT_MAX_QUEUE_TOKENS
    min_batch_fill: float = DEFAULT_MIN_BATCH_FILL
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES
    kv_block_size: int = DEFAULT_KV_BLOCK_SIZE
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"model name {self.name!r} must be non-empty letters, digits, - or _")
        if not isinstance(self.kv_cache_bytes, int) or self.kv_cache_bytes < 0:
            raise ValueError(
                f"model {self.name!r}: kv_cache_bytes must be 0 (no sessions) or more, got {self.kv_cache_bytes!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"model {self.name!r}: kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)} "
                f"(auto: the model's dtype), got {self.kv_cache_dtype!r}"
            )
        for key in ("kv_block_size", "max_seq_len", "max_weights_bytes"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(
                    f"model {self.name!r}: {key} must be a positive integer, got {value!r}"
                )
        chunk = self.attention.chunk_size
        if chunk is not None and self.max_seq_len > chunk:
            raise ValueError(
                f"model {self.name!r}: max_seq_len {self.max_seq_len} is past the layer's "
                f"attention_chunk_size {chunk}: its chunked attention (Llama 4's RoPE layers) "
                f"is served up to {chunk} positions, where it is causal attention; set "
                f"max_seq_len <= {chunk}"
            )
        try:  # the batch settings' rules live in BatchPolicy alone
            self.batch_policy()
        except (TypeError, ValueError) as e:
            raise ValueError(f"model {self.name!r}: {e}") from None

    def batch_policy(self) -> BatchPolicy:
        """The model's batch and queue limits, as the batcher takes them."""
        delay = self.max_queue_delay_ms
        return BatchPolicy(
            max_batch_size=self.max_batch_size,
            max_batch_tokens=self.max_batch_tokens,
            max_queue_delay_s=delay / 1e3 if isinstance(delay, int | float) else delay,
            max_queue_requests=self.max_queue_requests,
            max_queue_tokens=self.max_queue_tokens,
            min_batch_fill=self.min_batch_fill,
        )
