"""Who may call, and who is calling: TLS credentials, the bearer-token interceptor and the
client identity that per-client limits count against.

Tokens come from a file (one per line) or MHA_SERVE_AUTH_TOKEN and are never logged: a
client's identity names a token only by the first hex digits of its SHA-256.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path

import grpc

from mha_serve import metrics
from mha_serve.config import ServerConfig

ENV_TOKEN = "MHA_SERVE_AUTH_TOKEN"
# Health answers without a token: load balancers and kubelets probe it with no secrets.
# So do the Open Inference Protocol's liveness and readiness (KServe's probes).
EXEMPT_PREFIXES = (
    "/grpc.health.v1.Health/",
    "/inference.GRPCInferenceService/ServerLive",
    "/inference.GRPCInferenceService/ServerReady",
)
ATTENTION_PREFIX = "/mha.v1.AttentionService/"
TOKEN_ID_HEX = 12  # hex digits of a token's SHA-256 that name it in identities and logs


def server_credentials(cfg: ServerConfig) -> grpc.ServerCredentials | None:
    """TLS (or mutual TLS with tls_client_ca_file) for the gRPC port; None: plaintext."""
    if not cfg.tls_cert_file:
        return None
    key = Path(cfg.tls_key_file).read_bytes()
    chain = Path(cfg.tls_cert_file).read_bytes()
    client_ca = Path(cfg.tls_client_ca_file).read_bytes() if cfg.tls_client_ca_file else None
    return grpc.ssl_server_credentials(
        [(key, chain)],
        root_certificates=client_ca,
        require_client_auth=client_ca is not None,
    )


def load_tokens(path: str, environ: Mapping[str, str] = os.environ) -> list[str]:
    """The accepted bearer tokens: the file's non-empty lines, else $MHA_SERVE_AUTH_TOKEN;
    none: no token is asked for."""
    if path:
        tokens = [line.strip() for line in Path(path).read_text().splitlines() if line.strip()]
        if not tokens:
            raise ValueError(f"auth_token_file {path!r} holds no token (one per line)")
        return tokens
    token = environ.get(ENV_TOKEN, "").strip()
    return [token] if token else []


def token_id(token: str) -> str:
    """A token's name where one is printed or counted: never the token itself."""
    return hashlib.sha256(token.encode()).hexdigest()[:TOKEN_ID_HEX]


def bearer(metadata: tuple[tuple[str, str | bytes], ...] | None) -> str | None:
    """The token of an "authorization: Bearer <token>" header, if any."""
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str):
            scheme, _, token = value.partition(" ")
            if scheme.lower() == "bearer" and token:
                return token.strip()
    return None


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call but health without a valid bearer token (UNAUTHENTICATED)."""

    def __init__(self, tokens: list[str]) -> None:
        if not tokens:
            raise ValueError("TokenInterceptor needs at least one token")
        self._tokens = [t.encode() for t in tokens]

    def valid(self, token: str | None) -> bool:
        if token is None:
            return False
        given = token.encode()
        # Every token compared, each in constant time: the time says nothing of which matched.
        return sum(hmac.compare_digest(given, t) for t in self._tokens) > 0

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        method = details.method
        if method.startswith(EXEMPT_PREFIXES):
            return await continuation(details)
        token = bearer(details.invocation_metadata)
        if self.valid(token):
            return await continuation(details)
        handler = await continuation(details)
        if handler is None:  # an unknown method: UNIMPLEMENTED, as without a token
            return None
        why = (
            "this server needs a bearer token: send metadata 'authorization: Bearer <token>' "
            "(mha-client --token-file; in Python, "
            "Client(target, security=ChannelSecurity(token=...)))"
            if token is None
            else "the bearer token is not valid here"
        )
        if method.startswith(ATTENTION_PREFIX):  # a bounded label set: our method names
            metrics.count_request(
                method.removeprefix(ATTENTION_PREFIX), "unknown", "UNAUTHENTICATED"
            )
        return _refusal(handler, why)


def _refusal(handler: grpc.RpcMethodHandler, why: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that answers UNAUTHENTICATED."""

    async def deny(_request: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

    kind = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(handler.request_streaming, handler.response_streaming)]
    return kind(deny)  # no deserializer: the refused request is never parsed


def client_identity(context: grpc.aio.ServicerContext) -> str:
    """Whom per-client limits count against: the mTLS certificate's name, else the bearer
    token (by its hash), else the peer's address without its port (a new connection does
    not make a new client)."""
    auth = context.auth_context()
    names = auth.get("x509_common_name") or auth.get("x509_subject_alternative_name")
    if names:
        return "cert:" + names[0].decode(errors="replace")
    token = bearer(tuple(context.invocation_metadata() or ()))
    if token is not None:
        return "token:" + token_id(token)
    return "peer:" + _host(context.peer())


def _host(peer: str) -> str:
    """'ipv4:127.0.0.1:5432' -> 'ipv4:127.0.0.1'; 'ipv6:[::1]:5432' -> 'ipv6:[::1]'."""
    head, sep, port = peer.rpartition(":")
    return head if sep and port.isdigit() and ":" in head else peer
