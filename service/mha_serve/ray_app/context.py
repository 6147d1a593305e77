"""A call that came through Ray, as the replica and the doors read it.

The call's gRPC context lives in Ray's proxy; the replica gets Ray's copy of its metadata,
peer and auth, and the deadline the proxy adds (proxy.py). `Caller` holds them (picklable:
it travels with a call forwarded to another replica); `CallContext` shows a Caller as the
read-only half of a grpc.aio.ServicerContext that the doors (transport/door.py) and
transport.auth.client_identity read. A replica's answer to a call made through a handle is
a `Reply`.
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
    # (None: stateless, ended or gone), which SequenceDirectory keeps.
    sequence_session: str | None = None


@dataclass(frozen=True)
class Caller:
    """Who made a call and by when they want the answer, as Ray's proxy saw it."""

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
    """A Caller as a grpc.aio.ServicerContext shows a call: its peer, metadata, auth and
    time remaining (what the doors read); abort records a status as grpcio would."""

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
