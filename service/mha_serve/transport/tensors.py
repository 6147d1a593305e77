"""mha.v1.Tensor <-> torch.Tensor: raw little-endian bytes, a dtype and a shape."""

from __future__ import annotations

import math
import sys
import warnings
from typing import Any

import numpy as np
import torch

from mha_client.api import attention_pb2 as pb
from mha_client.tensors import tensor_field
from mha_serve.engine import InvalidRequest

TORCH_DTYPES = {
    pb.DTYPE_FLOAT32: torch.float32,
    pb.DTYPE_FLOAT16: torch.float16,
    pb.DTYPE_BFLOAT16: torch.bfloat16,
}
PROTO_DTYPES = {v: k for k, v in TORCH_DTYPES.items()}
# Views for bytes out: numpy has no bfloat16, so bf16 leaves as its int16 bits.
_BYTE_VIEWS = {torch.bfloat16: torch.int16}

if sys.byteorder != "little":  # the wire is little-endian; we never byte-swap
    raise ImportError("mha-serve needs a little-endian host")

# from_proto wraps the (immutable) message bytes and nothing writes to them; torch warns
# that the buffer is read-only. A filter set once, not warnings.catch_warnings() per call:
# that cost 20 us of every request's time on the event loop.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
warnings.filterwarnings(
    "ignore", message="The given NumPy array is not writable", category=UserWarning
)
# numpy views of wire bytes: np.frombuffer + torch.from_numpy take 1.6 us where
# torch.frombuffer + view take 3.3 us (per request, on the event loop). bf16 as its int16 bits.
_NUMPY_VIEWS = {torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: np.int16}


def torch_dtype(value: int, what: str, *, default: torch.dtype | None = None) -> torch.dtype | None:
    """A proto DType to torch; DTYPE_UNSPECIFIED gives `default`."""
    if value == pb.DTYPE_UNSPECIFIED:
        return default
    if value not in TORCH_DTYPES:
        raise InvalidRequest(
            f"{what} {value} is not a supported dtype; use DTYPE_FLOAT32, DTYPE_FLOAT16 or DTYPE_BFLOAT16"
        )
    return TORCH_DTYPES[value]


def from_proto(tensor: pb.Tensor, what: str = "input", data: Any = None) -> torch.Tensor:
    """Decodes without copying the payload; the result is read-only memory, never written.
    data: the tensor's bytes when framing kept them out of the message (a view of the
    received bytes); None reads tensor.data, which is protobuf's copy."""
    if tensor.dtype == pb.DTYPE_UNSPECIFIED:
        raise InvalidRequest(
            f"{what}.dtype is unset; use DTYPE_FLOAT32, DTYPE_FLOAT16 or DTYPE_BFLOAT16"
        )
    dtype = torch_dtype(tensor.dtype, f"{what}.dtype")
    shape = list(tensor.shape)
    if any(d < 0 for d in shape):
        raise InvalidRequest(f"{what}.shape {shape} has a negative dimension")
    if data is None:
        data = tensor.data  # once: every read of a bytes field copies it (4 ms for 16 MB)
    expected = math.prod(shape) * dtype.itemsize
    nbytes = memoryview(data).nbytes
    if nbytes != expected:
        raise InvalidRequest(
            f"{what}.data has {nbytes} bytes but shape {shape} in "
            f"{str(dtype).removeprefix('torch.')} needs {expected}"
        )
    if expected == 0:  # never allocate: a zero dimension beside huge ones would overflow
        raise InvalidRequest(f"{what} is empty (shape {shape}); send at least one token")
    x = torch.from_numpy(np.frombuffer(data, dtype=_NUMPY_VIEWS[dtype]).reshape(shape))
    return x.view(torch.bfloat16) if dtype == torch.bfloat16 else x


def _wire_view(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's C-order bytes as a tensor numpy can view (a copy only if not contiguous)."""
    if tensor.dtype not in PROTO_DTYPES:
        raise TypeError(f"cannot send {tensor.dtype} on the wire")
    raw = tensor.detach().contiguous()
    return raw.view(_BYTE_VIEWS.get(raw.dtype, raw.dtype))


def to_proto(tensor: torch.Tensor) -> pb.Tensor:
    """Encodes a CPU tensor: two copies (tobytes, and protobuf's into the message)."""
    raw = _wire_view(tensor)
    return pb.Tensor(
        dtype=PROTO_DTYPES[tensor.dtype], shape=list(tensor.shape), data=raw.numpy().tobytes()
    )


def fill_proto(t: pb.Tensor, tensor: torch.Tensor) -> None:
    """to_proto into a message's Tensor field in place (nesting a built pb.Tensor in another
    message costs protobuf three more copies)."""
    raw = _wire_view(tensor)
    t.dtype = PROTO_DTYPES[tensor.dtype]
    t.shape[:] = tensor.shape
    t.data = raw.numpy().tobytes()


def tensor_frames(field: int, tensor: torch.Tensor) -> list[Any]:
    """Field `field` of a message holding this CPU tensor, as parts whose b"".join is its
    encoding: the tensor's memory is referenced, not copied (the join is the one copy)."""
    raw = _wire_view(tensor)
    payload = raw.numpy().reshape(-1).view("u1")  # keeps the tensor's storage alive
    return tensor_field(field, PROTO_DTYPES[tensor.dtype], tensor.shape, payload)
