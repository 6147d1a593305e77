"""The tensor codec: round trips, bfloat16 rounding, byte order and size checks, and the
conversions the client refuses before sending."""

from __future__ import annotations

import re
import warnings

import grpc
import numpy as np
import pytest

from mha_client import tensors
from mha_client.api import attention_pb2 as pb
from mha_client.errors import InvalidArgumentError, MhaServeError
from mha_client.tensors import (
    DTYPE_ENUMS,
    DTYPE_NAMES,
    array_field,
    bfloat16_bits_to_float32,
    default_wire_dtype,
    dtype_enum,
    dtype_name,
    float32_to_bfloat16_bits,
    from_proto,
    to_proto,
)

SHAPES = [(), (0,), (3, 0, 2), (7,), (2, 3), (2, 5, 8)]


def _values(shape: tuple[int, ...], dtype: type) -> np.ndarray:
    rng = np.random.default_rng(0)
    return rng.standard_normal(shape).astype(dtype)


def test_dtype_names_map_both_ways():
    assert DTYPE_NAMES == {
        "float32": pb.DTYPE_FLOAT32,
        "float16": pb.DTYPE_FLOAT16,
        "bfloat16": pb.DTYPE_BFLOAT16,
    }
    assert {DTYPE_NAMES[name]: name for name in DTYPE_NAMES} == DTYPE_ENUMS
    with pytest.raises(ValueError, match="choose one of float32, float16, bfloat16"):
        dtype_enum("float64")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_round_trip_is_exact(shape, dtype):
    x = _values(shape, dtype)
    t = to_proto(x)
    assert t.dtype == DTYPE_NAMES[np.dtype(dtype).name]
    assert list(t.shape) == list(shape)
    assert len(t.data) == x.size * x.itemsize
    y = from_proto(t)
    assert y.dtype == dtype and y.shape == shape
    np.testing.assert_array_equal(y, x)


@pytest.mark.parametrize("shape", SHAPES)
def test_bfloat16_round_trip_keeps_top_16_bits(shape):
    x = _values(shape, np.float32)
    t = to_proto(x, "bfloat16")
    assert t.dtype == pb.DTYPE_BFLOAT16 and len(t.data) == 2 * x.size
    y = from_proto(t)
    assert y.dtype == np.float32 and y.shape == shape
    # bfloat16 keeps 8 significant bits: relative error at most 2**-9 after rounding.
    np.testing.assert_allclose(y, x, rtol=2**-8, atol=0)
    # Values already representable in bfloat16 survive exactly.
    np.testing.assert_array_equal(from_proto(to_proto(y, "bfloat16")), y)


def test_float64_is_sent_as_float32_and_conversions_apply():
    x = np.linspace(-2, 2, 12).reshape(3, 4)
    assert to_proto(x).dtype == pb.DTYPE_FLOAT32
    np.testing.assert_array_equal(from_proto(to_proto(x)), x.astype(np.float32))
    assert from_proto(to_proto(x, "float16")).dtype == np.float16
    half = np.ones((2, 2), np.float16)
    assert from_proto(to_proto(half, "float32")).dtype == np.float32


def test_big_endian_and_strided_inputs_arrive_in_wire_order():
    x = np.arange(24, dtype=">f4").reshape(2, 3, 4).transpose(2, 0, 1)  # (4, 2, 3), strided
    t = to_proto(x)
    assert t.data == np.ascontiguousarray(x, dtype="<f4").tobytes()
    np.testing.assert_array_equal(from_proto(t), x)


def test_zero_d_tensor_round_trips():
    t = to_proto(np.float32(3.5))
    assert list(t.shape) == [] and len(t.data) == 4
    assert from_proto(t).shape == () and from_proto(t) == 3.5


def test_non_float_input_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"int64 array.*astype\(np.float32\)"):
        to_proto(np.arange(4))


def test_size_mismatch_names_both_numbers():
    t = pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[2, 3], data=b"\0" * 20)
    with pytest.raises(ValueError, match=r"20 bytes.*\[2, 3\].*needs 24"):
        from_proto(t)
    t = pb.Tensor(dtype=pb.DTYPE_BFLOAT16, shape=[4], data=b"\0" * 6)
    with pytest.raises(ValueError, match=r"6 bytes.*needs 8"):
        from_proto(t)


