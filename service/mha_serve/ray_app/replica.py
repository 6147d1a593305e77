"""AttentionReplica: one Ray Serve replica holding the engine, its lanes and the KV caches of
the sessions made on it; the application's ingress, which Ray's gRPC proxy calls directly
(one hop: docs/ray.md). Each mha.v1 and Open Inference Protocol call runs through the door
the standalone server runs (transport/door.py, transport/oip/door.py): the same conversion,
checks, statuses, messages and metrics.

Its engine starts every session id with this replica's id (ids.py), so SessionRouter, in
the proxy, sends the session's later calls here. When Ray stops it (a scale-down or a
redeploy), it ends its open streams and moves its sessions to the replicas that stay
(moves.py), which answer them from then on under the same ids. A call for a session whose
id names another replica and that does not live here reached here because that replica is
gone: it answers NOT_FOUND saying so. Those moves and answers are in handover.py.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from collections.abc import AsyncIterator, Mapping
from typing import Any

import grpc

from mha_client.api import attention_pb2 as pb
from mha_client.api.inference import grpc_service_pb2 as oip_pb
from mha_serve import metrics
from mha_serve.config import build_config
from mha_serve.engine.threads import ComputeThreads
from mha_serve.ray_app.context import CallContext, Caller, Reply
from mha_serve.ray_app.direct import DirectServer, wants_direct
from mha_serve.ray_app.forward import (
    UpToLimit,
    calls,
    end_stream,
    message,
    peek,
    too_large,
    unary_answer,
)
from mha_serve.ray_app.handover import Handover, _value
from mha_serve.ray_app.ids import session_prefix
from mha_serve.ray_app.lost import LostSessions
from mha_serve.ray_app.moves import REOPEN, Stopping, UntilStopping
from mha_serve.ray_app.oip import InferenceMethods
from mha_serve.ray_app.scrape import RankedMetrics
from mha_serve.serving import AsyncEngine
from mha_serve.transport import tracing
from mha_serve.transport.answer import Refused
from mha_serve.transport.auth import ENV_TOKEN
from mha_serve.transport.door import AttentionDoor
from mha_serve.transport.oip.door import InferenceDoor
from mha_serve.transport.server import load_engine

log = logging.getLogger(__name__)

DEFAULT_SHUTDOWN_S = 20.0  # Ray's graceful_shutdown_timeout_s, when the config cannot be read
# ServerConfig fields that a replica cannot honour, and why: refused, from the app's
# overrides before anything is deployed (app.build) and from a config file as a replica starts.
NOT_ON_RAY = {
    "event_loop_cpu": "a replica's event loop is Ray's, and replicas share their node's "
    "CPUs: pinning would put every replica's loop on the same CPU; leave it none",
    "busy_poll_us": "a replica's event loop is Ray's, which does not busy-poll; leave it 0",
    "frontend_workers": "a replica's gRPC is Ray's proxy's, in front of every replica: add "
    "replicas (num_replicas, autoscaling_config) instead; leave it 1",
    # The standalone server's security is its own port's; on Ray the port is the proxy's,
    # which checks no token and has no TLS option (Ray 2.60): left set, the app would answer
    # every caller while its config said otherwise.
    "auth_token_file": "calls arrive through Ray's gRPC proxy, and no replica checks bearer "
    "tokens: every caller would be answered; leave it empty",
    "tls_cert_file": "the gRPC port is Ray's proxy's, which has no TLS option; leave it empty",
    "tls_key_file": "the gRPC port is Ray's proxy's, which has no TLS option; leave it empty",
    "tls_client_ca_file": "the gRPC port is Ray's proxy's, which checks no client "
    "certificates; leave it empty",
}
# Each NOT_ON_RAY field's value when off (as a string, lowercased).
_OFF = {
    "event_loop_cpu": "none",
    "busy_poll_us": "0",
    "frontend_workers": "1",
    "auth_token_file": "",
    "tls_cert_file": "",
    "tls_key_file": "",
    "tls_client_ca_file": "",
}


def check_not_on_ray(
    settings: dict[str, Any], where: str, environ: Mapping[str, str] | None = None
) -> None:
    """ValueError for a NOT_ON_RAY field of `settings` set to anything but none, or (where
    `environ` is given) a bearer token in it, which the standalone server would ask for."""
    for key, why in NOT_ON_RAY.items():
        value = settings.get(key)
        if value is not None and str(value).strip().lower() != _OFF[key]:
            raise ValueError(f"{where}{key} = {value!r} does not apply on Ray: {why}")
    if environ is not None and environ.get(ENV_TOKEN, "").strip():  # (never its value)
        raise ValueError(
            f"{ENV_TOKEN} is set, which does not apply on Ray: unset it, as "
            f"auth_token_file: {NOT_ON_RAY['auth_token_file']}"
        )


class AttentionReplica(InferenceMethods, Handover):
    """mha.v1 and the Open Inference Protocol (InferenceMethods) over one engine, called by
    Ray's proxy (a method per gRPC method, Ray's convention) and, through a handle, by
    tests and other replicas (`call`, `infer`)."""

    async def __init__(
        self,
        config_file: str | None = None,
        overrides: dict[str, Any] | None = None,
        metrics_port: int = 0,
        directory: Any = None,
        direct_streams: bool = True,
    ) -> None:
        from ray import serve

        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        self.stopping = Stopping()
        self._foreign: dict[str, None] = {}  # sessions moved here from other replicas
        self._lost = LostSessions(self._why_lost if directory is not None else None)
        config = getattr(context, "_deployment_config", None)
        self._shutdown_s = float(
            getattr(config, "graceful_shutdown_timeout_s", None) or DEFAULT_SHUTDOWN_S
        )
        cfg = build_config(config_file, dict(overrides or {}))
        check_not_on_ray({key: getattr(cfg, key) for key in NOT_ON_RAY}, "", os.environ)
        # (the spans still held are sent in __del__: Ray ends a replica with ray.kill, which
        # runs no atexit handler, the SDK's own flush among them)
        tracing.start(cfg.tracing_endpoint, cfg.tracing_sample_ratio, "ray-replica")
        self.compute = ComputeThreads(cfg.torch_threads, cfg.weights_torch_threads)
        loop = asyncio.get_running_loop()
        # Loaded and warmed on the compute thread, as the standalone server does (threads.py).
        engine = await loop.run_in_executor(
            self.compute.main,
            functools.partial(load_engine, cfg, session_id_prefix=session_prefix(self.replica_id)),
        )
        self.serving = AsyncEngine(engine, self.compute, inline=cfg.inline_lone_requests)
        self.serving.start()
        self.door = AttentionDoor(max_request_bytes=cfg.max_receive_message_bytes)
        self.door.attach(self.serving)
        oip = InferenceDoor(
            lambda: self.serving, ready=lambda: True, session_ttl_s=cfg.session_ttl_s
        )
        super().__init__(oip, directory, context.deployment, context.app_name)
        # What the standalone server's gRPC takes (Ray's proxy takes up to 2 GiB): forward.py
        self.max_request_bytes = cfg.max_receive_message_bytes
        self.direct: DirectServer | None = None
        if direct_streams:
            import ray

            messages = {
                "StreamSession": pb.AttendRequest,
                "ModelStreamInfer": oip_pb.ModelInferRequest,
            }
            self.direct = DirectServer(ray.util.get_node_ip_address(), messages)
            await self.direct.start()
        # This deployment's handle: its router (in this process) tells when Ray stops this
        # replica (it leaves the view), and carries the sessions moved then.
        self.stopping.watch(self.replica_id)
        self._receivers = calls(self._peer_handle(), "receive_session")
        metrics.READY.set(1)
        self._metrics: RankedMetrics | None = None
        if metrics_port:
            labels = {"replica": self.replica_id, "application": context.app_name}
            self._metrics = RankedMetrics(metrics_port, labels)
            self._metrics.serve_at(context.rank.local_rank)
        log.info("replica %s SERVING models: %s", self.replica_id, ", ".join(engine.models))

    async def __del__(self) -> None:
        """Ray's last call on a replica it stops gracefully: its sessions moved (Handover),
        then its spans still held sent (tracing.STOP_FLUSH_S at most)."""
        try:
            await super().__del__()
        finally:
            await tracing.stop()

    def reconfigure(self, user_config: Any, rank: Any = None) -> None:
        """Ray's call after __init__ and whenever it gives this replica a new rank (it
        renumbers a node's replicas 0..K-1 once others there stopped): /metrics follows
        the local rank (scrape.RankedMetrics). A user_config is not used."""
        if user_config is not None:
            log.warning("replica %s: user_config is not used; ignored", self.replica_id)
        if self._metrics is not None and rank is not None:
            self._metrics.serve_at(rank.local_rank)

    # --- mha.v1, as Ray's proxy calls it ---------------------------------------------

    async def Attend(self, request: Any, grpc_context: Any) -> Any:
        return await self._unary("Attend", request, grpc_context)

    async def CreateSession(self, request: Any, grpc_context: Any) -> Any:
        return await self._unary("CreateSession", request, grpc_context)

    async def GetSession(self, request: Any, grpc_context: Any) -> Any:
        return await self._unary("GetSession", request, grpc_context)

    async def ForkSession(self, request: Any, grpc_context: Any) -> Any:
        return await self._unary("ForkSession", request, grpc_context)

    async def TruncateSession(self, request: Any, grpc_context: Any) -> Any:
        return await self._unary("TruncateSession", request, grpc_context)

    async def CloseSession(self, request: Any, grpc_context: Any) -> Any:
        return await self._unary("CloseSession", request, grpc_context)

    async def ListModels(self, request: Any, grpc_context: Any) -> Any:
        return await self._unary("ListModels", request, grpc_context)

    async def GetModelInfo(self, request: Any, grpc_context: Any) -> Any:
        return await self._unary("GetModelInfo", request, grpc_context)

    async def AnalyzeHeads(self, request: Any, grpc_context: Any) -> Any:
        return await self._unary("AnalyzeHeads", request, grpc_context)

    async def _unary(self, method: str, request: Any, grpc_context: Any) -> Any:
        reply = too_large(request, self.max_request_bytes)
        if reply is None:
            reply = await self.call(method, request, Caller.of(grpc_context))
        return unary_answer(grpc_context, reply)

    async def StreamSession(self, requests: Any, grpc_context: Any) -> AsyncIterator[Any]:
        """One session's steps (AttentionDoor.stream); the proxy routed the stream here by
        its first message's session. Its messages come over a direct stream when the proxy
        takes the offer (direct.py), else through Ray. The first error ends it with its
        status."""
        caller = Caller.of(grpc_context)
        if self.direct is not None and wants_direct(grpc_context):
            answer = functools.partial(self._direct_session, caller=caller)
            async for item in self.direct.offer(answer, grpc_context):
                yield item
            return
        async for result in self._session(requests, caller):
            if isinstance(result, Reply):
                yield end_stream(grpc_context, result)
                return
            yield message(result)

    async def _direct_session(
        self, requests: AsyncIterator[Any], context: Any, caller: Caller
    ) -> AsyncIterator[Any]:
        async for result in self._session(requests, caller):
            if isinstance(result, Reply):
                await context.abort(result.code, result.details)
            yield result

    async def _session(self, requests: Any, caller: Caller) -> AsyncIterator[Any]:
        """The door's StreamSession; an error as a Reply, last. Once Ray is stopping this
        replica, it ends after the step in flight, UNAVAILABLE: reopened, it reaches the
        session's new replica."""
        requests, first = await peek(requests)
        gone = self._gone("StreamSession", getattr(first, "session_id", "") or "")
        if gone is not None:
            yield await gone
            return
        limited = UpToLimit(requests, self.max_request_bytes)
        until = UntilStopping(limited, self.stopping)
        async for result in self.door.stream(until, CallContext(caller)):
            if isinstance(result, Refused):
                yield Reply(code=result.code, details=result.details)
                return
            yield result
        if limited.refused is not None:
            yield limited.refused
        elif until.cut:
            yield self.reopen()

    def reopen(self) -> Reply:
        """How a stream ends when Ray stops this replica."""
        return Reply(
            code=grpc.StatusCode.UNAVAILABLE, details=REOPEN.format(replica=self.replica_id)
        )

    # --- through a handle --------------------------------------------------------------

    async def call(self, method: str, request: Any, caller: Caller | str = "") -> Reply:
        """One unary call (mha.v1 or the Open Inference Protocol), as a Reply."""
        if method in self.oip.unary_methods:
            return await self.infer(method, request, caller)
        if method not in self.door.unary_methods:
            raise ValueError(f"{method!r} is not one of {sorted(self.door.unary_methods)}")
        gone = self._gone(method, getattr(request, "session_id", ""))
        if gone is not None:
            return await gone
        caller = Caller(peer=caller) if isinstance(caller, str) else caller
        result = await self.door.unary(method, request, CallContext(caller))
        if isinstance(result, Refused):
            return Reply(code=result.code, details=result.details)
        return Reply(result)

    async def live_sessions(self, session_ids: list[str]) -> list[str]:
        """Those of session_ids that live here (SequenceDirectory prunes the rest)."""
        live = []
        for session_id in session_ids:
            try:
                await _value(self.serving.get_session(session_id))
            except Exception:  # gone, closed, expired, or not an id of ours
                continue
            live.append(session_id)
        return live

    async def cache_usage(self) -> dict[str, tuple[int, int]]:
        """(live sessions, KV blocks in use) per model with a cache: what tests and
        operators read to see a replica's cache end empty."""
        usage = {}
        for hosted in self.serving.models():
            info = await _value(self.serving.cache_info(hosted.spec.name))
            if info is not None:
                usage[hosted.spec.name] = (info.num_sessions, info.num_blocks_used)
        return usage

    def replica_id_of(self) -> str:
        return self.replica_id

    async def record_routing_stats(self) -> dict[str, int]:
        """Live sessions here, for the controller and routers (RunningReplica.routing_stats)."""
        return {"sessions": sum(n for n, _ in (await self.cache_usage()).values())}
