"""The gRPC services Ray's proxy registers (serve_config.yaml `grpc_servicer_functions`).

mha.v1 is registered with the standalone server's lenient parsing (transport/handlers.py):
bytes that are no valid message reach the servicer as Malformed and answer INVALID_ARGUMENT
naming the type, as on the standalone server. Ray's proxy keeps each method's request
parser and replaces its behaviour with a call to the Ingress.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from mha_client.api import attention_pb2 as pb
from mha_serve.transport.handlers import add_service

SERVICE = pb.DESCRIPTOR.services_by_name["AttentionService"]


def _never_called(*_: Any) -> None:
    raise AssertionError("Ray's proxy replaces every method's behaviour")


def add_attention_service(servicer: Any, server: Any) -> None:
    """Ray calls this with a unittest.mock servicer; only the method table matters. A plain
    stand-in takes its place: a Mock answers every attribute add_service looks up (its
    optional hooks too) with another Mock, which would then parse requests. Requests parse
    into plain messages here: the proxy pickles each on its way to a replica."""
    del servicer
    stand_in = SimpleNamespace(**{method.name: _never_called for method in SERVICE.methods})
    add_service(server, stand_in, SERVICE, pb)
