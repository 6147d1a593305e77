"""Open Inference Protocol tensors <-> Array (engine/requests.py): datatype strings, raw
bytes and typed contents. No torch."""

from __future__ import annotations

import math

import numpy as np

from mha_client.api.inference import grpc_service_pb2 as pb
from mha_client.api.inference import model_config_pb2 as mc
from mha_serve.engine.errors import InvalidRequest
from mha_serve.engine.requests import ITEMSIZES, Array

# The protocol's datatype strings for the dtypes mha-serve takes and returns.
DATATYPES = {"FP32": "float32", "FP16": "float16", "BF16": "bfloat16"}
NAMES = {dtype: name for name, dtype in DATATYPES.items()}
CONFIG_TYPES = {"float32": mc.TYPE_FP32, "float16": mc.TYPE_FP16, "bfloat16": mc.TYPE_BF16}


def shape_text(shape: list[int]) -> str:
    """[-1,-1,512] as Triton writes shapes in its messages."""
    return "[" + ",".join(str(d) for d in shape) + "]"


def decode(tensor: pb.ModelInferRequest.InferInputTensor, raw: bytes | None, model: str) -> Array:
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
        expected = count * ITEMSIZES[dtype]
        if len(raw) != expected:
            raise InvalidRequest(
                f"input byte size mismatch for input '{tensor.name}' for model '{model}'. "
                f"Expected {expected}, got {len(raw)}"
            )
        return Array.frombuffer(raw, dtype, shape)
    if dtype != "float32":
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
    return Array(np.array(values, dtype=np.float32).reshape(shape), "float32")


def encode(a: Array) -> bytes:
    """An Array's raw little-endian bytes (one copy)."""
    return a.tobytes()


def output_tensor(name: str, a: Array) -> pb.ModelInferResponse.InferOutputTensor:
    return pb.ModelInferResponse.InferOutputTensor(
        name=name, datatype=NAMES[a.dtype], shape=list(a.shape)
    )
