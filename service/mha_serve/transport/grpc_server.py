"""The grpc.aio server of both protocols, health, reflection, metrics and graceful stop,
over any EngineClient: the standalone server's (transport/server.py, the engine in this
process) or a frontend worker's (transport/frontend.py, the engine in another). No torch."""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from mha_client.api import attention_pb2 as pb
from mha_client.api.inference import grpc_service_pb2 as inference_pb
from mha_serve import metrics
from mha_serve.config import ServerConfig
from mha_serve.net import host_port
from mha_serve.serving import EngineClient
from mha_serve.transport import tracing
from mha_serve.transport.auth import TokenInterceptor, load_tokens, server_credentials
from mha_serve.transport.drain import AT_LIMIT, GRPC_HEADROOM, Drain
from mha_serve.transport.handlers import add_service
from mha_serve.transport.oip import SERVICE as INFERENCE_SERVICE
from mha_serve.transport.oip import SERVICE_NAME as INFERENCE_SERVICE_NAME
from mha_serve.transport.oip import InferenceServicer
from mha_serve.transport.servicer import AttentionServicer

log = logging.getLogger(__name__)


def stop_signal(stop: asyncio.Event, server: GrpcServer) -> None:
    """SIGTERM/SIGINT: the first drains (stop), a second ends the drain at once (hurry)."""
    if stop.is_set():
        server.hurry()
    else:
        stop.set()


SERVICE = pb.DESCRIPTOR.services_by_name["AttentionService"]
SERVICE_NAME = SERVICE.full_name  # "mha.v1.AttentionService"
# Once the calls in the handlers are done, gRPC's own stop gets this long (at most) before it
# cancels what is left: refusals on their way out, a large request still arriving, and the
# streams no drain counts (health Watch, reflection), which would otherwise hold the stop.
CLOSE_GRACE_S = 2.0
# The Open Inference Protocol's health checks, answered while draining (ready: false), as
# grpc.health.v1 is.
INFERENCE_HEALTH = ("ServerLive", "ServerReady", "ModelReady")


