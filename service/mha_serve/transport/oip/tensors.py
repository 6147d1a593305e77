"""Open Inference Protocol tensors <-> torch: datatype strings, raw bytes and typed contents."""

from __future__ import annotations

import math

import torch

from mha_client.api.inference import grpc_service_pb2 as pb
from mha_client.api.inference import model_config_pb2 as mc
from mha_serve.engine import InvalidRequest

# The protocol's datatype strings for the dtypes mha-serve takes and returns.
DATATYPES = {"FP32": torch.float32, "FP16": torch.float16, "BF16": torch.bfloat16}
NAMES = {dtype: name for name, dtype in DATATYPES.items()}
CONFIG_TYPES = {
    torch.float32: mc.TYPE_FP32,
    torch.float16: mc.TYPE_FP16,
    torch.bfloat16: mc.TYPE_BF16,
}
# numpy has no bfloat16: bf16 leaves as its int16 bits (raw bytes are the same).
_BYTE_VIEWS = {torch.bfloat16: torch.int16}


def shape_text(shape: list[int]) -> str:
    """[-1,-1,512] as Triton writes shapes in its messages."""
    return "[" + ",".join(str(d) for d in shape) + "]"


def decode(
    tensor: pb.ModelInferRequest.InferInputTensor, raw: bytes | None, model: str
) -> torch.Tensor:
    """One input from its raw bytes (raw_input_contents) or its typed contents; no copy of raw
    bytes (the result is read-only memory, never written)."""
    dtype = DATATYPES.get(tensor.datatype)
    if dtype is None:
        raise InvalidRequest(
            f"inference input '{tensor.name}' data-type is '{tensor.datatype}', but model "
            f"'{model}' expects 'FP32', 'FP16' or 'BF16'"
        )
    shape = list(tensor.shape)
    if any(d < 0 for d in shape):
        raise InvalidRequest(
            f"inference input '{tensor.name}' for model '{model}' has a negative dimension in "
            f"shape {shape_text(shape)}"
        )
    count = math.prod(shape)
    if count == 0:
        raise InvalidRequest(
            f"inference input '{tensor.name}' for model '{model}' is empty (shape "
            f"{shape_text(shape)}); send at least one token"
        )
    if raw is not None:
        expected = count * dtype.itemsize
        if len(raw) != expected:
            raise InvalidRequest(
                f"input byte size mismatch for input '{tensor.name}' for model '{model}'. "
                f"Expected {expected}, got {len(raw)}"
            )
        return torch.frombuffer(raw, dtype=dtype).view(shape)
    if dtype != torch.float32:
        raise InvalidRequest(
            f"inference input '{tensor.name}' for model '{model}': {tensor.datatype} data must "
            "travel in raw_input_contents (the protocol has typed contents for FP32 only)"
        )
    values = tensor.contents.fp32_contents
    if len(values) != count:
        raise InvalidRequest(
            f"unexpected number of fp32_contents for inference input '{tensor.name}' for model "
            f"'{model}', expecting {count} (shape {shape_text(shape)}), got {len(values)}"
        )
    return torch.tensor(values, dtype=torch.float32).view(shape)


def encode(t: torch.Tensor) -> bytes:
    """A CPU tensor's raw little-endian bytes (one copy)."""
    raw = t.detach().contiguous()
    return raw.view(_BYTE_VIEWS.get(raw.dtype, raw.dtype)).numpy().tobytes()


def output_tensor(name: str, t: torch.Tensor) -> pb.ModelInferResponse.InferOutputTensor:
    return pb.ModelInferResponse.InferOutputTensor(
        name=name, datatype=NAMES[t.dtype], shape=list(t.shape)
    )
