"""Which stop signal is the second: the frontend-workers engine passes a second SIGTERM/SIGINT
on to its frontends (their drain then ends at once), counting the signals it received, not
whether it is stopping, which a crash loop or a failed load sets with no signal at all.
(Over real processes: tests/reliability/test_lifecycle.py.)"""

from __future__ import annotations

import shutil

from mha_serve.config import ServerConfig
from mha_serve.transport.workers import EngineProcess, _Frontend


class Handle:
    """A frontend process's handle as _on_signal uses it: alive, and what it was sent."""

    def __init__(self) -> None:
        self.terminated = 0

    def is_alive(self) -> bool:
        return True

    def terminate(self) -> None:
        self.terminated += 1


def test_a_stop_without_a_signal_leaves_the_next_signal_a_first_one():
    engine = EngineProcess(ServerConfig(frontend_workers=2))
    try:
        handles = [Handle(), Handle()]
        for i, handle in enumerate(handles):
            engine.frontends[i] = _Frontend(i, handle, 0.0)
        engine.stopping.set()  # as a crash loop or a failed load stops it: no signal
        engine._on_signal()  # the operator's first SIGTERM: nothing passed on
        assert [h.terminated for h in handles] == [0, 0]
        engine._on_signal()  # a second: each frontend is told again, and hurries
        assert [h.terminated for h in handles] == [1, 1]
    finally:
        engine.compute.shutdown()
        shutil.rmtree(engine.run_dir, ignore_errors=True)


def test_the_first_signal_stops_and_the_second_is_passed_on():
    engine = EngineProcess(ServerConfig(frontend_workers=2))
    try:
        handle = Handle()
        engine.frontends[0] = _Frontend(0, handle, 0.0)
        engine._on_signal()
        assert engine.stopping.is_set() and handle.terminated == 0  # _stop tells them
        engine._on_signal()
        assert handle.terminated == 1
    finally:
        engine.compute.shutdown()
        shutil.rmtree(engine.run_dir, ignore_errors=True)
