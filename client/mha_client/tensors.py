"""numpy <-> mha.v1.Tensor codec: raw little-endian C-order bytes plus dtype and shape.

bfloat16 has no numpy dtype, so it is carried as uint16 bit patterns and decoded to float32.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from mha_client.api import attention_pb2 as pb
from mha_client.errors import InvalidArgumentError

# Wire dtype names accepted by the SDK and CLI, and their proto enums.
DTYPE_NAMES: dict[str, int] = {
    "float32": pb.DTYPE_FLOAT32,
    "float16": pb.DTYPE_FLOAT16,
    "bfloat16": pb.DTYPE_BFLOAT16,
}
DTYPE_ENUMS: dict[int, str] = {enum: name for name, enum in DTYPE_NAMES.items()}

# How each wire dtype is laid out in memory; bfloat16 travels as its raw bits.
WIRE_NUMPY: dict[int, np.dtype] = {
    pb.DTYPE_FLOAT32: np.dtype("<f4"),
    pb.DTYPE_FLOAT16: np.dtype("<f2"),
    pb.DTYPE_BFLOAT16: np.dtype("<u2"),
}
# The wire's little-endian is this machine's order: its arrays are native as they are.
_WIRE_ORDER_IS_NATIVE = sys.byteorder == "little"


# The smallest magnitude that rounding to nearest takes to inf in each wire dtype: half-way
# between its largest finite value and the next power of two (a tie rounds to the even
# neighbour, and inf is the even one there).
_OVERFLOW_AT: dict[int, float] = {
    pb.DTYPE_FLOAT32: 2.0**128 - 2.0**103,  # largest 3.4028235e38
    pb.DTYPE_FLOAT16: 2.0**16 - 2.0**4,  # largest 65504
    pb.DTYPE_BFLOAT16: 2.0**128 - 2.0**119,  # largest 3.3895314e38
}
_LARGEST = {
    pb.DTYPE_FLOAT32: "3.4028e38",
    pb.DTYPE_FLOAT16: "65504",
    pb.DTYPE_BFLOAT16: "3.3895e38",
}


def dtype_enum(name: str) -> int:
    """The pb.DType enum for a wire dtype name; InvalidArgumentError (a ValueError) listing
    the choices otherwise."""
    try:
        return DTYPE_NAMES[name]
    except (KeyError, TypeError):
        choices = ", ".join(DTYPE_NAMES)
        raise InvalidArgumentError(f"unknown dtype {name!r}; choose one of {choices}") from None


def default_wire_dtype(array: np.ndarray) -> str:
    """What an array goes as when no dtype is asked: float16 as float16 (in either byte
    order), every other float as float32."""
    return "float16" if np.asarray(array).dtype.type is np.float16 else "float32"


def dtype_name(enum: int) -> str:
    """The wire dtype name of a pb.DType enum ("unspecified" for DTYPE_UNSPECIFIED)."""
    return DTYPE_ENUMS.get(enum, "unspecified")


# float32_to_bfloat16_bits converts this many values at a time: its two temporaries (64 and
# 16 KiB) stay in cache and are reused, so an input of any size writes its uint16 result and
# nothing more (whole-array temporaries wrote 3 times the result; as quick, measured here).
BF16_CHUNK = 1 << 14


def float32_to_bfloat16_bits(x: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) of float32 values, rounded to nearest, ties to even.

    Matches torch's conversion for finite values and infinities; a NaN stays a NaN (its sign
    and top payload bits are kept and the quiet bit set, so truncation cannot make it inf).
    """
    f32 = np.asarray(x, dtype=np.float32)
    if not f32.flags.c_contiguous:  # (ascontiguousarray would make a 0-d array 1-d)
        f32 = f32.copy(order="C")
    bits = f32.reshape(-1).view(np.uint32)
    rounded = np.empty(f32.shape, dtype=np.uint16)
    out = rounded.reshape(-1)  # a view: rounded is contiguous
    # Every step writes into these (out=): no allocation per chunk.
    tmp = np.empty(min(BF16_CHUNK, bits.size), dtype=np.uint32)
    is_nan = np.empty(tmp.size, dtype=bool)
    for start in range(0, bits.size, BF16_CHUNK):
        b = bits[start : start + BF16_CHUNK]
        t, nan = tmp[: b.size], is_nan[: b.size]
        np.bitwise_and(b, np.uint32(0x7FFFFFFF), out=t)
        np.greater(t, np.uint32(0x7F800000), out=nan)  # exponent all ones, mantissa not 0
        # Adding 0x7FFF plus the lowest kept bit rounds half-way cases towards the even
        # result; uint32 arithmetic only wraps for NaN bit patterns, overwritten below.
        np.right_shift(b, np.uint32(16), out=t)
        t &= np.uint32(1)
        t += np.uint32(0x7FFF)
        t += b
        t >>= np.uint32(16)
        o = out[start : start + b.size]
        o[...] = t  # uint32 -> uint16: the top half is zero
        if nan.any():
            o[nan] = (b[nan] >> np.uint32(16)) | np.uint32(0x0040)
    return rounded


