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
