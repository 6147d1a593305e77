"""AttentionReplica: one Ray Serve replica running the standalone server's engine, lanes and
servicer, answering the Ingress one call (or one stream message) at a time.

Its engine starts every session id with this replica's id (ids.py), so SessionRouter sends
the session's later calls here. A call for a session whose id names another replica reached
here because that replica is gone: it answers NOT_FOUND saying so.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc

from mha_serve import metrics
from mha_serve.config import ServerConfig, build_config
from mha_serve.engine import Engine, resolve_device, resolve_dtype
from mha_serve.engine.threads import ComputeThreads
from mha_serve.ray_app.context import CallContext, Reply
from mha_serve.ray_app.ids import replica_of, session_prefix
from mha_serve.serving import AsyncEngine
from mha_serve.transport.servicer import AttentionServicer

log = logging.getLogger(__name__)

# The unary mha.v1 methods a replica answers (the Ingress answers health itself and turns
# StreamSession into stream_step calls).
UNARY_METHODS = frozenset(
    {
        "Attend",
        "CreateSession",
        "GetSession",
        "ForkSession",
        "TruncateSession",
        "CloseSession",
        "ListModels",
        "GetModelInfo",
    }
)


class AttentionReplica:
    """The engine behind its lanes and the mha.v1 servicer, in one Ray Serve replica."""

    async def __init__(
        self,
        config_file: str | None = None,
        overrides: dict[str, Any] | None = None,
        metrics_port: int = 0,
    ) -> None:
        from ray import serve

        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        cfg = build_config(config_file, dict(overrides or {}))
        self.compute = ComputeThreads(cfg.torch_threads, cfg.weights_torch_threads)
        loop = asyncio.get_running_loop()
        # Loaded and warmed on the compute thread, as the standalone server does (threads.py).
        engine = await loop.run_in_executor(
            self.compute.main, load_engine, cfg, session_prefix(self.replica_id)
        )
        self.serving = AsyncEngine(engine, self.compute)
        self.serving.start()
        self.servicer = AttentionServicer(max_request_bytes=cfg.max_receive_message_bytes)
        self.servicer.attach(self.serving)
        metrics.READY.set(1)
        if metrics_port:
            from mha_serve.ray_app.scrape import serve_replica_metrics

            port = metrics_port + context.rank.local_rank
            labels = {"replica": self.replica_id, "application": context.app_name}
            try:
                serve_replica_metrics(port, labels)
                log.info("replica %s: metrics on port %d", self.replica_id, port)
            except OSError as e:  # the port is taken: serve without metrics, say so loudly
                log.error(
                    "replica %s: no /metrics, port %d is taken (%s); give the app a "
                    "metrics_port whose next ports (one per replica on a node) are free",
                    self.replica_id,
                    port,
                    e,
                )
        log.info("replica %s SERVING models: %s", self.replica_id, ", ".join(engine.models))

    async def call(self, method: str, request: Any, peer: str = "") -> Reply:
        """One unary mha.v1 call, answered by the servicer."""
        if method not in UNARY_METHODS:
            raise ValueError(f"{method!r} is not one of {sorted(UNARY_METHODS)}")
        gone = self._gone(method, request)
        if gone is not None:
            return gone
        context = CallContext(peer)
        try:
            response = await getattr(self.servicer, method)(request, context)
        except grpc.aio.AbortError:
            return context.reply()
        return context.reply(response)

    async def stream_step(self, request: Any, peer: str = "") -> Reply:
        """One message of a StreamSession (the Ingress fills in the stream's session_id),
        answered by the servicer's StreamSession: the same checks, metrics and codes."""
        gone = self._gone("StreamSession", request)
        if gone is not None:
            return gone
        context = CallContext(peer)
        try:
            responses = [r async for r in self.servicer.StreamSession(_one(request), context)]
        except grpc.aio.AbortError:
            return context.reply()
        return context.reply(responses[0])

    def cache_usage(self) -> dict[str, tuple[int, int]]:
        """(live sessions, KV blocks in use) per model with a cache: what tests and
        operators read to see a replica's cache end empty."""
        usage = {}
        for hosted in self.serving.models():
            info = self.serving.cache_info(hosted.spec.name)
            if info is not None:
                usage[hosted.spec.name] = (info.num_sessions, info.num_blocks_used)
        return usage

    def replica_id_of(self) -> str:
        return self.replica_id

    def record_routing_stats(self) -> dict[str, int]:
        """Live sessions here, for the controller and routers (RunningReplica.routing_stats)."""
        return {"sessions": sum(n for n, _ in self.cache_usage().values())}

    def _gone(self, method: str, request: Any) -> Reply | None:
        """NOT_FOUND for a session that lived on another replica: the router sends a call
        here only when that replica is gone (dead or removed), and its cache with it."""
        session_id = getattr(request, "session_id", "")
        owner = replica_of(session_id) if session_id else None
        if owner is None or owner == self.replica_id:
            return None
        metrics.count_request(method, "unknown", grpc.StatusCode.NOT_FOUND.name)
        return Reply(
            code=grpc.StatusCode.NOT_FOUND,
            details=(
                f"session {session_id!r} is gone: it lived on Ray Serve replica {owner!r}, "
                "which is no longer running (it died or was scaled down), and its KV cache "
                "went with it; create a new session and send its tokens again"
            ),
        )


def load_engine(cfg: ServerConfig, session_id_prefix: str) -> Engine:
    """The engine as the standalone server builds it (transport/server.py), warmed up, its
    session ids naming this replica."""
    device = resolve_device(cfg.device)
    engine = Engine(
        cfg.models,
        device=device,
        dtype=resolve_dtype(cfg.dtype, device),
        max_response_bytes=cfg.max_send_message_bytes,
        evict_idle_sessions=cfg.evict_idle_sessions,
        session_ttl_s=cfg.session_ttl_s or None,
        session_id_prefix=session_id_prefix,
    )
    engine.warmup()
    return engine


async def _one(request: Any) -> AsyncIterator[Any]:
    yield request
