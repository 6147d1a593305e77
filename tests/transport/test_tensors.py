"""The server's wire codec: bytes + dtype + shape <-> Array (torch-free), every dtype, and
its errors; tensors made and compared with torch through the engine's zero-copy views."""

from __future__ import annotations

import pytest
import torch

from mha_client.api import attention_pb2 as pb
from mha_serve.engine import InvalidRequest
from mha_serve.engine.types import array_of, tensor_of
from mha_serve.transport.tensors import dtype_name, from_proto, to_proto


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 5, 8), (4, 2), (1,)])
def test_round_trip_is_bit_exact(dtype, shape):
    t = torch.randn(shape).to(dtype)
    message = to_proto(array_of(t))
    assert list(message.shape) == list(shape)
    assert len(message.data) == t.numel() * dtype.itemsize
    back = tensor_of(from_proto(pb.Tensor.FromString(message.SerializeToString())))
    assert back.dtype == dtype and torch.equal(back.view(torch.uint8), t.view(torch.uint8))


def test_bytes_are_little_endian_row_major():
    message = to_proto(array_of(torch.tensor([[1.0, 2.0]], dtype=torch.float16)))
    assert message.data == bytes.fromhex("003c0040")  # fp16 1.0 = 0x3c00, 2.0 = 0x4000


def test_non_contiguous_tensor_is_sent_in_logical_order():
    t = torch.arange(6.0).view(2, 3).t()  # (3, 2), not contiguous
    assert torch.equal(tensor_of(from_proto(to_proto(array_of(t)))), t)


@pytest.mark.parametrize(
    ("message", "match"),
    [
        (
            pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[2, 2], data=bytes(12)),
            r"input.data has 12 bytes but shape \[2, 2\] in float32 needs 16",
        ),
        (pb.Tensor(shape=[1], data=bytes(4)), "input.dtype is unset"),
        (pb.Tensor(dtype=9, shape=[1], data=bytes(4)), "9 is not a supported dtype"),
        (pb.Tensor(dtype=pb.DTYPE_FLOAT16, shape=[-1, 2], data=bytes(4)), "negative dimension"),
    ],
)
def test_malformed_tensors_are_invalid(message, match):
    with pytest.raises(InvalidRequest, match=match):
        from_proto(message)


def test_unspecified_output_dtype_takes_default():
    assert dtype_name(pb.DTYPE_UNSPECIFIED, "x", default="float16") == "float16"
    assert dtype_name(pb.DTYPE_BFLOAT16, "x") == "bfloat16"


def test_fill_proto_fills_what_to_proto_makes_for_every_shape_and_dtype():
    """fill_proto copies in a Tensor head kept per (dtype, shape): the same message as
    to_proto's for each, a batch or its first sequence, while the kept heads are emptied
    and refilled (more shapes than MAX_HEADS) and when a field held another tensor."""
    import numpy as np

    from mha_serve.engine.requests import Array
    from mha_serve.transport import tensors

    rng = np.random.default_rng(0)
    shapes = [(1, 1, 8), (1, 3, 8), (2, 1, 8), (1, 1, 4)]
    shapes += [(1, n, 2) for n in range(1, tensors.MAX_HEADS + 10)]
    reply = pb.AttendResponse()
    for round_ in range(2):  # the second round finds some heads kept, others not
        for shape in shapes:
            for dtype, np_dtype in (("float32", np.float32), ("float16", np.float16)):
                for single in (False, True):
                    data = rng.standard_normal(shape).astype(np_dtype)
                    fresh = pb.Tensor()
                    tensors.fill_proto(fresh, Array(data, dtype), single=single)
                    tensors.fill_proto(reply.output, Array(data, dtype), single=single)
                    want = to_proto(Array(data[0] if single else data, dtype))
                    assert fresh == want and reply.output == want, (round_, shape, dtype)
        assert 0 < len(tensors._HEADS) <= tensors.MAX_HEADS
    bf16 = Array(np.arange(6, dtype=np.int16).reshape(1, 2, 3), "bfloat16")
    out = pb.Tensor()
    tensors.fill_proto(out, bf16)
    assert out == to_proto(bf16) and out.dtype == pb.DTYPE_BFLOAT16
    with pytest.raises(TypeError, match="cannot send int8"):
        tensors.fill_proto(pb.Tensor(), Array(np.zeros((1, 1, 2), np.int8), "int8"))
