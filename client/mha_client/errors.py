"""The one exception the SDK raises for failed RPCs: a gRPC status code and the details."""

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
        """Wrap a grpc.RpcError (sync or aio); errors without a status read as UNKNOWN."""
        code_fn = getattr(err, "code", None)
        details_fn = getattr(err, "details", None)
        code = code_fn() if callable(code_fn) else None
        details = details_fn() if callable(details_fn) else None
        return cls(code or grpc.StatusCode.UNKNOWN, details or str(err), target)
