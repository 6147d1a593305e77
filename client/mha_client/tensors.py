"""numpy <-> mha.v1.Tensor codec: raw little-endian C-order bytes plus dtype and shape.

bfloat16 has no numpy dtype, so it is carried as uint16 bit patterns and decoded to float32.
"""

from __future__ import annotations

import math

import numpy as np

from mha_client.api import attention_pb2 as pb

# Wire dtype names accepted by the SDK and CLI, and their proto enums.
DTYPE_NAMES: dict[str, int] = {
    "float32": pb.DTYPE_FLOAT32,
    "float16": pb.DTYPE_FLOAT16,
    "bfloat16": pb.DTYPE_BFLOAT16,
}
DTYPE_ENUMS: dict[int, str] = {enum: name for name, enum in DTYPE_NAMES.items()}

# How each wire dtype is laid out in memory; bfloat16 travels as its raw bits.
_WIRE_NUMPY: dict[int, np.dtype] = {
    pb.DTYPE_FLOAT32: np.dtype("<f4"),
    pb.DTYPE_FLOAT16: np.dtype("<f2"),
    pb.DTYPE_BFLOAT16: np.dtype("<u2"),
}


def dtype_enum(name: str) -> int:
    """The pb.DType enum for a wire dtype name; ValueError listing the choices otherwise."""
    try:
        return DTYPE_NAMES[name]
    except KeyError:
        choices = ", ".join(DTYPE_NAMES)
        raise ValueError(f"unknown dtype {name!r}; choose one of {choices}") from None


def dtype_name(enum: int) -> str:
    """The wire dtype name of a pb.DType enum ("unspecified" for DTYPE_UNSPECIFIED)."""
    return DTYPE_ENUMS.get(enum, "unspecified")


def float32_to_bfloat16_bits(x: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) of float32 values, rounded to nearest, ties to even.

    Matches torch's conversion for finite values and infinities; a NaN stays a NaN (its sign
    and top payload bits are kept and the quiet bit set, so truncation cannot make it inf).
    """
    f32 = np.asarray(x, dtype=np.float32)
    bits = f32.view(np.uint32)
    # Adding 0x7FFF plus the lowest kept bit rounds half-way cases towards the even result;
    # uint32 arithmetic only wraps for NaN bit patterns, which are overwritten below.
    lsb = (bits >> np.uint32(16)) & np.uint32(1)
    rounded = ((bits + np.uint32(0x7FFF) + lsb) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(f32)
    if nan.any():
        rounded[nan] = ((bits[nan] >> np.uint32(16)) | np.uint32(0x0040)).astype(np.uint16)
    return rounded


def bfloat16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """float32 values of bfloat16 bit patterns (exact: bfloat16 is float32's top half)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def to_proto(array: np.ndarray, dtype: str | None = None) -> pb.Tensor:
    """Encode a float array as a pb.Tensor.

    dtype None sends float32 and float16 as they are and float64 as float32; "float32",
    "float16" or "bfloat16" converts first. An array already in the wire dtype and little-endian is
    copied exactly once, into the message bytes (non-contiguous ones included).
    """
    arr = np.asarray(array)
    if not np.issubdtype(arr.dtype, np.floating):
        raise ValueError(
            f"cannot send a {arr.dtype} array; attention inputs are floats: "
            f"convert with .astype(np.float32)"
        )
    if dtype is None:
        dtype = "float16" if arr.dtype == np.float16 else "float32"
    enum = dtype_enum(dtype)
    if enum == pb.DTYPE_BFLOAT16:
        wire = float32_to_bfloat16_bits(arr.astype(np.float32, copy=False))
    else:
        # copy=False: a no-op for arrays already in the wire dtype and byte order.
        wire = arr.astype(_WIRE_NUMPY[enum], copy=False)
    # tobytes() writes C order whatever the strides, so this is the one copy in every case.
    return pb.Tensor(dtype=enum, shape=wire.shape, data=wire.tobytes())


def from_proto(t: pb.Tensor) -> np.ndarray:
    """Decode a pb.Tensor to numpy: float32 or float16 as sent, bfloat16 as float32.

    float32/float16 results are read-only views of the message bytes; `.copy()` to modify.
    """
    np_dtype = _WIRE_NUMPY.get(t.dtype)
    if np_dtype is None:
        label = pb.DType.Name(t.dtype) if t.dtype in pb.DType.values() else str(t.dtype)
        raise ValueError(
            f"tensor dtype {label} cannot be decoded; expected one of {', '.join(DTYPE_NAMES)}"
        )
    shape = tuple(int(d) for d in t.shape)
    if any(d < 0 for d in shape):
        raise ValueError(f"tensor shape {list(shape)} has a negative dimension")
    data = t.data
    expected = math.prod(shape) * np_dtype.itemsize
    if len(data) != expected:
        raise ValueError(
            f"tensor data has {len(data)} bytes but shape {list(shape)} of "
            f"{dtype_name(t.dtype)} ({np_dtype.itemsize} bytes each) needs {expected}"
        )
    arr = np.frombuffer(data, dtype=np_dtype).reshape(shape)
    if t.dtype == pb.DTYPE_BFLOAT16:
        return bfloat16_bits_to_float32(arr)
    # Native byte order so downstream numpy code never sees a '<f4' vs '=f4' surprise.
    return arr.astype(np_dtype.newbyteorder("="), copy=False)
