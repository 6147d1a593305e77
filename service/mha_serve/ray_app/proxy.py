"""What runs inside Ray Serve's gRPC proxy, around each call's handler (grpc_services.py
installs it on the proxy's server; docs/ray.md, "How a call travels").

Ray's proxy builds each method's handler with its `service_handler_factory` and routes a
call through its handle to the application's ingress deployment (AttentionReplica), with
that deployment's router (SessionRouter) running here, in the proxy. Around each handler:

- the call's session rides in the `session_id` metadata, which Ray hands to the router
  (RequestMetadata.session_id): a unary call's from its request; a StreamSession's from its
  first message, read before the stream is handed on (Ray routes a stream when the handler
  starts); a Triton sequence's step from SequenceDirectory. Whatever `session_id` a client
  sent is dropped. The client's deadline rides as DEADLINE_KEY (Ray copies metadata, peer
  and auth to its deployments, not the time remaining);
- grpc.health.v1 is answered here, from the proxy's own view of the application, taking no
  replica slot;
- the status is held until the call ends: a failure Ray's proxy would answer INTERNAL (the
  replica died or became unreachable mid-call, `RayActorError`) becomes NOT_FOUND or
  UNAVAILABLE saying what happened (forward.lost), and a stream's status carrier
  (forward.end_stream) is dropped.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from grpc_health.v1 import health_pb2

from mha_serve.ray_app.context import DEADLINE_KEY
from mha_serve.ray_app.direct import ASK_KEY, OFFER_KEY, answered, direct_call, forget
from mha_serve.ray_app.forward import first_line, lost, peek
from mha_serve.ray_app.ids import replica_of

log = logging.getLogger(__name__)

SESSION_KEY = "session_id"  # the metadata key Ray's proxy gives the router
HEALTH_PREFIX = "/grpc.health.v1.Health/"
# grpc.health.v1 names: SERVING for these once the application's replicas run.
HEALTH_SERVICES = frozenset({"", "mha.v1.AttentionService", "inference.GRPCInferenceService"})
WATCH_PERIOD_S = 1.0  # how often Watch looks at the application again
STREAM_ROUTED = "/mha.v1.AttentionService/StreamSession"  # routed by its first message
DIRECT_METHODS = frozenset({"StreamSession", "ModelStreamInfer"})  # direct.py
SEQUENCE_STEP = "/inference.GRPCInferenceService/ModelInfer"  # may step a Triton sequence
DIRECTORY = "SequenceDirectory"
UNARY = "unary_unary"  # Ray's gRPCStreamingType values
STREAMS = ("unary_stream", "stream_stream")


def install(server: Any) -> None:
    """Wraps the proxy's handler factory (Ray's gRPCGenericServer); once per server. On a
    server without one (another Ray, or grpcio's own) calls go on as they are."""
    factory = getattr(server, "service_handler_factory", None)
    if factory is None or getattr(factory, "mha_serve", False):
        return
    proxy = getattr(factory, "__self__", None)  # Ray's gRPCProxy: its routes and draining

    @functools.wraps(factory)
    def wrapped(service_method: str, streaming_type: Any) -> Any:
        kind = getattr(streaming_type, "value", streaming_type)
        if service_method.startswith(HEALTH_PREFIX):
            return _health(proxy, service_method, kind)
        handler = factory(service_method=service_method, streaming_type=streaming_type)
        return _routed(handler, proxy, service_method, kind)

    wrapped.mha_serve = True  # type: ignore[attr-defined]
    server.service_handler_factory = wrapped


# --- routing ---------------------------------------------------------------------------


def _routed(handler: Any, proxy: Any, service_method: str, kind: str) -> Any:
    if kind == UNARY:

        async def unary(request: Any, context: Any) -> Any:
            session_id = await _session_of(proxy, service_method, request, context)
            call = Call(context, session_id)
            response = await handler(request, call)
            return b"" if await call.finish() else response

        return unary
    if kind in STREAMS:

        async def stream(requests: Any, context: Any) -> AsyncIterator[Any]:
            session_id = ""
            if service_method == STREAM_ROUTED:
                requests, first = await peek(requests)
                session_id = _field(first)
            method = service_method.rsplit("/", 1)[-1]
            call = Call(context, session_id, direct=method in DIRECT_METHODS)
            replies = handler(requests, call)
            async for message in replies:
                if call.offer is not None:  # the replica's: the messages go direct
                    async for reply in _direct(call, method, requests, context, replies):
                        yield reply
                    break
                if not call.carries_status():
                    yield message
            await call.finish()

        return stream
    return handler  # client streaming: no method of ours


async def _direct(
    call: Call, method: str, requests: Any, context: Any, replies: Any
) -> AsyncIterator[Any]:
    """The stream's messages and replies over the direct stream its replica offered, for as
    long as Serve's request for it lasts (`replies`, Ray's handler: it ends when the
    replica's stream ends, or fails when the replica stops, and then the direct stream
    ends too). Its status is the replica's, or (the stream broke, or Ray failed the
    request) the replica's loss, told in finish."""
    request = asyncio.ensure_future(_drain(replies))
    stream = direct_call(call.offer, method, requests, context.time_remaining())

    def ended(_: Any) -> None:  # Ray failed the request: the replica stopped (or was cut off)
        if call.code() not in (None, grpc.StatusCode.OK) and not call.from_replica:
            stream.cancel()

    request.add_done_callback(ended)
    try:
        async for reply in stream:
            yield reply
        call.settled = answered(await stream.trailing_metadata())
    except grpc.aio.AioRpcError as e:
        if answered(e.trailing_metadata()):
            call.set_code(e.code())
            call.set_details(e.details())
            call.from_replica = call.settled = True
        else:  # no answer from the replica: it stopped or was cut off (finish says which)
            call.broken = f"{e.code().name}: {first_line(e.details() or '')}"
            log.warning("the direct stream to %s broke: %s", call.offer.split(" ")[0], call.broken)
            await forget(call.offer)
    except asyncio.CancelledError:
        if not request.done():  # the client left
            request.cancel()
            raise
        call.broken = "Ray ended the replica's request during its stream"
    await request


async def _drain(replies: Any) -> None:
    async for _ in replies:
        pass


async def _session_of(proxy: Any, service_method: str, request: Any, context: Any) -> str:
    """The session a unary call is routed by: its request's, or its Triton sequence's."""
    if service_method == SEQUENCE_STEP:
        return await _sequence_session(proxy, request, context)
    return _field(request)


def _field(request: Any) -> str:
    session_id = getattr(request, "session_id", "")  # Malformed, or a message without one
    return session_id if isinstance(session_id, str) else ""


async def _sequence_session(proxy: Any, request: Any, context: Any) -> str:
    """The session a Triton sequence's step (not its start) goes to, from SequenceDirectory:
    the step then takes one hop. "" when there is none (the replica answers why)."""
    from mha_serve.transport.auth import client_identity
    from mha_serve.transport.oip.door import sequence_key_of
    from mha_serve.transport.oip.sequences import sequence_of

    try:
        sequence = sequence_of(request.parameters)
    except Exception:  # Malformed, or bad controls: the replica answers them
        return ""
    handle = _app_handle(proxy, context)
    if sequence is None or sequence.start or handle is None:
        return ""
    key = sequence_key_of(request.model_name, client_identity(context), sequence)
    try:
        return await _directory(handle.deployment_id.app_name).remote(key) or ""
    except Exception as e:  # the replica looks it up again
        log.warning("SequenceDirectory lookup failed: %r", e)
        return ""


_directories: dict[str, Any] = {}


def _directory(app: str) -> Any:
    """SequenceDirectory's `get` in that application (one handle, and router, per app)."""
    if app not in _directories:
        from ray import serve

        handle = serve.get_deployment_handle(DIRECTORY, app)
        _directories[app] = handle.options(method_name="get")
    return _directories[app]


def _app_handle(proxy: Any, context: Any) -> Any:
    """The proxy's handle to the application a call names (its `application` metadata, or
    the only one), None when none matches or the proxy is not Ray 2.60's."""
    router = getattr(proxy, "proxy_router", None)
    if router is None:
        return None
    app = next((v for k, v in context.invocation_metadata() or () if k == "application"), "")
    route = router.get_handle_for_endpoint(app)
    return None if route is None else route[1]


# --- the call's context and status -------------------------------------------------------


class Call:
    """The call's grpc context as Ray's handler sees it: metadata with the routing session
    and the deadline; the status Ray sets held until `finish` has looked at it."""

    def __init__(self, context: Any, session_id: str, direct: bool = False) -> None:
        self._context = context
        self.session_id = session_id
        metadata = [
            kv
            for kv in context.invocation_metadata() or ()
            if kv[0] not in (SESSION_KEY, DEADLINE_KEY, ASK_KEY)
        ]
        if session_id:
            metadata.append((SESSION_KEY, session_id))
        if direct:
            metadata.append((ASK_KEY, "1"))
        now = time.time()  # read first: a pause before time_remaining() errs early, not late
        remaining = context.time_remaining()
        if remaining is not None:
            metadata.append((DEADLINE_KEY, repr(now + remaining - grpc_rounding(remaining))))
        self._metadata = tuple(metadata)
        self._code: grpc.StatusCode | None = None
        self._details = ""
        self.from_replica = False  # the code came with the replica's answer
        self.offer: str | None = None  # a direct stream's "address token" (direct.py)
        self.broken = ""  # the direct stream broke, in these words
        # The replica's own status came over the direct stream: what Ray then says of the
        # Serve request (it can fail as a stopping replica exits) is no longer the answer.
        self.settled = False

    def invocation_metadata(self) -> tuple[tuple[str, Any], ...]:
        return self._metadata

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def details(self) -> str:
        return self._details

    def set_code(self, code: grpc.StatusCode) -> None:
        if self.settled:
            return
        self._code, self.from_replica = code, False

    def set_details(self, details: str) -> None:
        if not self.settled:
            self._details = details

    def set_trailing_metadata(self, metadata: Any) -> None:
        # Ray sets the replica's context (its code, then its trailing metadata: the request
        # id, always) on each answer; its own failure sets a code alone.
        self.from_replica = self._code is not None
        kept = []
        for key, value in metadata:
            if key == OFFER_KEY:
                self.offer = value
            else:
                kept.append((key, value))
        self._context.set_trailing_metadata(tuple(kept))

    def carries_status(self) -> bool:
        """Whether the message just answered is a status carrier: it came with an error."""
        return self.from_replica and self._code not in (None, grpc.StatusCode.OK)

    async def finish(self) -> bool:
        """Sends the status; whether it is an error. A failure Ray's proxy answered INTERNAL
        itself is a replica that stopped or was cut off during the call: said so."""
        code, details = self._code, self._details
        ray_failed = code == grpc.StatusCode.INTERNAL and not self.from_replica
        # A direct stream that broke as its replica ended it (grpc aio: "Internal error from
        # Core" to a client still writing) still has the replica's status, over Serve's road.
        broken = self.broken and not (self.from_replica and code is not None)
        if ray_failed or broken:
            failure = first_line(details) if ray_failed else self.broken
            log.warning("a call failed in Ray (%s): %s", self.session_id, failure)
            owner = replica_of(self.session_id) if self.session_id else None
            alive = None if owner is None else await asyncio.to_thread(replica_alive, owner)
            reply = lost(failure, self.session_id, alive=alive)
            code, details = reply.code, reply.details
        if code is not None:
            self._context.set_code(code)
            self._context.set_details(details)
        return code not in (None, grpc.StatusCode.OK)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


def grpc_rounding(remaining: float) -> float:
    """How much later than the client's own the deadline gRPC gives a server can be: a
    client sends its timeout rounded up to about three digits (grpc's timeout_encoding.cc:
    1 ms under a second, 10 ms under 10 s, 100 ms under 100 s, ...). Taken off, the deadline
    passed on is never later than the client's, at most that much earlier."""
    if remaining < 1.0:
        return 0.001
    return 10.0 ** (math.floor(math.log10(remaining)) - 2)


def replica_alive(unique_id: str) -> bool:
    """Whether a Serve replica of that unique id still lives (a GCS lookup: blocking)."""
    import ray

    suffix = f"#{unique_id}"
    return any(
        actor["name"].endswith(suffix)
        for actor in ray.util.list_named_actors(all_namespaces=True)
        if actor.get("namespace") == "serve"
    )


# --- grpc.health.v1 ----------------------------------------------------------------------


def _health(proxy: Any, service_method: str, kind: str) -> Any:
    status = health_pb2.HealthCheckResponse

    def check(request: Any, context: Any) -> Any:
        if request.service not in HEALTH_SERVICES:
            return None
        return status.SERVING if _serving(proxy, context) else status.NOT_SERVING

    if kind == UNARY:

        async def unary(request: Any, context: Any) -> Any:
            state = check(request, context)
            if state is None:
                await context.abort(
                    grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}"
                )
            return status(status=state).SerializeToString()

        return unary

    async def watch(request: Any, context: Any) -> AsyncIterator[Any]:
        last = None
        while True:
            state = check(request, context)
            state = status.SERVICE_UNKNOWN if state is None else state
            if state != last:
                yield status(status=state).SerializeToString()
                last = state
            await asyncio.sleep(WATCH_PERIOD_S)

    return watch


def _serving(proxy: Any, context: Any) -> bool:
    """The application answers through this proxy: it has a route and running replicas,
    and the proxy is not draining (Ray's own view; True where it cannot be read)."""
    if proxy is None or getattr(proxy, "proxy_router", None) is None:
        return True
    draining = getattr(proxy, "_is_draining", None)
    if draining is not None and draining():
        return False
    handle = _app_handle(proxy, context)
    return handle is not None and handle.running_replicas_populated()
