"""What crosses the engine's edge, without torch: a request as the client asked it, the
outcome the engine returns, the host tensors both carry, and what a front door reads of a
hosted model. A frontend worker holds only these (it never loads torch); the engine turns
an Array into a tensor and back without copying (engine/types.py).

The request is immutable: what serving tracks about a call while it runs (deadline,
cancellation, the session's claim, timing) is serving's ticket, which the engine reads
through CallState and never writes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from mha_serve.cache.types import SessionStats
from mha_serve.spec import DTYPE_NAMES, ModelSpec

# numpy's element type for each wire dtype: numpy has no bfloat16, so bfloat16 travels as
# its 16 bits in an int16 array (the bytes are the same).
NUMPY_DTYPES = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(np.int16),
}
ITEMSIZES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True, slots=True)
class Array:
    """A host tensor: `data`, C-contiguous numpy memory in NUMPY_DTYPES[dtype], never
    written by whoever receives it (it may be a view of a received message)."""

    data: np.ndarray
    dtype: str  # "float32", "float16" or "bfloat16"

    @classmethod
    def frombuffer(cls, buffer: Any, dtype: str, shape: tuple[int, ...] | list[int]) -> Array:
        """A view of buffer's bytes (no copy), which must hold exactly shape in dtype."""
        np_dtype = NUMPY_DTYPES[dtype]
        size = np_dtype.itemsize
        for n in shape:
            size *= n
        nbytes = memoryview(buffer).nbytes
        if nbytes != size:
            raise ValueError(
                f"{nbytes} bytes do not hold shape {tuple(shape)} of {dtype} ({size} bytes)"
            )
        # np.ndarray over the buffer, not np.frombuffer(...).reshape(): one call, not two
        # (it would take a longer buffer's prefix: the size is checked above)
        return cls(np.ndarray(shape, np_dtype, buffer), dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    @property
    def ndim(self) -> int:
        return self.data.ndim

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def __getitem__(self, index: Any) -> Array:
        """A view along the first dimensions (array[0]: the first sequence of a batch)."""
        return Array(self.data[index], self.dtype)

    def bytes_view(self) -> np.ndarray:
        """The bytes, flat (uint8), without a copy: what the wire carries."""
        return np.ascontiguousarray(self.data).reshape(-1).view(np.uint8)

    def tobytes(self) -> bytes:
        return self.data.tobytes()

    def numpy(self) -> np.ndarray:
        """As numpy computes with it: bfloat16 widened to float32 (a copy), else `data`."""
        if self.dtype != "bfloat16":
            return self.data
        return (self.data.astype(np.int32) << 16).astype(np.uint32).view(np.float32)


@dataclass(frozen=True, slots=True)
class AttendRequest:
    """One Attend or session step, as the client asked it; never written after it is made.
    A session step may leave `model` empty: serving makes the request again with its
    session's model before the engine sees it."""

    model: str
    inputs: Array  # (B, L, E) float32, float16 or bfloat16
    lengths: tuple[int, ...] | None = None  # real length per sequence; None: all L
    causal: bool | None = None  # None: the model's default
    need_weights: bool = False
    weight_heads: tuple[int, ...] | None = None  # None: all heads
    query_start: int = 0
    query_end: int = 0  # 0: to the end of the padded sequence
    weights_dtype: str = "float32"
    head_mask: tuple[float, ...] | None = None
    output_dtype: str | None = None  # None: the input's dtype
    session_id: str | None = None  # a session step: inputs (1, T, E) are appended to it

    def heads(self, num_heads: int) -> list[int]:
        """Query heads whose weights are returned, in the order asked (None: all)."""
        return list(self.weight_heads) if self.weight_heads is not None else list(range(num_heads))


class CallState(Protocol):
    """What the engine reads of a call while it runs (serving's ticket); it never writes it.
    A session step whose caller stopped waiting by its end is rolled back, not kept."""

    @property
    def deadline(self) -> float | None: ...  # time.monotonic() past which nobody waits

    @property
    def cancelled(self) -> bool: ...  # the caller is gone

    @property
    def claimed(self) -> bool: ...  # the caller holds the session's claim (Engine.stepping)


@dataclass(frozen=True, slots=True)
class Unattended:
    """The CallState of a call nobody tracks: no deadline, never cancelled, no claim (a
    test, a benchmark, the warm-up)."""

    deadline: float | None = None
    cancelled: bool = False
    claimed: bool = False


UNATTENDED = Unattended()


@dataclass(slots=True)
class AttendOutcome:
    """What the engine returns for one request: its share of the batch that computed it.
    Never written once made, like every record a step makes (Reservation, SessionStats,
    KeyBound), but not frozen: a frozen dataclass stores each field through
    object.__setattr__ in its __init__, about 5x a plain slot's store, and a decode step
    makes several such records (about 6 us of a step's bookkeeping, bench/engine_step.py).
    The request stays frozen: what the client asked is never written (AttendRequest)."""

    output: Array  # (B, L, E) in the requested dtype; padded rows are zero
    weights: Array | None  # (B, h, R, S) when asked
    weight_heads: tuple[int, ...] = ()
    weight_query_start: int = 0
    compute_ms: float = 0.0
    batch_size: int = 0  # sequences computed in that forward
    session: SessionStats | None = None  # the session after a step


@dataclass(frozen=True, slots=True)
class PruningLevel:
    num_pruned: int  # heads masked at this level
    head: int  # the head masked last, going from the level before to this one
    output_error: float  # relative error of the output against the unmasked output
    head_mask: list[float]  # (H,) the gate to send as head_mask for this level


@dataclass(frozen=True, slots=True)
class HeadReport:
    """A head analysis (mha_serve.model.heads) as the engine returns it."""

    mean_entropy: list[float]  # per query head, nats
    mean_max_weight: list[float]
    importance: list[float]  # relative output error with the head alone masked
    pruning: list[PruningLevel]  # levels 1..H, least important head first
    weights: Array | None  # (H, L0, L0) float32 of sequence 0, when asked
    compute_ms: float = 0.0


@dataclass(frozen=True, slots=True)
class ModelView:
    """What a front door reads of a hosted model (HostedModel.view()): no module, no torch."""

    spec: ModelSpec
    device: str  # "cpu", "cuda:0"
    dtype: str  # the compute dtype's name, one of DTYPE_NAMES
    num_parameters: int


@dataclass(frozen=True, slots=True)
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
    dtype: str  # element type of the stored K/V, one of DTYPE_NAMES
    # Blocks freed so far because they fell out of a session's sliding window (cumulative).
    num_blocks_out_of_window: int = 0


__all__ = [
    "DTYPE_NAMES",
    "ITEMSIZES",
    "NUMPY_DTYPES",
    "UNATTENDED",
    "Array",
    "AttendOutcome",
    "AttendRequest",
    "CacheInfo",
    "CallState",
    "HeadReport",
    "ModelView",
    "PruningLevel",
    "Unattended",
]