def test_unspecified_dtype_and_negative_shape_are_refused():
    with pytest.raises(ValueError, match="DTYPE_UNSPECIFIED cannot be decoded"):
        from_proto(pb.Tensor(shape=[1], data=b"\0" * 4))
    with pytest.raises(ValueError, match="negative"):
        from_proto(pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[-1], data=b""))


# Hand-made float32 bit patterns and the bfloat16 they must round to (nearest, ties to even).
BF16_CASES = [
    (0x3F800000, 0x3F80),  # 1.0
    (0x3F808000, 0x3F80),  # exactly half-way, lower bf16 even: round down
    (0x3F818000, 0x3F82),  # exactly half-way, lower bf16 odd: round up to even
    (0x3F808001, 0x3F81),  # just above half-way: up
    (0x3F807FFF, 0x3F80),  # just below half-way: down
    (0x7F7FFFFF, 0x7F80),  # largest float32 rounds to +inf
    (0x7F800000, 0x7F80),  # +inf
    (0xFF800000, 0xFF80),  # -inf
    (0x80000000, 0x8000),  # -0.0 keeps its sign
    (0x00000001, 0x0000),  # smallest subnormal rounds to zero
    (0x00018000, 0x0002),  # subnormal tie to even
]


@pytest.mark.parametrize(("f32_bits", "bf16_bits"), BF16_CASES)
def test_bfloat16_rounding_on_hand_made_bits(f32_bits, bf16_bits):
    x = np.array([f32_bits], dtype=np.uint32).view(np.float32)
    assert int(float32_to_bfloat16_bits(x)[0]) == bf16_bits


def test_bfloat16_keeps_nan_even_when_truncation_would_give_inf():
    # NaNs whose payload lives only in the low 16 bits: naive truncation would make them inf.
    bits = np.array([0x7F800001, 0xFF800001, 0x7FC00000, 0xFFFFFFFF], dtype=np.uint32)
    back = bfloat16_bits_to_float32(float32_to_bfloat16_bits(bits.view(np.float32)))
    assert np.isnan(back).all()
    assert np.signbit(back).tolist() == [False, True, False, True]


def test_bfloat16_matches_torch():
    torch = pytest.importorskip("torch", reason="torch not installed: hand-made bits cover it")
    rng = np.random.default_rng(1)
    scaled = rng.standard_normal(10_000) * 10.0 ** rng.integers(-40, 38, 10_000)  # float64
    random_bits = rng.integers(0, 2**32, 10_000, dtype=np.uint64).astype(np.uint32)
    hand_made = np.array([f for f, _ in BF16_CASES], dtype=np.uint32)
    x = np.concatenate(
        [
            np.clip(scaled, -3e38, 3e38).astype(np.float32),
            hand_made.view(np.float32),
            random_bits.view(np.float32),  # every exponent, NaNs and subnormals included
        ]
    )
    ours = float32_to_bfloat16_bits(x)
    theirs = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    finite = ~np.isnan(x)
    np.testing.assert_array_equal(ours[finite], theirs[finite])
    # NaN bit patterns differ between implementations; both must still decode to NaN.
    assert np.isnan(bfloat16_bits_to_float32(ours[~finite])).all()


def test_bfloat16_in_chunks_is_bfloat16_in_one(monkeypatch):
    # Chunk edges fall inside the array, NaNs and half-way cases on and beside them.
    rng = np.random.default_rng(2)
    bits = rng.integers(0, 2**32, 1000, dtype=np.uint64).astype(np.uint32)
    bits[::7] = [f for f, _ in BF16_CASES] * 13  # 143 hand-made patterns along the array
    bits[[6, 7, 13, 14]] = [0x7F800001, 0xFFFFFFFF, 0x3F808000, 0x3F818000]
    x = bits.view(np.float32).reshape(10, 100)
    whole = float32_to_bfloat16_bits(x)
    monkeypatch.setattr(tensors, "BF16_CHUNK", 7)
    chunked = float32_to_bfloat16_bits(x)
    np.testing.assert_array_equal(chunked, whole)
    assert chunked.shape == (10, 100) and chunked.dtype == np.uint16
    # A strided view converts as its contiguous copy does.
    np.testing.assert_array_equal(float32_to_bfloat16_bits(x.T), whole.T)