class GrpcServer:
    """The gRPC side of a server: `start` (listen, then serve from `open_serving()`), then
    `wait`, then `stop`. Subclasses say where the engine is (open_serving, close_serving)."""

    ROLE = "server"  # the process's role in its traces' resource (mha_serve.role)

    def __init__(
        self,
        cfg: ServerConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        reuse_port: bool = False,
        at_limit: str = AT_LIMIT,
    ) -> None:
        """clock: the sessions' idle time and TTL (tests give a fake one); reuse_port: share
        the port with other processes (frontend workers, transport/workers.py); at_limit:
        the refusal past max_concurrent_rpcs (drain.AT_LIMIT), formatted with limit."""
        self.cfg = cfg
        self.clock = clock
        self.health = health.aio.HealthServicer()
        self.servicer = AttentionServicer(max_request_bytes=cfg.max_receive_message_bytes)
        self.serving: EngineClient | None = None  # once the models are warm
        tokens = load_tokens(cfg.auth_token_file)  # never logged
        self.requires_token = bool(tokens)
        self.server = grpc.aio.server(
            interceptors=[TokenInterceptor(tokens)] if tokens else None,
            # (the guarded calls' limit is the Drain's, below, counted and named; gRPC's own
            # is a bound above it that health checks and arriving requests fit under)
            maximum_concurrent_rpcs=cfg.max_concurrent_rpcs + GRPC_HEADROOM,
            options=[
                ("grpc.max_receive_message_length", cfg.max_receive_message_bytes),
                ("grpc.max_send_message_length", cfg.max_send_message_bytes),
                # grpc enables SO_REUSEPORT by default: a second server on a taken port
                # would silently share its traffic instead of failing. Frontend workers
                # share it on purpose.
                ("grpc.so_reuseport", 1 if reuse_port else 0),
            ],
        )
        self.port: int | None = None
        self._stopped = asyncio.Event()
        self._hurried = asyncio.Event()  # a second stop signal: end the drain now
        # Both doors' calls: refused once draining (waited for on stop), or past the limit.
        self.drain = Drain(max_calls=cfg.max_concurrent_rpcs, at_limit=at_limit)

    async def start(self) -> None:
        """Listens at once (health NOT_SERVING), then loads and warms the models off the loop."""
        await self.listen()
        await self.load()

    async def listen(self) -> None:
        """Opens the port with health NOT_SERVING; Attend answers UNAVAILABLE until `load`."""
        cfg = self.cfg
        tracing.start(cfg.tracing_endpoint, cfg.tracing_sample_ratio, self.ROLE)
        add_service(self.server, self.servicer, SERVICE, pb, drain=self.drain)
        # The Open Inference Protocol on the same port, over the same engine (issue 19).
        self.inference = InferenceServicer(
            lambda: self.serving,
            ready=lambda: self.serving is not None and not self._stopped.is_set(),
            session_ttl_s=cfg.session_ttl_s,
        )
        add_service(
            self.server,
            self.inference,
            INFERENCE_SERVICE,
            inference_pb,
            drain=self.drain,
            always_answered=INFERENCE_HEALTH,
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, INFERENCE_SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME),
            self.server,
        )
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        address = host_port(cfg.host, cfg.port)
        credentials = server_credentials(cfg)
        try:
            if credentials is None:
                self.port = self.server.add_insecure_port(address)
            else:
                self.port = self.server.add_secure_port(address, credentials)
        except RuntimeError as e:  # grpc raises RuntimeError when it cannot bind
            raise OSError(
                f"could not listen on {address}: the port is taken or the host is not local"
            ) from e
        await self.server.start()
        security = "plaintext" if credentials is None else "TLS"
        if cfg.tls_client_ca_file:
            security = "mutual TLS"
        log.info(
            "gRPC listening on %s, %s%s (NOT_SERVING until warm)",
            host_port(cfg.host, self.port),
            security,
            ", bearer token required" if self.requires_token else "",
        )
        if cfg.metrics_port:
            metrics_host = cfg.metrics_host or cfg.host
            metrics.serve_metrics(cfg.metrics_port, metrics_host)
            log.info("metrics on http://%s/metrics", host_port(metrics_host, cfg.metrics_port))

    async def load(self) -> None:
        """Opens the engine (warm), then reports SERVING."""
        self.serving = await self.open_serving()
        self.serving.start()
        self.servicer.attach(self.serving)
        # Everything loaded so far lives as long as the process: out of the collector's
        # sight, a full collection no longer walks torch's and grpc's objects (one took
        # 98 ms in the middle of a decode loop here; none over 1 ms after this). Before
        # SERVING, so that no request waits for this one.
        gc.collect()
        gc.freeze()
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        metrics.READY.set(1)
        log.info("SERVING models: %s", ", ".join(m.spec.name for m in self.serving.models()))

    async def open_serving(self) -> EngineClient:
        """The engine to serve from, warm."""
        raise NotImplementedError

    def close_serving(self) -> None:
        """After the engine closed on stop: what else the subclass holds (its threads)."""

    async def stop(self) -> None:
        """Drains (docs/RELIABILITY.md, "Shutdown: the policy"): health NOT_SERVING; after
        drain_delay_s, new calls are answered UNAVAILABLE by their handlers and open streams end
        UNAVAILABLE at their next message; within grace_period_s, the port closes once the calls
        in the handlers are done and calls stopped coming (drain.QUIET_S): gRPC cancels only
        calls still running when the grace period ends."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        metrics.READY.set(0)
        await self.health.enter_graceful_shutdown()
        if self.cfg.drain_delay_s > 0 and not self._hurried.is_set():  # health NOT_SERVING
            log.info(
                "draining: NOT_SERVING for %.1f s before refusing new calls (a second "
                "SIGTERM/SIGINT stops at once)",
                self.cfg.drain_delay_s,
            )
            await self._unless_hurried(asyncio.sleep(self.cfg.drain_delay_s))
        grace_s, started = self.cfg.grace_period_s, time.monotonic()
        self.drain.close()
        if not self._hurried.is_set():
            log.info(
                "draining: new calls refused UNAVAILABLE; up to %.1f s for %d in flight and "
                "for new calls to stop coming",
                grace_s,
                self.drain.in_flight,
            )
            await self._unless_hurried(self.drain.wait(grace_s))
        if self._hurried.is_set():
            grace_s = 0.0
        if self.drain.in_flight:
            log.warning(
                "grace period of %.1f s over: cancelling %d calls still in flight",
                grace_s,
                self.drain.in_flight,
            )
        log.info("closing the port; %d calls refused while draining", self.drain.refused)
        left_s = max(0.0, grace_s - (time.monotonic() - started))
        await self.server.stop(min(left_s, CLOSE_GRACE_S))
        if self.serving is not None:
            await self.serving.close()
        self.close_serving()
        await tracing.stop()  # the spans still held sent, within tracing.STOP_FLUSH_S
        log.info("stopped")

    def hurry(self) -> None:
        """A second stop signal: the drain ends now (what is left of --drain-delay-s and
        --grace-period-s is skipped; calls still in flight are cancelled), as a second
        Ctrl-C does. Before stop(), it makes stop() skip both."""
        if not self._hurried.is_set():
            log.warning(
                "second stop signal: stopping now, cancelling %d call(s) in flight",
                self.drain.in_flight,
            )
            self._hurried.set()

    async def _unless_hurried(self, work: Any) -> None:
        """Awaits work, or until hurry() (work then cancelled)."""
        task = asyncio.ensure_future(work)
        hurried = asyncio.ensure_future(self._hurried.wait())
        try:
            await asyncio.wait({task, hurried}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (task, hurried):
                t.cancel()
            await asyncio.gather(task, hurried, return_exceptions=True)

    async def wait(self) -> None:
        await self.server.wait_for_termination()
