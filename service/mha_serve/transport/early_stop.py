"""Stop signals that come before the server's own handlers are in place: while Python
imports torch and the models load (a second or more), SIGTERM's default action ended the
process with -15 and SIGINT's a KeyboardInterrupt traceback. `mha-serve` installs these
first (main.py); the server, once its event loop's handlers replace them, stops as for a
signal received then: nothing was serving yet, and it exits 0. Standard library only."""

from __future__ import annotations

import signal
from types import FrameType, TracebackType
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class EarlyStop:
    """Counts SIGTERM/SIGINT from `with EarlyStop()` on, until an event loop takes them
    over (loop.add_signal_handler); the previous handlers come back at the end."""

    def __init__(self) -> None:
        self.received = 0
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> EarlyStop:
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._note)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _note(self, signum: int, frame: FrameType | None) -> None:
        self.received += 1
