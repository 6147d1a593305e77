"""mha.v1.Tensor <-> Array (engine/requests.py): raw little-endian bytes, a dtype and a
shape. No torch: a frontend worker decodes and encodes with these."""

from __future__ import annotations

import math
import sys
from typing import Any

from mha_client.api import attention_pb2 as pb
from mha_client.tensors import tensor_field
from mha_serve.engine.errors import InvalidRequest
from mha_serve.engine.requests import ITEMSIZES, Array

# The wire's dtypes by name (the engine's names: engine/requests.py) and back.
DTYPE_NAMES = {
    pb.DTYPE_FLOAT32: "float32",
    pb.DTYPE_FLOAT16: "float16",
    pb.DTYPE_BFLOAT16: "bfloat16",
}
PROTO_DTYPES = {name: value for value, name in DTYPE_NAMES.items()}

if sys.byteorder != "little":  # the wire is little-endian; we never byte-swap
    raise ImportError("mha-serve needs a little-endian host")


def dtype_name(value: int, what: str, *, default: str | None = None) -> str | None:
    """A proto DType's name; DTYPE_UNSPECIFIED gives `default`."""
    if value == pb.DTYPE_UNSPECIFIED:
        return default
    name = DTYPE_NAMES.get(value)
    if name is None:
        raise InvalidRequest(
            f"{what} {value} is not a supported dtype; use DTYPE_FLOAT32, DTYPE_FLOAT16 or DTYPE_BFLOAT16"
        )
    return name


def from_proto(tensor: pb.Tensor, what: str = "input", data: Any = None) -> Array:
    """Decodes without copying the payload; the result is read-only memory, never written.
    data: the tensor's bytes when framing kept them out of the message (a view of the
    received bytes); None reads tensor.data, which is protobuf's copy."""
    return Array.frombuffer(*checked(tensor, what, data))


def checked(tensor: pb.Tensor, what: str = "input", data: Any = None) -> tuple[Any, str, list[int]]:
    """from_proto's (bytes, dtype, shape), each checked against the others."""
    dtype = DTYPE_NAMES.get(tensor.dtype)
    if dtype is None:
        if tensor.dtype == pb.DTYPE_UNSPECIFIED:
            raise InvalidRequest(
                f"{what}.dtype is unset; use DTYPE_FLOAT32, DTYPE_FLOAT16 or DTYPE_BFLOAT16"
            )
        dtype_name(tensor.dtype, f"{what}.dtype")  # raises: not a supported dtype
    shape = tensor.shape[:]  # a list (half list()'s cost)
    if shape and min(shape) < 0:
        raise InvalidRequest(f"{what}.shape {shape} has a negative dimension")
    if data is None:
        data = tensor.data  # once: every read of a bytes field copies it (4 ms for 16 MB)
    expected = math.prod(shape) * ITEMSIZES[dtype]
    nbytes = len(data) if type(data) is bytes else memoryview(data).nbytes
    if nbytes != expected:
        raise InvalidRequest(
            f"{what}.data has {nbytes} bytes but shape {shape} in {dtype} needs {expected}"
        )
    if expected == 0:  # never allocate: a zero dimension beside huge ones would overflow
        raise InvalidRequest(f"{what} is empty (shape {shape}); send at least one token")
    return data, dtype, shape


def _proto_dtype(a: Array) -> int:
    dtype = PROTO_DTYPES.get(a.dtype)
    if dtype is None:
        raise TypeError(f"cannot send {a.dtype} on the wire")
    return dtype


def to_proto(a: Array) -> pb.Tensor:
    """Encodes an Array: two copies (tobytes, and protobuf's into the message)."""
    return pb.Tensor(dtype=_proto_dtype(a), shape=a.shape, data=a.tobytes())


# Tensors without their data, by (dtype, shape): fill_proto copies one in (one protobuf
# call) instead of setting dtype and shape (two, the shape's a repeated field: a decode
# step's reply spent ~10 us served in fill_proto, most of it there). Emptied when full, so
# that the shapes in use now (a stream's steps: always the same) are the ones kept.
_HEADS: dict[tuple[str, tuple[int, ...]], pb.Tensor] = {}
MAX_HEADS = 64


def fill_proto(t: pb.Tensor, a: Array, *, single: bool = False) -> None:
    """to_proto into a message's Tensor field in place (nesting a built pb.Tensor in another
    message costs protobuf three more copies). single: the first sequence of the batch
    only, without the batch dimension (as a[0], with no Array made for it)."""
    data = a.data[0] if single else a.data
    key = (a.dtype, data.shape)
    head = _HEADS.get(key)
    if head is None:
        head = pb.Tensor(dtype=_proto_dtype(a), shape=data.shape)
        if len(_HEADS) >= MAX_HEADS:
            _HEADS.clear()
        _HEADS[key] = head
    t.CopyFrom(head)
    t.data = data.tobytes()  # (C order, whatever the array's layout: the wire's)


def tensor_frames(field: int, a: Array) -> list[Any]:
    """Field `field` of a message holding this Array, as parts whose b"".join is its
    encoding: the memory is referenced, not copied (the join is the one copy)."""
    return tensor_field(field, _proto_dtype(a), a.shape, a.bytes_view())
