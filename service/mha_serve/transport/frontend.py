"""A frontend worker of `mha-serve --frontend-workers N` (transport/workers.py starts them):
the gRPC server of both protocols over the engine process's RemoteEngine. It never imports
torch: requests and outcomes cross as Arrays (engine/requests.py).

SIGTERM and SIGINT reach a frontend blocked until it has installed its handlers (the engine
process starts it so): a signal that comes while it is still starting waits for them, and
it stops as from any other moment, with exit 0.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys

from mha_serve.config import ServerConfig
from mha_serve.serving.remote import RemoteEngine
from mha_serve.transport import busy_poll
from mha_serve.transport.grpc_server import GrpcServer, stop_signal

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class FrontendServer(GrpcServer):
    """The standalone server's gRPC side over the engine process's RemoteEngine."""

    def __init__(self, cfg: ServerConfig, engine_path: str, engine_pid: int) -> None:
        super().__init__(cfg, reuse_port=True)
        self.engine_path, self.engine_pid = engine_path, engine_pid
        self.remote: RemoteEngine | None = None

    async def start(self) -> None:
        """Connects to the engine (its models warm), then listens: nothing is accepted that
        cannot be served."""
        self.remote = await RemoteEngine.connect(self.engine_path, engine_pid=self.engine_pid)
        await self.listen()
        await self.load()

    async def open_serving(self) -> RemoteEngine:
        return self.remote


def frontend_main(cfg: ServerConfig, engine_path: str, engine_pid: int, index: int) -> None:
    """A frontend process's entry (multiprocessing, spawn): serves until SIGTERM/SIGINT or
    until the engine process goes away (then exits 1)."""
    logging.basicConfig(
        level=cfg.log_level,
        format=f"%(asctime)s %(levelname)s frontend-{index} %(name)s: %(message)s",
    )
    sys.exit(busy_poll.run(_frontend(cfg, engine_path, engine_pid, index), cfg.busy_poll_us))


async def _frontend(cfg: ServerConfig, engine_path: str, engine_pid: int, index: int) -> int:
    server = FrontendServer(cfg, engine_path, engine_pid)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in STOP_SIGNALS:  # a second one ends the drain at once
        loop.add_signal_handler(sig, stop_signal, stop, server)
    # Blocked by the engine process until now (workers.py): one sent meanwhile arrives here.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    stopping = asyncio.create_task(stop.wait())
    starting = asyncio.create_task(server.start())
    await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if stop.is_set():  # a signal while starting (the engine may be stopping too): no calls yet
        starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        if server.remote is not None:
            await server.remote.close()
        await server.stop()
        return 0
    try:
        starting.result()  # the engine went away before its hello: the error, and exit 1
        server.remote.notify(("listening", index, os.getpid()))
        lost = asyncio.create_task(server.remote.lost.wait())
        await asyncio.wait({lost, stopping}, return_when=asyncio.FIRST_COMPLETED)
        lost.cancel()
    finally:
        stopping.cancel()
        await server.stop()
    if not stop.is_set():
        log.error("the engine process is gone; this frontend exits")
        return 1
    return 0
