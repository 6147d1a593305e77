"""A frontend worker of `mha-serve --frontend-workers N` (transport/workers.py starts them):
the gRPC server of both protocols over the engine process's RemoteEngine. It never imports
torch: requests and outcomes cross as Arrays (engine/requests.py).

Stop signals: the engine process tells its frontends to drain with a signal of its own,
DRAIN_SIGNAL, and to end the drain at once with HURRY_SIGNAL (an operator's second stop
signal). SIGTERM and SIGINT sent to a frontend itself drain it too, a second one ends the
drain; the engine's signals never count as one of them. So a Ctrl-C in a terminal, which
reaches every process of the group (the frontend gets SIGINT from the terminal and
DRAIN_SIGNAL from the engine), drains once, gracefully, as SIGTERM to the engine does.

Every one of these reaches a frontend blocked until it has installed its handlers (the
engine process starts it so): a signal that comes while it is still starting waits for
them, and it stops as from any other moment, with exit 0.
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
from mha_serve.transport.drain import FRONTEND_AT_LIMIT
from mha_serve.transport.early_stop import (  # an operator's, or a terminal's
    STOP_SIGNALS,
    ignore_stop_signals,
)
from mha_serve.transport.grpc_server import GrpcServer

log = logging.getLogger(__name__)

DRAIN_SIGNAL = signal.SIGUSR1  # the engine process's: drain
HURRY_SIGNAL = signal.SIGUSR2  # the engine process's: end the drain now (a second stop signal)
# What the engine process blocks while it starts a frontend (each waits for its handlers).
FRONTEND_SIGNALS = (*STOP_SIGNALS, DRAIN_SIGNAL, HURRY_SIGNAL)


class FrontendServer(GrpcServer):
    """The standalone server's gRPC side over the engine process's RemoteEngine."""

    ROLE = "frontend"

    def __init__(self, cfg: ServerConfig, engine_path: str, engine_pid: int, index: int) -> None:
        """index: this frontend's (0 to frontend_workers - 1), named in its refusals."""
        at_limit = FRONTEND_AT_LIMIT.format(
            index=index, count=cfg.frontend_workers, limit="{limit}"
        )
        super().__init__(cfg, reuse_port=True, at_limit=at_limit)
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


class FrontendSignals:
    """A frontend's stop signals: the first SIGTERM/SIGINT drains and a second ends the
    drain (as for the standalone server); the engine process's DRAIN_SIGNAL drains and its
    HURRY_SIGNAL ends the drain, neither counted as a SIGTERM/SIGINT."""

    def __init__(self, stop: asyncio.Event, server: GrpcServer) -> None:
        self.stop, self.server = stop, server
        self.received = 0  # SIGTERM/SIGINT

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, self.stop_signal)
        loop.add_signal_handler(DRAIN_SIGNAL, self.drain)
        loop.add_signal_handler(HURRY_SIGNAL, self.hurry)

    def stop_signal(self) -> None:
        self.received += 1
        if self.received == 1:
            self.stop.set()
        else:
            self.server.hurry()

    def drain(self) -> None:
        log.info("the engine process asks this frontend to drain")
        self.stop.set()

    def hurry(self) -> None:
        self.stop.set()
        self.server.hurry()


def frontend_main(cfg: ServerConfig, engine_path: str, engine_pid: int, index: int) -> None:
    """A frontend process's entry (multiprocessing, spawn): serves until SIGTERM/SIGINT or
    until the engine process goes away (then exits 1)."""
    logging.basicConfig(
        level=cfg.log_level,
        format=f"%(asctime)s %(levelname)s frontend-{index} %(name)s: %(message)s",
    )
    sys.exit(busy_poll.run(_stopped(cfg, engine_path, engine_pid, index), cfg.busy_poll_us))


async def _stopped(cfg: ServerConfig, engine_path: str, engine_pid: int, index: int) -> int:
    """_frontend, then its stop signals ignored: the event loop's end would give them their
    default action back, and one coming late (the engine's DRAIN_SIGNAL to a frontend that
    stopped on its own signal) would end the process with that signal, not its exit code."""
    try:
        return await _frontend(cfg, engine_path, engine_pid, index)
    finally:
        ignore_stop_signals(asyncio.get_running_loop(), FRONTEND_SIGNALS)


async def _frontend(cfg: ServerConfig, engine_path: str, engine_pid: int, index: int) -> int:
    server = FrontendServer(cfg, engine_path, engine_pid, index)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    FrontendSignals(stop, server).install(loop)
    # Blocked by the engine process until now (workers.py): one sent meanwhile arrives here.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FRONTEND_SIGNALS)
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
