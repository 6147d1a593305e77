"""The SDK's exceptions: every error it raises is an MhaServeError, a gRPC status code and the
details, whether the server answered it or the client refused the call before sending."""

from __future__ import annotations

import grpc


class MhaServeError(Exception):
    """A failed mha-serve call; str() is "CODE: details", e.g. "INVALID_ARGUMENT: ...".

    `code` is the grpc.StatusCode, `details` the server's message (which says what it
    expected), and `target` the address the client was talking to.
    """

    def __init__(self, code: grpc.StatusCode, details: str, target: str = "") -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.target = target

    @classmethod
    def from_rpc_error(cls, err: grpc.RpcError, target: str = "") -> MhaServeError:
        """Wrap a grpc.RpcError (sync or aio); errors without a status read as UNKNOWN. A
        status without a message (grpc.health.v1's NOT_FOUND, a proxy's) says so, not the
        RpcError's repr."""
        code_fn = getattr(err, "code", None)
        details_fn = getattr(err, "details", None)
        code = code_fn() if callable(code_fn) else None
        details = details_fn() if callable(details_fn) else None
        if not details:
            details = f"{code.name}, with no message" if code is not None else str(err)
        return cls(code or grpc.StatusCode.UNKNOWN, details, target)


class InvalidArgumentError(MhaServeError, ValueError):
    """An argument the client refuses before sending anything (a non-float array, an unknown
    dtype, a float16 conversion that would overflow...): code INVALID_ARGUMENT, as the server
    answers what it refuses, and `target` "" (nothing was sent). Also a ValueError, which
    these checks raised before they were MhaServeErrors."""

    def __init__(self, details: str) -> None:
        super().__init__(grpc.StatusCode.INVALID_ARGUMENT, details)


class ReplyError(MhaServeError, ValueError):
    """A reply the client cannot read: not an AttendResponse, or one whose tensors do not
    match their own dtype and shape (a server or proxy speaking another version of the API, or
    bytes damaged on the way): code INTERNAL, as gRPC names a reply it cannot deserialize;
    details say what was wrong, and `target` who sent it. The call itself did run on the
    server (a session step was kept). Also a ValueError, which these raised before."""

    def __init__(self, details: str, target: str = "") -> None:
        super().__init__(
            grpc.StatusCode.INTERNAL, f"the server's reply cannot be read: {details}", target
        )


class ClosedError(MhaServeError, ValueError, RuntimeError):
    """A call on a Client or AsyncClient after close() (the end of its `with` block), or a
    step on a session stream after its close: code FAILED_PRECONDITION, nothing sent. Also a
    ValueError and a RuntimeError, what gRPC's closed channel and a closed stream raised."""

    def __init__(self, details: str, target: str = "") -> None:
        super().__init__(grpc.StatusCode.FAILED_PRECONDITION, details, target)
