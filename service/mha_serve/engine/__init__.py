"""The engine: hosted models and the synchronous forward of one request (no asyncio, no gRPC).

The torch-using names load on first use (PEP 562): the request and outcome types
(engine/requests.py) and the errors import without torch, for a frontend worker.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mha_serve.engine.errors import (
    Abandoned,
    DeadlinePassed,
    InvalidRequest,
    ModelNotFound,
    RequestError,
    TooLarge,
)
from mha_serve.engine.requests import (
    UNATTENDED,
    Array,
    AttendOutcome,
    AttendRequest,
    CacheInfo,
    CallState,
    HeadReport,
    ModelView,
)
from mha_serve.lazy import lazy_attributes

# name -> submodule that defines it
_LAZY = {
    "Engine": "engine",
    "choose_attention_kernels": "engine",
    "resolve_device": "engine",
    "resolve_dtype": "engine",
    "HostedModel": "types",
    "ModelSpec": "types",
    "Prepared": "types",
    "array_of": "types",
    "tensor_of": "types",
}

if TYPE_CHECKING:
    from mha_serve.engine.engine import (
        Engine,
        choose_attention_kernels,
        resolve_device,
        resolve_dtype,
    )
    from mha_serve.engine.types import HostedModel, ModelSpec, Prepared, array_of, tensor_of


__getattr__ = lazy_attributes(__name__, _LAZY, globals())


__all__ = [
    "UNATTENDED",
    "Abandoned",
    "Array",
    "AttendOutcome",
    "AttendRequest",
    "CacheInfo",
    "CallState",
    "DeadlinePassed",
    "Engine",
    "HeadReport",
    "HostedModel",
    "InvalidRequest",
    "ModelNotFound",
    "ModelSpec",
    "ModelView",
    "Prepared",
    "RequestError",
    "TooLarge",
    "array_of",
    "choose_attention_kernels",
    "resolve_device",
    "resolve_dtype",
    "tensor_of",
]
