"""Direct streams: an open stream's messages sent from Ray's proxy to its replica over one
gRPC stream, once Ray Serve has routed the stream there (docs/ray.md, "Streams").

Ray Serve carries a bidirectional stream's messages one Ray actor call each (the replica
asks the proxy for every message) and each reply as a streamed Ray object, through Serve's
request path: milliseconds per decode step. Here Serve still routes the stream (SessionRouter,
in the proxy), counts it as one ongoing request on its replica for its whole life (load,
autoscaling, draining) and ends it; only the messages take a shorter road. The replica's
stream method offers its direct server's address and a one-time token (trailing metadata
of an empty first message, which the proxy keeps to itself); the proxy opens one gRPC stream
to that address with the token, sends the client's messages on it and the replies back; when
it ends, so does the Serve request. A replica with direct streams off, or a proxy that does
not ask for them, keeps Ray's own road.

The token is 128 random bits, used once and withdrawn when no proxy takes it in
OFFER_TIMEOUT_S. The server listens on the node's address (other nodes' proxies reach it),
as Ray's own ports do, without TLS, as Ray's own traffic by default.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from mha_serve.ray_app.forward import CARRIER
from mha_serve.transport.handlers import lenient

log = logging.getLogger(__name__)

ASK_KEY = "x-mha-serve-direct"  # the proxy's request metadata: it can take an offer
OFFER_KEY = "x-mha-serve-direct-offer"  # the replica's trailing metadata: "address token"
TOKEN_KEY = "x-mha-serve-token"  # the direct call's metadata
ANSWERED_KEY = "x-mha-serve-answered"  # the direct call's trailing metadata: the replica's status
SERVICE = "mha_serve.ray.DirectStream"
OFFER_TIMEOUT_S = 30.0
# What the proxy sends for a message that did not parse: bytes no message parses from, so
# the replica answers it as the standalone server does (INVALID_ARGUMENT, counted).
UNPARSABLE = b"\xff"
MAX_MESSAGE_BYTES = 512 * 2**20  # as RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH in the image
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]

Answer = Callable[[AsyncIterator[Any], grpc.aio.ServicerContext], AsyncIterator[Any]]


@dataclass
class Offer:
    """A stream Serve routed here, waiting for its proxy: `answer` runs it on the direct
    call; `done` is set once it has ended (or was never taken)."""

    answer: Answer
    done: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task | None = None  # the direct call's, once a proxy took the offer
    status: tuple[grpc.StatusCode, str] | None = None  # how the direct call ended


class DirectServer:
    """The replica's server of direct streams, one method per stream method (by name)."""

    def __init__(self, host: str, messages: dict[str, type]) -> None:
        self._offers: dict[str, Offer] = {}
        self._server = grpc.aio.server(options=CHANNEL_OPTIONS)
        handlers = {
            name: grpc.stream_stream_rpc_method_handler(
                self._serve,
                request_deserializer=lenient(message),
                response_serializer=_bytes_or_message,
            )
            for name, message in messages.items()
        }
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE, handlers),)
        )
        port = self._server.add_insecure_port(f"{host}:0")
        self.address = f"{host}:{port}"

    async def start(self) -> None:
        await self._server.start()

    async def stop(self) -> None:
        await self._server.stop(None)

    async def offer(self, answer: Answer, grpc_context: Any) -> AsyncIterator[Any]:
        """What the replica's stream method yields to Ray's proxy instead of its replies: the
        offer (OFFER_KEY on an empty message), then nothing until the direct stream, which
        `answer` runs, has ended, or no proxy took it in OFFER_TIMEOUT_S."""
        token = secrets.token_hex(16)
        offer = self._offers[token] = Offer(answer)
        grpc_context.set_trailing_metadata([(OFFER_KEY, f"{self.address} {token}")])
        asyncio.get_running_loop().call_later(OFFER_TIMEOUT_S, self._withdraw, token)
        try:
            yield CARRIER
            await offer.done.wait()
            if offer.status is not None:
                # Its status on Serve's request too: a client (the proxy) still writing when
                # the stream ends can read grpc's "Internal error from Core" instead of the
                # status (grpc aio), and then takes this one (proxy.py).
                grpc_context.set_code(offer.status[0])
                grpc_context.set_details(offer.status[1])
                yield CARRIER
        finally:  # Serve's request ended first (cancelled): so does its stream
            self._offers.pop(token, None)
            if offer.task is not None and not offer.task.done():
                offer.task.cancel()

    def _withdraw(self, token: str) -> None:
        offer = self._offers.pop(token, None)
        if offer is not None:
            log.warning("a direct stream offer was not taken in %.0f s", OFFER_TIMEOUT_S)
            offer.done.set()

    async def _serve(
        self, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        token = next((v for k, v in context.invocation_metadata() or () if k == TOKEN_KEY), "")
        offer = self._offers.pop(token, None)
        if offer is None:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "no such stream offer")
        context.set_trailing_metadata(((ANSWERED_KEY, "1"),))
        offer.task = asyncio.current_task()
        try:
            async for reply in offer.answer(requests, context):
                yield reply
            offer.status = (grpc.StatusCode.OK, "")
        except grpc.aio.AbortError:
            offer.status = (context.code(), context.details() or "")
            raise
        finally:
            offer.done.set()


def wants_direct(grpc_context: Any) -> bool:
    """Whether the proxy asked for a direct stream (it is ours, and can take the offer)."""
    return any(k == ASK_KEY for k, _ in grpc_context.invocation_metadata() or ())


def answered(trailing_metadata: Any) -> bool:
    """Whether a direct call's status is the replica's (not the transport's)."""
    return any(k == ANSWERED_KEY for k, _ in trailing_metadata or ())


def _bytes_or_message(reply: Any) -> bytes:
    return reply if isinstance(reply, bytes) else reply.SerializeToString()


# --- the proxy's side ------------------------------------------------------------------

_channels: dict[str, grpc.aio.Channel] = {}


def to_bytes(message: Any) -> bytes:
    """A parsed request as the direct call sends it (one that did not parse: UNPARSABLE)."""
    serialize = getattr(message, "SerializeToString", None)
    return UNPARSABLE if serialize is None else serialize()


async def forget(offer: str) -> None:
    """Closes the channel to an offer's address (its replica stopped or was cut off)."""
    channel = _channels.pop(offer.split(" ", 1)[0], None)
    if channel is not None:
        await channel.close()


def direct_call(offer: str, method: str, requests: AsyncIterator[Any], timeout: float | None):
    """Opens the direct stream an offer ("address token") names; its replies are bytes."""
    address, token = offer.split(" ", 1)
    channel = _channels.get(address)
    if channel is None:
        channel = _channels[address] = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
    stream = channel.stream_stream(
        f"/{SERVICE}/{method}", request_serializer=to_bytes, response_deserializer=None
    )
    return stream(requests, metadata=((TOKEN_KEY, token),), timeout=timeout)
