"""The engine: hosted models and the synchronous forward of one request (no asyncio, no gRPC)."""

from mha_serve.engine.engine import Engine, resolve_device, resolve_dtype
from mha_serve.engine.errors import (
    Abandoned,
    DeadlinePassed,
    InvalidRequest,
    ModelNotFound,
    RequestError,
    TooLarge,
)
from mha_serve.engine.types import AttendCall, AttendResult, HostedModel, ModelSpec

__all__ = [
    "Abandoned",
    "AttendCall",
    "DeadlinePassed",
    "AttendResult",
    "Engine",
    "HostedModel",
    "InvalidRequest",
    "ModelNotFound",
    "ModelSpec",
    "RequestError",
    "TooLarge",
    "resolve_device",
    "resolve_dtype",
]
