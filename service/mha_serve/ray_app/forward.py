"""How a call made through a DeploymentHandle reaches AttentionReplica and comes back (a
Triton sequence's step forwarded to its replica, a session closed there): Ray's own
failures made statuses that say what happened (`lost`, which the proxy's wrapper uses too);
and how a replica's answer becomes what Ray's proxy sends (shared by mha.v1 and the Open
Inference Protocol)."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from ray.exceptions import ActorDiedError, RayActorError
from ray.serve import context as serve_context
from ray.serve.exceptions import BackPressureError
from ray.serve.grpc_util import RayServegRPCContext

from mha_serve.ray_app.context import Reply
from mha_serve.ray_app.ids import replica_of


def calls(handle: Any, method: str) -> Any:
    """A handle calling `method` of its deployment's replicas, as Ray actor calls. (Ray's
    inter-deployment gRPC, `_by_reference=False`, measured no cheaper per call here and caps
    messages at 4 MiB unless configured: docs/ray.md, Benchmark.)"""
    return handle.options(method_name=method)


async def forward(
    handle: Any,
    *args: Any,
    session_id: str = "",
    what: str = "",
    alive: Callable[[str], Awaitable[bool]] | None = None,
) -> Reply:
    """handle.remote(*args), a call to AttentionReplica answering a Reply. session_id: the
    session the call is pinned to (what: its name for the client, a Triton sequence);
    alive(replica id): whether that replica still runs, asked when Ray reports it
    unreachable (ActorUnavailableError): a replica restarting or briefly cut off keeps its
    sessions, so that is UNAVAILABLE (retry), and NOT_FOUND only once it is really gone."""
    response = handle.remote(*args)
    try:
        return await response
    except asyncio.CancelledError:  # the caller left: so does the call (a step rolls back)
        response.cancel()
        raise
    except BackPressureError as e:
        return Reply(code=grpc.StatusCode.RESOURCE_EXHAUSTED, details=str(e))
    except RayActorError as e:
        owner = replica_of(session_id) if session_id else None
        live = None
        if owner is not None and not isinstance(e, ActorDiedError):
            live = alive is None or await alive(owner)
        return lost(f"{type(e).__name__}: {first_line(e)}", session_id, what, alive=live)


def lost(failure: str, session_id: str = "", what: str = "", *, alive: bool | None) -> Reply:
    """The answer to a call that Ray failed on its replica (failure: Ray's words): for a
    session, NOT_FOUND once its replica is gone (alive False or None: it died), UNAVAILABLE
    while it still runs (a retry reaches it); without one, UNAVAILABLE. what: the session's
    name for the client (a Triton sequence)."""
    owner = replica_of(session_id) if session_id else None
    if owner is None:
        return Reply(
            code=grpc.StatusCode.UNAVAILABLE,
            details=f"the replica serving this call stopped or is unreachable ({failure}); retry",
        )
    named = f"{what} (session {session_id!r})" if what else f"session {session_id!r}"
    if alive:
        return Reply(
            code=grpc.StatusCode.UNAVAILABLE,
            details=f"the Ray Serve replica {owner!r} holding {named} did not answer "
            f"({failure}), but it still runs: retry",
        )
    again = "start it again with sequence_start" if what else "create a new session"
    return Reply(
        code=grpc.StatusCode.NOT_FOUND,
        details=f"{named} is gone: its Ray Serve replica {owner!r} stopped during this "
        f"call, and its KV cache went with it ({failure.split(':', 1)[0]}); {again} and "
        "send its tokens again",
    )


def first_line(e: Exception | str) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else ""


def own_request_id() -> None:
    """Gives the calls this task makes through handles a request id of their own.

    A handle call inherits the id of the request the replica is serving (Ray 2.60:
    default_impl.get_request_metadata reads the serve request context), and the router
    finds a call's pending request by that id: calls made at once for one request (a
    ModelStreamInfer's messages, in flight together) would share it, and the replica
    chosen for one would go to another, or none (seen: a stream stuck for its deadline).
    The context is a contextvar, so this holds for the calling task alone. Ray cancels a
    request's calls by its id when the request is cancelled; these no longer carry it, so
    `forward` cancels its call itself when its task is cancelled."""
    context = serve_context._get_serve_request_context()
    fresh = dataclasses.replace(context, _internal_request_id=str(uuid.uuid4()))
    serve_context._serve_request_context.set(fresh)


def end_stream(grpc_context: RayServegRPCContext, reply: Reply) -> Any:
    """The last message of a stream that ends with the reply's status: the status set on
    Ray's context and carried to the proxy by an empty message, which the proxy drops
    (proxy.py): the client gets the status alone. (Raising instead would log a traceback
    in the proxy for every stream that ends with an error.)"""
    grpc_context.set_code(reply.code)
    grpc_context.set_details(reply.details)
    return CARRIER


def unary_answer(grpc_context: RayServegRPCContext, reply: Reply) -> Any:
    """What a unary method returns to Ray's proxy: the response, or its status set on Ray's
    context and an empty message (not sent: the client gets the status alone)."""
    if reply.code is None:
        return message(reply.response)
    grpc_context.set_code(reply.code)
    grpc_context.set_details(reply.details)
    return CARRIER


class Serialized:
    """A reply the servicer sent already serialized, as Ray's replica wants a message: it
    calls SerializeToString() and the proxy sends those bytes."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    def SerializeToString(self) -> bytes:
        return self.data


async def peek(requests: Any) -> tuple[AsyncIterator[Any], Any]:
    """A stream's first message (None when it is empty) and the stream, whole."""
    iterator = requests.__aiter__()
    try:
        first = await iterator.__anext__()
    except StopAsyncIteration:
        return _chain((), iterator), None
    return _chain((first,), iterator), first


async def _chain(head: tuple[Any, ...], rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    for item in head:
        yield item
    async for item in rest:
        yield item


CARRIER = Serialized(b"")  # end_stream's message


def too_large(request: Any, limit: int) -> Reply | None:
    """RESOURCE_EXHAUSTED for a request larger than the server's max_receive_message_bytes,
    in gRPC's words, as the standalone server's gRPC refuses it. Ray's proxy takes messages
    up to 2 GiB (RAY_SERVE_GRPC_MAX_MESSAGE_SIZE, its sends alike), so the replica checks."""
    size_of = getattr(request, "ByteSize", None)  # (a Malformed has none: the door answers)
    size = size_of() if size_of is not None else 0
    if not limit or size <= limit:
        return None
    return Reply(
        code=grpc.StatusCode.RESOURCE_EXHAUSTED,
        details=f"Received message larger than max ({size} vs. {limit})",
    )


class UpToLimit:
    """A stream's requests up to the first too_large one, which ends it (`refused`: why),
    as gRPC ends a standalone server's stream."""

    def __init__(self, requests: AsyncIterator[Any], limit: int) -> None:
        self._requests = requests.__aiter__()
        self._limit = limit
        self.refused: Reply | None = None

    def __aiter__(self) -> UpToLimit:
        return self

    async def __anext__(self) -> Any:
        if self.refused is not None:
            raise StopAsyncIteration
        request = await self._requests.__anext__()
        self.refused = too_large(request, self._limit)
        if self.refused is not None:
            raise StopAsyncIteration
        return request


def message(response: Any) -> Any:
    return Serialized(response) if isinstance(response, bytes | bytearray) else response
