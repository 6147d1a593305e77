"""Engine, cache and batcher errors -> gRPC status codes (one table for every gRPC door)."""

from __future__ import annotations

import grpc

from mha_serve.batching import Closed, DeadlineExceeded, QueueFull
from mha_serve.cache import (
    CacheExhausted,
    ClientQuotaExceeded,
    InvalidSessionArgument,
    SessionBusy,
    SessionExists,
    SessionFull,
    SessionNotFound,
    SessionSpilled,
)
from mha_serve.engine import (
    Abandoned,
    DeadlinePassed,
    InvalidRequest,
    ModelNotFound,
    TooLarge,
)
from mha_serve.serving import Unavailable

# Looked up along the exception's class hierarchy; the first match wins.
STATUS_OF: dict[type[Exception], grpc.StatusCode] = {
    QueueFull: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Closed: grpc.StatusCode.UNAVAILABLE,
    DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    ModelNotFound: grpc.StatusCode.NOT_FOUND,
    DeadlinePassed: grpc.StatusCode.DEADLINE_EXCEEDED,
    Abandoned: grpc.StatusCode.CANCELLED,
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    TooLarge: grpc.StatusCode.RESOURCE_EXHAUSTED,
    SessionNotFound: grpc.StatusCode.NOT_FOUND,
    SessionFull: grpc.StatusCode.OUT_OF_RANGE,
    CacheExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ClientQuotaExceeded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    SessionBusy: grpc.StatusCode.ABORTED,
    SessionExists: grpc.StatusCode.ALREADY_EXISTS,
    # Brought back before any call answers; should one slip through, the client retries.
    SessionSpilled: grpc.StatusCode.UNAVAILABLE,
    InvalidSessionArgument: grpc.StatusCode.INVALID_ARGUMENT,
}


def status_of(error: Exception) -> grpc.StatusCode:
    for cls in type(error).__mro__:
        if cls in STATUS_OF:
            return STATUS_OF[cls]
    return grpc.StatusCode.INTERNAL
