"""mha-serve as a Ray Serve application: the same engine, batching and front doors in each
replica.

Ray's gRPC proxy calls `AttentionReplica` directly, one hop (docs/ray.md): its request
router (`SessionRouter`) runs in the proxy and sends each session's calls to the replica
that holds its KV cache (a session id names that replica), helped by what proxy.py adds
around each call there (the session read from the request or a stream's first message,
the deadline, health, Ray's failures made statuses); `SequenceDirectory` says which
session a Triton sequence steps. Ray is imported only here, never by the rest of the
server.
"""

from mha_serve.ray_app.app import build

__all__ = ["build"]