def bfloat16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """float32 values of bfloat16 bit patterns (exact: bfloat16 is float32's top half)."""
    wide = np.asarray(bits, dtype=np.uint16).astype(np.uint32)
    wide <<= np.uint32(16)  # in place: the float32 result is the one buffer written
    return wide.view(np.float32)


def _check_fits(arr: np.ndarray, enum: int) -> None:
    """InvalidArgumentError when converting arr to the wire dtype would turn finite values
    into inf: the client would make the non-finite input the server refuses. Values already
    NaN or inf are left to the server, which refuses them with its own message."""
    limit = _OVERFLOW_AT[enum]
    if arr.size == 0 or float(np.finfo(arr.dtype).max) < limit:
        return  # a dtype whose values all fit (float16 into anything, float32 into float32)
    # Two reductions, no temporaries, for the usual input: a NaN fails both comparisons.
    if -limit < arr.min() and arr.max() < limit:
        return
    with np.errstate(invalid="ignore"):
        finite = np.isfinite(arr)
        over = finite & (np.abs(arr) >= limit)
    num_over = int(np.count_nonzero(over))
    if num_over == 0:
        return
    name = dtype_name(enum)
    largest = float(np.abs(arr[finite]).max())
    fix = "scale the input down"
    if enum != pb.DTYPE_FLOAT32:
        fix = f"send float32 (leave input_dtype / --dtype unset) or {fix}"
    raise InvalidArgumentError(
        f"{num_over} of the input's {arr.size} values are beyond {name}'s range "
        f"(+-{_LARGEST[enum]}; the largest |x| is {largest:.4g}): converted to {name} they "
        f"would be sent as inf; {fix}"
    )


def _wire_array(array: np.ndarray, dtype: str | None) -> tuple[int, np.ndarray]:
    """The dtype enum and the array in its wire layout (no copy when it already is).

    InvalidArgumentError before anything is sent for a non-float array, an unknown dtype, or
    finite values the conversion would make inf (_check_fits)."""
    arr = np.asarray(array)
    if not np.issubdtype(arr.dtype, np.floating):
        raise InvalidArgumentError(
            f"cannot send a {arr.dtype} array; attention inputs are floats: "
            f"convert with .astype(np.float32)"
        )
    enum = dtype_enum(default_wire_dtype(arr) if dtype is None else dtype)
    _check_fits(arr, enum)
    if enum == pb.DTYPE_BFLOAT16:
        return enum, float32_to_bfloat16_bits(arr.astype(np.float32, copy=False))
    # copy=False: a no-op for arrays already in the wire dtype and byte order; a big-endian
    # array is swapped to the wire's little-endian here.
    return enum, arr.astype(WIRE_NUMPY[enum], copy=False)


def to_proto(array: np.ndarray, dtype: str | None = None) -> pb.Tensor:
    """Encode a float array as a pb.Tensor.

    dtype None sends float32 and float16 as they are and float64 as float32; "float32",
    "float16" or "bfloat16" converts first. An array already in the wire dtype and little-endian
    costs two copies: tobytes() (C order whatever the strides) and protobuf's into the message.
    array_field frames it with none.
    """
    enum, wire = _wire_array(array, dtype)
    return pb.Tensor(dtype=enum, shape=wire.shape, data=wire.tobytes())


