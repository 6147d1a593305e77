"""The standalone server: the gRPC server (grpc_server.py) over the engine in this process,
loaded and warmed on the compute thread; `serve` runs it until SIGTERM or SIGINT."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from mha_serve import metrics
from mha_serve.cache import CacheError
from mha_serve.config import ServerConfig
from mha_serve.engine import Engine, resolve_device, resolve_dtype
from mha_serve.engine.threads import ComputeThreads, pin_event_loop, unpin
from mha_serve.serving import AsyncEngine
from mha_serve.serving.async_engine import SESSION_SWEEP_S
from mha_serve.transport.early_stop import EarlyStop, ignore_stop_signals
from mha_serve.transport.grpc_server import SERVICE_NAME, GrpcServer, stop_signal

log = logging.getLogger(__name__)

__all__ = ["SERVICE_NAME", "Server", "load_engine", "serve"]


class Server(GrpcServer):
    """One process serving the configured models; `start`, then `wait`, then `stop`."""

    serving: AsyncEngine | None

    def __init__(self, cfg: ServerConfig, **kwargs: Any) -> None:
        """kwargs: GrpcServer's (clock, reuse_port)."""
        super().__init__(cfg, **kwargs)
        self.session_sweep_s = SESSION_SWEEP_S
        # Every forward runs on these two threads; the event loop only wraps request bytes.
        self.compute = ComputeThreads(cfg.torch_threads, cfg.weights_torch_threads)

    @property
    def lanes(self) -> dict:
        """Each model's lanes (empty until the models are warm)."""
        return {} if self.serving is None else self.serving.lanes

    async def open_serving(self) -> AsyncEngine:
        """The models, loaded and warmed here on the compute thread."""
        loop = asyncio.get_running_loop()
        engine = await loop.run_in_executor(self.compute.main, load_engine, self.cfg, self.clock)
        return AsyncEngine(
            engine,
            self.compute,
            session_sweep_s=self.session_sweep_s,
            inline=self.cfg.inline_lone_requests,
        )

    def close_serving(self) -> None:
        if self.serving is not None:  # drained: what is left goes to the spill directory
            spill_on_stop(self.serving.engine)
        self.compute.shutdown()


def load_engine(
    cfg: ServerConfig,
    clock: Callable[[], float] = time.monotonic,
    *,
    session_id_prefix: str = "",
) -> Engine:
    """The configured models, loaded and warm (call on the compute thread); session ids
    start with session_id_prefix (a Ray replica's names it)."""
    device = resolve_device(cfg.device)
    engine = Engine(
        cfg.models,
        device=device,
        dtype=resolve_dtype(cfg.dtype, device),
        max_response_bytes=cfg.max_send_message_bytes,
        evict_idle_sessions=cfg.evict_idle_sessions,
        session_ttl_s=cfg.session_ttl_s or None,
        max_sessions_per_client=cfg.max_sessions_per_client,
        max_cache_bytes_per_client=cfg.max_cache_bytes_per_client,
        clock=clock,
        session_id_prefix=session_id_prefix,
        spill_dir=cfg.session_spill_dir,
        spill_bytes=cfg.session_spill_bytes,
        cudnn_attention=cfg.cudnn_attention,
        static_decode="graphs" if cfg.decode_graphs else "off",
        flash_decode=cfg.flash_decode,
    )
    engine.warmup()
    adopt_spilled(engine)
    return engine


def adopt_spilled(engine: Engine) -> None:
    """Takes over the sessions the spill directory holds (a restart), saying how many and
    which files it refused (they are kept as *.refused)."""
    adopted, refused = engine.adopt_spilled()
    for path, why in refused:
        log.error("spill directory: refused %s: %s", path, why)
    if refused:
        metrics.count_lost("bad_file", len(refused))
    models: collections.Counter[str] = collections.Counter()
    for session_id in adopted:
        with contextlib.suppress(CacheError):  # its TTL ran out since: expired, not adopted
            models[engine.session_model(session_id)] += 1
    for model, n in models.items():
        metrics.count_adopted(model, n)
    if adopted or refused:
        log.info("adopted %d spilled session(s); refused %d file(s)", len(adopted), len(refused))


def spill_on_stop(engine: Engine) -> None:
    """At shutdown, once drained: every idle session to the spill directory, then the
    directory let go (its lock)."""
    written = engine.spill_idle()
    if written:
        log.info("wrote %d session(s) to the spill directory", len(written))
    engine.close_spill()


async def serve(cfg: ServerConfig, early: EarlyStop | None = None) -> None:
    """Runs until SIGTERM or SIGINT, then stops gracefully. early: the stop signals
    received before this loop's handlers (main.py): one then stops it as at once."""
    loop = asyncio.get_running_loop()
    if cfg.event_loop_cpu != "none":  # before gRPC starts its threads from this one
        cpu = pin_event_loop(cfg.event_loop_cpu)
        loop.set_default_executor(ThreadPoolExecutor(initializer=unpin))
        log.info("event loop pinned to CPU %d; the compute threads run on every CPU", cpu)
    server = Server(cfg)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_signal, stop, server)
    if early is not None and early.received:  # (checked once this loop's handlers are in)
        stop_signal(stop, server)
    start = asyncio.create_task(server.start())
    stopping = asyncio.create_task(stop.wait())
    try:
        done, _ = await asyncio.wait({start, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if start in done:
            start.result()  # a failed start (bad checkpoint, taken port) ends the process here
            await stopping
        else:
            log.info("signal received while starting")
            start.cancel()
    finally:
        stopping.cancel()
        await server.stop()
        ignore_stop_signals(loop)  # stopped: a late signal must not end the exit (-15)
