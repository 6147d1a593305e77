"""Opening a channel to mha-serve: plaintext, TLS, mutual TLS, and a bearer token."""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from mha_client.errors import InvalidArgumentError


@dataclass(frozen=True)
class ChannelSecurity:
    """How a client proves who the server and the client are. The default is plaintext.

    tls: TLS with the system's root certificates (or ca_file's); ca_file alone implies it.
    cert_file, key_file: this client's PEM certificate and key (mutual TLS).
    token: a bearer token sent with every call ("authorization: Bearer <token>"). Over
    plaintext only to a loopback address or a unix socket: anywhere else it would cross the
    network readable.
    """

    tls: bool = False
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    token: str | None = field(default=None, repr=False)  # never printed

    def __post_init__(self) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            raise InvalidArgumentError("cert_file and key_file go together (mutual TLS): give both")
        if self.token is not None and not self.token.strip():
            raise InvalidArgumentError("token is empty")

    @property
    def uses_tls(self) -> bool:
        return self.tls or bool(self.ca_file or self.cert_file)

    @classmethod
    def from_files(
        cls,
        *,
        tls: bool = False,
        ca_file: str | None = None,
        cert_file: str | None = None,
        key_file: str | None = None,
        token_file: str | None = None,
        token: str | None = None,
    ) -> ChannelSecurity:
        """As the CLI gives them: a token read from token_file (its first line) wins."""
        if token_file:
            lines = Path(token_file).read_text().split()
            if not lines:
                raise InvalidArgumentError(f"token file {token_file} is empty")
            token = lines[0]
        return cls(tls, ca_file or None, cert_file or None, key_file or None, token or None)

    def credentials(self, target: str) -> grpc.ChannelCredentials | None:
        """The channel credentials for `target`; None: a plain insecure channel."""
        if self.uses_tls:
            creds = grpc.ssl_channel_credentials(
                root_certificates=_read(self.ca_file),
                private_key=_read(self.key_file),
                certificate_chain=_read(self.cert_file),
            )
        elif self.token is not None and target.startswith("unix:"):
            creds = grpc.local_channel_credentials(grpc.LocalConnectionType.UDS)
        elif self.token is not None:
            if not _is_loopback(target):
                raise InvalidArgumentError(
                    f"a bearer token over plaintext to {target} would cross the network "
                    "readable: use TLS (tls=True or ca_file; mha-client --tls / --ca-file)"
                )
            # Local credentials carry call credentials over loopback TCP without TLS.
            creds = grpc.local_channel_credentials(grpc.LocalConnectionType.LOCAL_TCP)
        else:
            return None
        if self.token is not None:
            creds = grpc.composite_channel_credentials(
                creds, grpc.access_token_call_credentials(self.token)
            )
        return creds


def open_channel(
    target: str,
    options: Sequence[tuple[str, Any]],
    *,
    aio: bool,
    credentials: grpc.ChannelCredentials | None = None,
    security: ChannelSecurity | None = None,
) -> Any:
    """The one place the SDK opens a channel (grpc.Channel, or grpc.aio.Channel when aio):
    explicit `credentials` win over `security`; neither: plaintext."""
    module = grpc.aio if aio else grpc
    if credentials is None and security is not None:
        credentials = security.credentials(target)
    if credentials is None:
        return module.insecure_channel(target, options=list(options))
    return module.secure_channel(target, credentials, options=list(options))


def _read(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path else None


def _is_loopback(target: str) -> bool:
    host = target.removeprefix("dns:///").removeprefix("ipv4:").removeprefix("ipv6:")
    if host.startswith("["):  # [::1]:port
        host = host[1:].partition("]")[0]
    elif host.count(":") == 1:
        host = host.partition(":")[0]
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
