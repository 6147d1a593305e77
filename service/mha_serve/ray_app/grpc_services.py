"""The gRPC services Ray's proxy registers (serve_config.yaml `grpc_servicer_functions`).

mha.v1 and the Open Inference Protocol are registered with the standalone server's lenient
parsing (transport/handlers.py): bytes that are no valid message reach the replica as
Malformed and answer INVALID_ARGUMENT naming the type, as on the standalone server. Ray's
proxy keeps each method's request parser and replaces its behaviour with a call to the
application's ingress deployment (AttentionReplica). These functions run in the proxy's
process; each first installs proxy.py around the proxy's handlers (routing by session,
deadlines, health, Ray's failures made statuses).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from grpc_health.v1 import health_pb2_grpc

from mha_client.api import attention_pb2 as pb
from mha_client.api.inference import grpc_service_pb2 as oip_pb
from mha_serve.ray_app import proxy
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


def add_health_service(servicer: Any, server: Any) -> None:
    """grpc.health.v1, answered in the proxy (proxy.py) from its view of the application."""
    proxy.install(server)
    health_pb2_grpc.add_HealthServicer_to_server(health_pb2_grpc.HealthServicer(), server)


def _add(server: Any, service: Any, messages: Any) -> None:
    proxy.install(server)
    stand_in = SimpleNamespace(**{method.name: _never_called for method in service.methods})
    add_service(server, stand_in, service, messages)