def fill_proto(t: pb.Tensor, array: np.ndarray, dtype: str | None = None) -> None:
    """to_proto into a message's Tensor field in place: nesting a built pb.Tensor in another
    message costs protobuf three more copies of the payload (a merge), this none."""
    enum, wire = _wire_array(array, dtype)
    t.dtype = enum
    t.shape[:] = wire.shape
    t.data = wire.tobytes()


def from_proto(t: pb.Tensor, data: Any = None) -> np.ndarray:
    """Decode a pb.Tensor to numpy: float32 or float16 as sent, bfloat16 as float32.

    data: the tensor's bytes when framing kept them out of the message (parse_with_tensors);
    None reads t.data (protobuf's copy). float32/float16 results are read-only views of those
    bytes; `.copy()` to modify.
    """
    # (Each step's reply passes here, after a wait for the wire that leaves numpy's and
    # protobuf's code cold: as few of their calls as it takes, e.g. one np.ndarray over the
    # bytes, not frombuffer, reshape and astype.)
    dtype = t.dtype
    np_dtype = WIRE_NUMPY.get(dtype)
    if np_dtype is None:
        label = pb.DType.Name(dtype) if dtype in pb.DType.values() else str(dtype)
        raise ValueError(
            f"tensor dtype {label} cannot be decoded; expected one of {', '.join(DTYPE_NAMES)}"
        )
    shape = tuple(t.shape)  # (int64: Python ints)
    if shape and min(shape) < 0:
        raise ValueError(f"tensor shape {list(shape)} has a negative dimension")
    if data is None:
        data = t.data  # once: each read of a bytes field copies it
    expected = math.prod(shape) * np_dtype.itemsize
    nbytes = len(data) if type(data) is bytes else memoryview(data).nbytes
    if nbytes != expected:
        raise ValueError(
            f"tensor data has {nbytes} bytes but shape {list(shape)} of "
            f"{dtype_name(dtype)} ({np_dtype.itemsize} bytes each) needs {expected}"
        )
    arr = np.ndarray(shape, np_dtype, data)  # read-only: bytes are immutable
    if dtype == pb.DTYPE_BFLOAT16:
        return bfloat16_bits_to_float32(arr)
    if _WIRE_ORDER_IS_NATIVE:
        return arr
    # Native byte order so downstream numpy code never sees a '<f4' vs '=f4' surprise.
    return arr.astype(np_dtype.newbyteorder("="), copy=False)


# ----- hand framing: a tensor's bytes into and out of a serialized message, uncopied
#
# protobuf copies a bytes field on every step (setting it, nesting its message, serializing,
# parsing, reading the field): 5 to 8 copies of a payload per direction. A serialized message
# is its fields' encodings one after another, in any order, so a message can be written as
# protobuf's encoding of its small fields followed by a hand-written Tensor field that refers
# to the array's memory, and read by cutting the tensor fields out before protobuf parses the
# rest: one payload copy to encode (the join) and none to decode (a view of the received bytes).

_LEN = 2  # wire type of length-delimited fields (bytes, strings, messages, packed repeats)
_TENSOR_DATA = 3  # Tensor.data's field number


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


# protobuf (upb) reads a tag or a length in at most 5 bytes and rejects a longer one (a
# redundant 0x80 byte more), though a value's varint may take 10: framing that accepted a
# 6-byte tag or length would answer a message protobuf rejects.
_TAG_OR_LEN_BYTES = 5
# Fields split_fields reads before it hands a message to protobuf whole. An AttendRequest
# has 8 fields and a Tensor 3; a request of 64 MiB made of 2-byte fields would otherwise
# keep this Python loop (and the event loop running it) busy for 40 s, protobuf's C 0.7 s.
MAX_SCAN_FIELDS = 256