# ----- conversions the client makes: refused before sending when they would make inf


def _quiet(fn, *args):
    """fn(*args) with every warning an error: no numpy RuntimeWarning may leak."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return fn(*args)


@pytest.mark.parametrize(
    ("x", "dtype", "range_"),
    [
        (np.array([[1.0, -7e4]], np.float32), "float16", "float16's range (+-65504"),
        (np.array([[65520.0]], np.float32), "float16", "float16's range"),  # rounds to inf
        (np.array([[3.4e38]], np.float32), "bfloat16", "bfloat16's range"),
        (np.array([[1e39]]), None, "float32's range"),  # float64 goes as float32
        (np.array([[1e39]]), "bfloat16", "bfloat16's range"),
    ],
)
def test_a_conversion_that_would_make_inf_is_refused_by_the_client(x, dtype, range_):
    with pytest.raises(InvalidArgumentError, match=re.escape(range_)) as err:
        _quiet(to_proto, x, dtype)
    assert isinstance(err.value, MhaServeError) and isinstance(err.value, ValueError)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "1 of the input's" in err.value.details and "scale the input down" in err.value.details
    with pytest.raises(InvalidArgumentError, match="beyond"):  # the framed path too
        _quiet(array_field, 2, x, dtype)


def test_the_largest_values_that_round_to_a_finite_one_are_sent():
    x = np.array([65504.0, -65519.0, 1e-9], np.float32)
    np.testing.assert_array_equal(
        from_proto(_quiet(to_proto, x, "float16")), np.array([65504, -65504, 0], np.float16)
    )
    bf16_max = np.float32(3.3895314e38)
    assert from_proto(_quiet(to_proto, np.array([bf16_max]), "bfloat16"))[0] == bf16_max


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", None])
def test_input_already_nan_or_inf_is_sent_as_it_is(dtype):
    """The server refuses non-finite input with its own message: the client leaves it be."""
    x = np.array([1.0, np.nan, np.inf, -np.inf])
    got = from_proto(_quiet(to_proto, x, dtype))
    assert np.isnan(got[1]) and got[2] == np.inf and got[3] == -np.inf and got[0] == 1.0


@pytest.mark.parametrize("order", [">", "<", "="])
@pytest.mark.parametrize(("kind", "enum"), [("f2", pb.DTYPE_FLOAT16), ("f4", pb.DTYPE_FLOAT32)])
def test_either_byte_order_goes_as_its_dtype_in_little_endian(order, kind, enum):
    x = np.arange(6, dtype=np.float32).reshape(2, 3).astype(order + kind)
    assert default_wire_dtype(x) == dtype_name(enum)
    t = to_proto(x)
    assert t.dtype == enum and t.data == x.astype("<" + kind).tobytes()
    np.testing.assert_array_equal(from_proto(t), x)


def test_client_side_refusals_are_mha_serve_errors_and_value_errors():
    for bad in (lambda: to_proto(np.arange(4)), lambda: dtype_enum("float64")):
        with pytest.raises(InvalidArgumentError) as err:
            bad()
        assert isinstance(err.value, MhaServeError) and isinstance(err.value, ValueError)
        assert str(err.value).startswith("INVALID_ARGUMENT: ") and err.value.target == ""


@pytest.mark.parametrize("order_is_native", [True, False])
def test_decoded_arrays_are_read_only_native_views(monkeypatch, order_is_native):
    """A reply's float32/float16 arrays: views of the received bytes (never written), in this
    machine's byte order; on a big-endian machine (the wire's order not native) converted."""
    monkeypatch.setattr(tensors, "_WIRE_ORDER_IS_NATIVE", order_is_native)
    for dtype in (np.float32, np.float16):
        x = np.arange(6, dtype=dtype).reshape(2, 3)
        y = from_proto(to_proto(x))
        np.testing.assert_array_equal(y, x)
        assert y.dtype.isnative and y.dtype == dtype and not y.flags.writeable
