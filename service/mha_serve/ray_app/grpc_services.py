"""The gRPC services Ray's proxy registers (serve_config.yaml `grpc_servicer_functions`).

mha.v1 is registered with the standalone server's lenient parsing (transport/handlers.py):
bytes that are no valid message reach the servicer as Malformed and answer INVALID_ARGUMENT
naming the type, as on the standalone server. Ray's proxy keeps each method's request
parser and replaces its behaviour with a call to the Ingress.
"""

from __future__ import annotations

from typing import Any

from mha_client.api import attention_pb2 as pb
from mha_serve.transport.handlers import add_service


def add_attention_service(servicer: Any, server: Any) -> None:
    """Ray calls this with a stand-in servicer; only the method table matters."""
    add_service(server, servicer, pb.DESCRIPTOR.services_by_name["AttentionService"], pb)