def _read_varint(buf: memoryview, pos: int, max_bytes: int = 10) -> tuple[int, int]:
    result = shift = 0
    while shift < 7 * max_bytes:
        if pos >= len(buf):
            raise ValueError("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
    raise ValueError(f"varint longer than {max_bytes} bytes")


def tensor_field(field: int, dtype: int, shape: Sequence[int], payload: Any) -> list[Any]:
    """Field `field` of a message, holding a Tensor of `payload`'s bytes, as parts whose
    b"".join is its encoding. payload (any C-contiguous buffer: bytes, a numpy array) is
    referenced, not copied."""
    return [tensor_field_head(field, dtype, shape, memoryview(payload).nbytes), payload]


def tensor_field_head(field: int, dtype: int, shape: Sequence[int], nbytes: int) -> bytes:
    """tensor_field's encoding up to its payload: what nbytes of data follow."""
    head = pb.Tensor(dtype=dtype, shape=shape).SerializeToString()
    head += _varint(_TENSOR_DATA << 3 | _LEN) + _varint(nbytes)
    return _varint(field << 3 | _LEN) + _varint(len(head) + nbytes) + head


def array_field(field: int, array: np.ndarray, dtype: str | None = None) -> list[Any]:
    """tensor_field of an array, converted as to_proto converts it (copied only if the wire
    dtype or a non-contiguous layout needs it)."""
    enum, wire = _wire_array(array, dtype)
    payload = np.ascontiguousarray(wire).reshape(-1).view(np.uint8)
    return tensor_field(field, enum, wire.shape, payload)


def split_fields(
    buf: memoryview, fields: Iterable[int]
) -> tuple[list[memoryview], dict[int, memoryview]] | None:
    """buf's encoding without `fields` (slices to join) and each of those fields' value (a
    view into buf). None when a field does not scan as length-delimited, occurs twice (protobuf
    would merge the two), the bytes are not a valid encoding or hold more than MAX_SCAN_FIELDS
    fields: protobuf then gets them whole."""
    wanted = set(fields)
    rest: list[memoryview] = []
    found: dict[int, memoryview] = {}
    pos = kept = 0
    try:
        for _ in range(MAX_SCAN_FIELDS):
            if pos >= len(buf):
                break
            start = pos
            key, pos = _read_varint(buf, pos, _TAG_OR_LEN_BYTES)
            number, wire_type = key >> 3, key & 7
            if number == 0 or key > 0xFFFFFFFF or (number in wanted and wire_type != _LEN):
                return None
            if wire_type == 0:
                _, pos = _read_varint(buf, pos)
            elif wire_type == 1:
                pos += 8
            elif wire_type == 5:
                pos += 4
            elif wire_type == _LEN:
                size, pos = _read_varint(buf, pos, _TAG_OR_LEN_BYTES)
                if number in wanted:
                    if number in found or pos + size > len(buf):
                        return None
                    found[number] = buf[pos : pos + size]
                    rest.append(buf[kept:start])
                    kept = pos + size
                pos += size
            else:  # groups (3, 4) and invalid wire types
                return None
            if pos > len(buf):
                return None
        else:  # a valid message this long is a hostile one (or unpacked repeats): C parses it
            return None
    except ValueError:
        return None
    rest.append(buf[kept:])
    return rest, found


def parse_with_tensors(data: bytes, cls: Any, fields: dict[int, str]) -> tuple[Any, dict[str, Any]]:
    """Parses `data` as a `cls` message whose Tensor fields (number -> name) keep their bytes
    out of protobuf: the message (those tensors' dtype and shape set, data empty) and each
    present tensor's data as a read-only view of `data`. Whatever the framing cannot vouch for
    goes to protobuf whole, which then parses (or rejects) it exactly as cls.FromString."""
    view = memoryview(data)
    split = split_fields(view, fields)
    if split is not None:
        rest, tensors = split
        inner = {n: split_fields(v, (_TENSOR_DATA,)) for n, v in tensors.items()}
        if all(s is not None for s in inner.values()):
            message = cls.FromString(b"".join(rest))
            payloads: dict[str, Any] = {}
            for number, (tensor_rest, data_field) in inner.items():  # type: ignore[misc]
                sub = getattr(message, fields[number])
                sub.SetInParent()
                sub.MergeFromString(b"".join(tensor_rest))
                payloads[fields[number]] = data_field.get(_TENSOR_DATA, b"")
            return message, payloads
    return cls.FromString(data), {}
