"""The gRPC services Ray's proxy registers (serve_config.yaml `grpc_servicer_functions`).

mha.v1 and the Open Inference Protocol are registered with the standalone server's lenient
parsing (transport/handlers.py): bytes that are no valid message reach the servicer as
Malformed and answer INVALID_ARGUMENT naming the type, as on the standalone server. Ray's
proxy keeps each method's request parser and replaces its behaviour with a call to the
Ingress. These functions run in the proxy's process, which is also where the client's
deadline is known: `forward_deadlines` passes it on as metadata (context.DEADLINE_KEY).
"""

from __future__ import annotations

import functools
import inspect
import time
from types import SimpleNamespace
from typing import Any

from mha_client.api import attention_pb2 as pb
from mha_client.api.inference import grpc_service_pb2 as oip_pb
from mha_serve.ray_app.context import DEADLINE_KEY
from mha_serve.transport.handlers import add_service

SERVICE = pb.DESCRIPTOR.services_by_name["AttentionService"]
OIP_SERVICE = oip_pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]


def _never_called(*_: Any) -> None:
    raise AssertionError("Ray's proxy replaces every method's behaviour")


def add_attention_service(servicer: Any, server: Any) -> None:
    """Ray calls this with a unittest.mock servicer; only the method table matters. A plain
    stand-in takes its place: a Mock answers every attribute add_service looks up (its
    optional hooks too) with another Mock, which would then parse requests. Requests parse
    into plain messages here: the proxy pickles each on its way to a replica."""
    _add(server, SERVICE, pb)


def add_inference_service(servicer: Any, server: Any) -> None:
    """inference.GRPCInferenceService (KServe v2 / Triton), as add_attention_service."""
    _add(server, OIP_SERVICE, oip_pb)


def _add(server: Any, service: Any, messages: Any) -> None:
    forward_deadlines(server)
    stand_in = SimpleNamespace(**{method.name: _never_called for method in service.methods})
    add_service(server, stand_in, service, messages)


def forward_deadlines(server: Any) -> None:
    """Makes Ray's proxy pass each call's deadline on: Ray 2.60 copies a call's metadata,
    peer and auth into the context its deployments get, but not the time remaining. The
    proxy's server builds each method's behaviour with `service_handler_factory` (Ray's
    gRPCGenericServer); wrapped here, every call's context shows the deadline as metadata.
    Without that attribute (another Ray) calls go on without deadlines, as before."""
    factory = getattr(server, "service_handler_factory", None)
    if factory is None or getattr(factory, "forwards_deadlines", False):
        return

    @functools.wraps(factory)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        return _with_deadline(factory(*args, **kwargs))

    wrapped.forwards_deadlines = True  # type: ignore[attr-defined]
    server.service_handler_factory = wrapped


def _with_deadline(handler: Any) -> Any:
    if inspect.isasyncgenfunction(handler):

        async def stream(request: Any, context: Any) -> Any:
            async for message in handler(request, Deadlined(context)):
                yield message

        return stream

    async def unary(request: Any, context: Any) -> Any:
        return await handler(request, Deadlined(context))

    return unary


class Deadlined:
    """A grpc.aio ServicerContext whose metadata also says when the client stops waiting
    (a client's own DEADLINE_KEY is dropped: only the proxy says it)."""

    def __init__(self, context: Any) -> None:
        self._context = context

    def invocation_metadata(self) -> tuple[tuple[str, Any], ...]:
        metadata = tuple(
            kv for kv in self._context.invocation_metadata() or () if kv[0] != DEADLINE_KEY
        )
        remaining = self._context.time_remaining()
        if remaining is None:
            return metadata
        return (*metadata, (DEADLINE_KEY, repr(time.time() + remaining)))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)
