"""`mha-serve --frontend-workers N`: N gRPC frontend processes on one port in front of one
engine process (the reference design is vLLM v1's API-server / engine-core split).

- The **engine process** (the one started, PID 1 in a container) loads the models and runs
  the one AsyncEngine: batches, KV caches, sessions, the session sweeper. It serves them to
  the frontends over a Unix socket each (serving/remote.py) and serves /metrics.
- Each **frontend** (transport/frontend.py) runs a grpc.aio server on the same port
  (SO_REUSEPORT: the kernel spreads connections, so one client channel stays on one
  frontend): both protocols' servicers, protobuf, the framed codec, health and reflection.
  Its servicers are the standalone server's, over a RemoteEngine; it never imports torch.
  Arrays cross through shared memory when large.
- Sessions live only in the engine, so any frontend carries any session's steps, and the
  one-step-at-a-time claim holds across frontends. A stream stays on the frontend holding it.
- Startup: the engine process reserves the port, starts the frontends, loads the models;
  a frontend listens only once the engine is warm, so every connection it accepts is served.
- SIGTERM (or SIGINT): the engine tells each frontend to drain with a signal of its own
  (frontend.DRAIN_SIGNAL, not SIGTERM: a Ctrl-C reaches every process of the group, and a
  frontend would take the engine's SIGTERM for a second stop signal and cancel its calls);
  each drains as the standalone server does (health NOT_SERVING, new calls UNAVAILABLE,
  in-flight calls get the grace period), then the engine stops. A frontend that dies
  otherwise is started again; its calls in flight fail UNAVAILABLE on their clients, and
  its session steps are rolled back in the engine.
- Metrics: prometheus-client's multiprocess mode (metrics/exposition.py); the engine
  process's /metrics sums every process, and archives the files of a frontend that exited.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import gc
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import time
from multiprocessing import resource_tracker

from mha_serve import metrics
from mha_serve.config import ServerConfig
from mha_serve.engine.threads import ComputeThreads
from mha_serve.net import host_port
from mha_serve.serving import AsyncEngine
from mha_serve.serving.host import EngineHost, clean_shared_memory
from mha_serve.transport import busy_poll
from mha_serve.transport.early_stop import EarlyStop, ignore_stop_signals
from mha_serve.transport.frontend import (
    DRAIN_SIGNAL,
    FRONTEND_SIGNALS,
    HURRY_SIGNAL,
    frontend_main,
)
from mha_serve.transport.run_dirs import make_run_dir
from mha_serve.transport.server import load_engine, spill_on_stop

log = logging.getLogger(__name__)

# A frontend that dies this soon after its start, this many times in a row, stops the server
# (a crash loop: a bad flag, a port it cannot bind) instead of being started forever.
CRASH_LOOP_S = 10.0
MAX_QUICK_DEATHS = 3
RESTART_DELAY_S = 1.0
STOP_MARGIN_S = 10.0  # beyond drain + grace before a frontend that does not exit is killed


def reserve_port(host: str, port: int) -> socket.socket:
    """Binds (not listens) host:port with SO_REUSEPORT: the frontends' listeners join it, a
    process without the option cannot take the port meanwhile, and port 0 gets its number.
    When the port is taken, once more with SO_REUSEADDR too, as gRPC's own listeners bind:
    a server restarted at once then binds its port while the connections of the one before
    linger in TIME_WAIT (a port another process listens on stays refused). Only then, as
    the kernel has it, could another server that sets SO_REUSEADDR bind the port before the
    frontends listen (their bind then fails, and says so)."""
    host = host.strip("[]")  # "[::]" as gRPC writes it
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for reuse_addr in (False, True):
        sock = socket.socket(family, socket.SOCK_STREAM)
        if reuse_addr:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            sock.close()
            if e.errno == errno.EADDRINUSE and not reuse_addr:
                continue
            raise OSError(f"could not listen on {host_port(host, port)}: {e.strerror}") from e
        return sock
    raise AssertionError("unreachable")


@dataclasses.dataclass
class _Frontend:
    index: int
    process: multiprocessing.process.BaseProcess
    started: float
    quick_deaths: int = 0


class EngineProcess:
    """Loads the engine, starts and watches the frontends, stops them all on a signal."""

    def __init__(self, cfg: ServerConfig, early: EarlyStop | None = None) -> None:
        """early: the stop signals received before this process's loop took them (main.py)."""
        self.cfg = cfg
        self.early = early
        self.count = cfg.frontend_workers
        self.run_dir = make_run_dir()  # (marked: a later server removes it if we are killed)
        self.engine_path = str(self.run_dir / "engine.sock")
        self.frontends: dict[int, _Frontend] = {}
        self.listening: dict[int, int] = {}  # index -> pid, as each frontend reports
        self.all_listening = asyncio.Event()
        self.stopping = asyncio.Event()
        self._signals = 0  # SIGTERM/SIGINT received (stopping is set without one too)
        self.failed: str | None = None
        self.host = EngineHost(self.engine_path, on_message=self._on_message)
        self.compute = ComputeThreads(cfg.torch_threads, cfg.weights_torch_threads)
        self.serving: AsyncEngine | None = None
        self._context = multiprocessing.get_context("spawn")  # fork is unsafe after gRPC

    def _on_message(self, message: tuple) -> None:
        if message[0] == "listening":
            _, index, pid = message
            self.listening[index] = pid
            log.info("frontend worker %d (pid %d) listening", index, pid)
            if len(self.listening) >= self.count:
                self.all_listening.set()

    def _spawn(self, index: int) -> None:
        frontend_cfg = dataclasses.replace(self.cfg, port=self.port, metrics_port=0)
        process = self._context.Process(
            target=frontend_main,
            args=(frontend_cfg, self.engine_path, os.getpid(), index),
            name=f"mha-serve-frontend-{index}",
        )
        # The child inherits the signal mask: it gets its stop signals only once its handlers
        # are in place (frontend.py), so a stop while it starts ends it as any other (exit 0).
        # multiprocessing starts its resource tracker on the first start, with SIGTERM and
        # SIGINT unblocked again after: started first, it leaves the mask alone.
        resource_tracker.ensure_running()
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, FRONTEND_SIGNALS)
        try:
            process.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        previous = self.frontends.get(index)
        self.frontends[index] = _Frontend(index, process, time.monotonic())
        if previous is not None:
            self.frontends[index].quick_deaths = previous.quick_deaths
        asyncio.get_running_loop().add_reader(process.sentinel, self._exited, index)

    def _exited(self, index: int) -> None:
        frontend = self.frontends[index]
        process = frontend.process
        asyncio.get_running_loop().remove_reader(process.sentinel)
        process.join()
        metrics.process_gone(process.pid)
        self.listening.pop(index, None)
        if self.stopping.is_set():
            return
        log.error(
            "frontend worker %d (pid %d) exited with %s; starting it again",
            index,
            process.pid,
            process.exitcode,
        )
        quick = time.monotonic() - frontend.started < CRASH_LOOP_S
        frontend.quick_deaths = frontend.quick_deaths + 1 if quick else 0
        if frontend.quick_deaths >= MAX_QUICK_DEATHS:
            self.failed = (
                f"frontend worker {index} died {MAX_QUICK_DEATHS} times within "
                f"{CRASH_LOOP_S:.0f} s of its start; see its log above"
            )
            self.stopping.set()
            return
        asyncio.get_running_loop().call_later(RESTART_DELAY_S, self._restart, index)

    def _restart(self, index: int) -> None:
        if not self.stopping.is_set():
            self._spawn(index)

    def others(self) -> list[int]:
        """The live frontends' pids (their CPU and memory count in /metrics)."""
        return [f.process.pid for f in self.frontends.values() if f.process.is_alive()]

    async def run(self) -> int:
        """Serves until a signal (or a crash loop); the exit code, once all has stopped."""
        try:
            await self._run()
        finally:  # all stopped: a late signal must not end the exit (-15)
            ignore_stop_signals(asyncio.get_running_loop())
        return self._exit_code()

    async def _run(self) -> None:
        cfg = self.cfg
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal)
        if self.early is not None and self.early.received:  # (once this loop's are in)
            self._on_signal()
        placeholder = reserve_port(cfg.host, cfg.port)
        self.port = placeholder.getsockname()[1]
        try:
            await self.host.start()
            if cfg.metrics_port:
                metrics_host = cfg.metrics_host or cfg.host
                metrics.serve_metrics(cfg.metrics_port, metrics_host, others=self.others)
                log.info("metrics on http://%s/metrics", host_port(metrics_host, cfg.metrics_port))
            for index in range(self.count):
                self._spawn(index)
            if not await self._until_stopping(self._load()):
                return
            if not await self._until_stopping(self.all_listening.wait()):
                return
            log.info(
                "gRPC listening on %s with %d frontend workers; SERVING models: %s",
                host_port(cfg.host, self.port),
                self.count,
                ", ".join(self.serving.engine.models),
            )
            await self.stopping.wait()
        finally:
            await self._stop()
            placeholder.close()

    async def _until_stopping(self, work) -> bool:
        """Runs work until done (True) or until a signal or a crash loop comes first."""
        task = asyncio.ensure_future(work)
        stopping = asyncio.create_task(self.stopping.wait())
        await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if task.done():
            task.result()  # a failed load ends the process here
            return True
        task.cancel()
        log.info("stopping while starting")
        return False

    async def _load(self) -> None:
        loop = asyncio.get_running_loop()
        engine = await loop.run_in_executor(self.compute.main, load_engine, self.cfg)
        self.serving = AsyncEngine(engine, self.compute, inline=self.cfg.inline_lone_requests)
        self.serving.start()
        gc.collect()
        gc.freeze()  # as the standalone server does (Server.load)
        self.host.ready(self.serving)

    def _exit_code(self) -> int:
        if self.failed:
            log.error("stopping: %s", self.failed)
            return 1
        return 0

    def _on_signal(self) -> None:
        """The first SIGTERM/SIGINT stops (frontends drain, then the engine); a second is
        passed on to the frontends as HURRY_SIGNAL, and their drain ends at once (as a
        second Ctrl-C does in a terminal, where every process of the group gets it)."""
        self._signals += 1
        if self._signals == 1:  # (counted, not stopping.is_set(): a crash loop or a failed
            self.stopping.set()  # load stops too, and the first signal after that is a first)
            return
        log.warning("second stop signal: the frontends stop their drain now")
        # (A frontend still starting has its signals blocked: it gets this one once its
        # handlers are in place, and stops at once.)
        for frontend in self.frontends.values():
            _tell(frontend.process, HURRY_SIGNAL)

    async def _stop(self) -> None:
        """Frontends drain first (each as the standalone server does), then the engine."""
        self.stopping.set()
        loop = asyncio.get_running_loop()
        for frontend in self.frontends.values():
            loop.remove_reader(frontend.process.sentinel)
        if self.serving is None:  # stopped while loading: frontends waiting for their hello
            await self.host.close()  # get the link's end at once
        live = [f.process for f in self.frontends.values() if f.process.is_alive()]
        for process in live:
            _tell(process, DRAIN_SIGNAL)  # (not SIGTERM: see the module's docstring)
        limit = self.cfg.drain_delay_s + self.cfg.grace_period_s + STOP_MARGIN_S
        deadline = time.monotonic() + limit
        for process in live:
            await asyncio.to_thread(process.join, max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                log.error("frontend pid %d still running after %.0f s: killed", process.pid, limit)
                process.kill()
                await asyncio.to_thread(process.join)
            elif process.exitcode != 0 and not self.failed:
                self.failed = f"frontend pid {process.pid} exited with {process.exitcode}"
            metrics.process_gone(process.pid)
        await self.host.close()
        if self.serving is not None:
            await self.serving.close()
            spill_on_stop(self.serving.engine)  # every frontend drained: nothing in flight
        self.compute.shutdown()
        clean_shared_memory(os.getpid())
        shutil.rmtree(self.run_dir, ignore_errors=True)
        log.info("stopped")


def _tell(process: multiprocessing.process.BaseProcess, signum: int) -> None:
    """Sends a frontend one of the engine's signals, unless it has exited (and been reaped:
    a pid not yet reaped is still its own)."""
    if process.exitcode is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signum)


def run(cfg: ServerConfig, early: EarlyStop | None = None) -> int:
    """The process's exit code: 0 after a signal, 1 when it could not start or a frontend
    kept dying. early: stop signals received before (main.py)."""
    return busy_poll.run(EngineProcess(cfg, early).run(), cfg.busy_poll_us)
