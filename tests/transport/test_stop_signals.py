"""Stop signals with frontend workers. The engine process passes a second SIGTERM/SIGINT on
to its frontends (as HURRY_SIGNAL), counting the signals it received, not whether it is
stopping, which a crash loop or a failed load sets with no signal at all; it never sends
them SIGTERM or SIGINT. A frontend counts only SIGTERM/SIGINT as stop signals: the engine's
DRAIN_SIGNAL beside a terminal's SIGINT (a Ctrl-C reaches the whole group) is one drain.
(Over real processes: tests/reliability/test_lifecycle.py.)"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys

import pytest

from mha_serve.config import ServerConfig
from mha_serve.transport.frontend import FrontendSignals
from mha_serve.transport.grpc_server import GrpcServer
from mha_serve.transport.workers import EngineProcess, _Frontend

# Stands in for a frontend: blocks every signal one may get, then, for each line read, says
# which are pending (a signal sent to it is pending once kill() returns: no waiting).
STAND_IN = """
import signal, sys
names = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2")
signal.pthread_sigmask(signal.SIG_BLOCK, [getattr(signal, n) for n in names])
print("ready", flush=True)
for _ in sys.stdin:
    print(" ".join(sorted(s.name for s in signal.sigpending())) or "-", flush=True)
"""


class StandIn:
    """A real process where _on_signal expects a frontend's multiprocessing handle."""

    def __init__(self) -> None:
        self.popen = subprocess.Popen(
            [sys.executable, "-c", STAND_IN],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.popen.stdout.readline() == "ready\n"
        self.pid = self.popen.pid

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def pending(self) -> set[str]:
        self.popen.stdin.write("?\n")
        self.popen.stdin.flush()
        return set(self.popen.stdout.readline().split()) - {"-"}

    def close(self) -> None:
        self.popen.kill()
        self.popen.wait()
        self.popen.stdin.close()
        self.popen.stdout.close()


@pytest.fixture
def engine():
    engine = EngineProcess(ServerConfig(frontend_workers=2))
    stand_ins = []
    try:
        yield engine, stand_ins
    finally:
        for stand_in in stand_ins:
            stand_in.close()
        engine.compute.shutdown()
        shutil.rmtree(engine.run_dir, ignore_errors=True)


def _frontends(engine: EngineProcess, stand_ins: list, n: int) -> list[StandIn]:
    for i in range(n):
        stand_ins.append(StandIn())
        engine.frontends[i] = _Frontend(i, stand_ins[-1], 0.0)
    return stand_ins


def test_a_stop_without_a_signal_leaves_the_next_signal_a_first_one(engine):
    engine, stand_ins = engine
    frontends = _frontends(engine, stand_ins, 2)
    engine.stopping.set()  # as a crash loop or a failed load stops it: no signal
    engine._on_signal()  # the operator's first SIGTERM: nothing passed on
    assert [f.pending() for f in frontends] == [set(), set()]
    engine._on_signal()  # a second: each frontend is told to hurry
    assert [f.pending() for f in frontends] == [{"SIGUSR2"}, {"SIGUSR2"}]


def test_the_first_signal_stops_and_the_second_is_passed_on(engine):
    engine, stand_ins = engine
    (frontend,) = _frontends(engine, stand_ins, 1)
    engine._on_signal()
    assert engine.stopping.is_set() and frontend.pending() == set()  # _stop tells them
    engine._on_signal()
    assert frontend.pending() == {"SIGUSR2"}  # never SIGTERM: see the next test


async def test_a_frontend_drains_once_for_a_ctrl_c_and_the_engines_word():
    """A Ctrl-C: the terminal's SIGINT and the engine's DRAIN_SIGNAL, in either order, drain
    the frontend without hurrying it; a second SIGINT, or the engine's HURRY_SIGNAL, hurries."""
    for order in (("stop_signal", "drain"), ("drain", "stop_signal")):
        server = GrpcServer(ServerConfig(frontend_workers=2))
        signals = FrontendSignals(stop := asyncio.Event(), server)
        for name in order:
            getattr(signals, name)()
        assert stop.is_set() and not server._hurried.is_set(), order  # noqa: SLF001
        signals.stop_signal()  # a second Ctrl-C
        assert server._hurried.is_set(), order  # noqa: SLF001
    server = GrpcServer(ServerConfig(frontend_workers=2))
    signals = FrontendSignals(stop := asyncio.Event(), server)
    signals.drain()
    signals.hurry()  # the engine's word after the operator's second signal
    assert stop.is_set() and server._hurried.is_set()  # noqa: SLF001
