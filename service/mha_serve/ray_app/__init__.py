"""mha-serve as a Ray Serve application: the same engine, batching and servicers in each replica.

Three deployments (docs/ray.md): `Ingress` takes every mha.v1 and Open Inference Protocol
call from Ray's gRPC proxy and forwards it, one message at a time, to `AttentionReplica`,
whose request router (`SessionRouter`) sends each session's calls to the replica that holds
its KV cache (a session id names that replica); `SequenceDirectory` tells every Ingress
replica which session a Triton sequence steps. Ray is imported only here, never by the rest
of the server.
"""

from mha_serve.ray_app.app import build

__all__ = ["build"]
