"""What the servicers need of a grpc.aio.ServicerContext, for a call that came via Ray.

A replica runs the very servicers the standalone server runs; the call's gRPC context lives
in Ray's proxy, so the servicer gets this stand-in, built from what the Ingress read off
Ray's context (Caller). `abort` records the status and raises grpc.aio.AbortError as grpcio
does; the replica sends the status back to the Ingress, which sets it on Ray's gRPC context,
and the proxy answers the client with it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import grpc

# gRPC metadata the proxy adds (grpc_services.py): the client's deadline, as wall-clock
# seconds (time.time()), which every process on every node reads alike (to NTP's accuracy).
DEADLINE_KEY = "x-mha-serve-deadline"


@dataclass
class Reply:
    """A replica's answer to one call: the response, or a status code and its details."""

    response: Any = None
    code: grpc.StatusCode | None = None  # None: OK
    details: str = ""
    # Open Inference Protocol: the session the request's sequence steps after the call
    # (None: stateless, ended or gone), which the Ingress keeps in SequenceDirectory.
    sequence_session: str | None = None


@dataclass(frozen=True)
class Caller:
    """Who made a call and by when they want the answer, as the Ingress saw it."""

    peer: str = ""
    metadata: tuple[tuple[str, str], ...] = ()
    auth: dict[str, Any] = field(default_factory=dict)  # mTLS names (auth_context())
    deadline: float | None = None  # time.time() past which the client no longer waits

    @classmethod
    def of(cls, context: Any) -> Caller:
        """From Ray's RayServegRPCContext (or any grpc ServicerContext)."""
        metadata = tuple(
            (k, v) for k, v in context.invocation_metadata() or () if isinstance(v, str)
        )
        deadlines = [float(v) for k, v in metadata if k == DEADLINE_KEY and _number(v)]
        return cls(
            peer=context.peer(),
            metadata=tuple(kv for kv in metadata if kv[0] != DEADLINE_KEY),
            auth=dict(context.auth_context() or {}),
            deadline=min(deadlines, default=None),
        )

    def time_remaining(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.time()


def _number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


class CallContext:
    """The servicer's view of one call: the caller's peer, metadata and deadline."""

    def __init__(self, caller: Caller | str = "") -> None:
        self.caller = Caller(peer=caller) if isinstance(caller, str) else caller
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
        return self.caller.time_remaining()

    def done(self) -> bool:
        return False

    def peer(self) -> str:
        return self.caller.peer

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.caller.metadata

    def auth_context(self) -> dict[str, Any]:
        return self.caller.auth

    def reply(self, response: Any = None) -> Reply:
        return Reply(response, self.code, self.details)
