"""What AttentionServicer needs of a grpc.aio.ServicerContext, for a call that came via Ray.

A replica runs the very servicer the standalone server runs; the call's gRPC context lives
in Ray's proxy, so the servicer gets this stand-in. `abort` records the status and raises
grpc.aio.AbortError as grpcio does; the replica sends the status back to the Ingress, which
sets it on Ray's gRPC context, and the proxy answers the client with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grpc


@dataclass
class Reply:
    """A replica's answer to one call: the response, or a status code and its details."""

    response: Any = None
    code: grpc.StatusCode | None = None  # None: OK
    details: str = ""


class CallContext:
    """The servicer's view of one call; Ray's proxy does not pass the client's deadline on,
    so there is none here (the proxy's request_timeout_s bounds the call instead)."""

    def __init__(self, peer: str = "", metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self._peer = peer
        self._metadata = metadata
        self.code: grpc.StatusCode | None = None
        self.details = ""

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        self.code, self.details = code, details
        raise grpc.aio.AbortError()

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details

    def time_remaining(self) -> float | None:
        return None

    def done(self) -> bool:
        return False

    def peer(self) -> str:
        return self._peer

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def auth_context(self) -> dict[str, Any]:
        return {}

    def reply(self, response: Any = None) -> Reply:
        return Reply(response, self.code, self.details)
