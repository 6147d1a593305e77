"""Registers a servicer's methods with request parsing that never raises.

grpcio answers a request whose bytes do not parse with UNKNOWN and logs a traceback for
each one, so a client sending garbage fills the operator's disk. Here a parse failure
becomes a `Malformed` request: the method answers INVALID_ARGUMENT naming the message
type, and the log gets at most one summary line per LOG_EVERY_S (MalformedLog).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf.descriptor import ServiceDescriptor

from mha_serve.transport.drain import Drain

log = logging.getLogger(__name__)

LOG_EVERY_S = 60.0  # at most one line about malformed requests per this many seconds


class Malformed:
    """A request whose bytes are not a valid message of its type."""

    __slots__ = ("error", "type_name")

    def __init__(self, type_name: str, error: Exception) -> None:
        self.type_name = type_name
        self.error = error

    @property
    def message(self) -> str:
        return f"request is not a valid {self.type_name} message ({self.error})"


class MalformedLog:
    """Counts malformed requests; logs the first at once and then one summary line per
    `every_s` at most, whatever the rate (a hostile client cannot grow the log)."""

    def __init__(self, every_s: float = LOG_EVERY_S, clock: Callable[[], float] = time.monotonic):
        self.every_s = every_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last_logged: float | None = None
        self._unlogged = 0

    def note(self, method: str, peer: str, bad: Malformed) -> None:
        with self._lock:
            now = self._clock()
            self._unlogged += 1
            if self._last_logged is not None and now - self._last_logged < self.every_s:
                return
            count, self._unlogged, self._last_logged = self._unlogged, 0, now
        log.warning(
            "%d malformed request(s) answered INVALID_ARGUMENT%s; latest: %s from %s: %s",
            count,
            "" if count == 1 else f" in the last {self.every_s:g} s",
            method,
            peer,
            bad.message,
        )


def lenient(
    message_cls: Any, parser: Callable[[bytes], Any] | None = None
) -> Callable[[bytes], Any]:
    """message_cls.FromString (or `parser`), returning Malformed instead of raising."""
    type_name = message_cls.DESCRIPTOR.full_name
    parser = parser or message_cls.FromString

    def parse(data: bytes) -> Any:
        try:
            return parser(data)
        except Exception as e:  # protobuf's DecodeError, or anything its parser raises
            return Malformed(type_name, e)

    return parse


def add_service(
    server: grpc.aio.Server,
    servicer: Any,
    service: ServiceDescriptor,
    messages: Any,
    *,
    drain: Drain | None = None,
    always_answered: tuple[str, ...] = (),
) -> None:
    """Registers servicer's method for each of `service`'s methods (named alike), with
    lenient parsing; `messages` is the generated _pb2 module holding the message classes.
    The servicer's methods must answer a Malformed request themselves (`reject`). With a
    `drain`, each method but those `always_answered` (a protocol's own health checks) refuses
    new calls once the server drains, and past the drain's max_calls at once (drain.py; the
    servicer names its metrics' `PROTOCOL`).

    A servicer's `request_parsers` (method name -> parse(bytes)) replace FromString for those
    methods; any method may answer bytes, which are sent as they are (already serialized)."""
    parsers = getattr(servicer, "request_parsers", {})
    handlers = {}
    for method in service.methods:
        request_cls = getattr(messages, method.input_type.name)
        response_cls = getattr(messages, method.output_type.name)
        kind = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[(method.client_streaming, method.server_streaming)]
        handler = getattr(servicer, method.name)
        if drain is not None and method.name not in always_answered:
            handler = drain.guard(
                handler,
                method=method.name,
                protocol=servicer.PROTOCOL,
                request_streaming=method.client_streaming,
                response_streaming=method.server_streaming,
            )
        handlers[method.name] = kind(
            handler,
            request_deserializer=lenient(request_cls, parsers.get(method.name)),
            response_serializer=_serializer(response_cls),
        )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),)
    )
    server.add_registered_method_handlers(service.full_name, handlers)


def _serializer(message_cls: Any) -> Callable[[Any], bytes]:
    """message_cls.SerializeToString, passing bytes through (a response framed by hand)."""
    serialize = message_cls.SerializeToString

    def run(response: Any) -> bytes:
        return response if isinstance(response, bytes) else serialize(response)

    return run
