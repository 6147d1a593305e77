"""Stop signals that come before the server's own handlers are in place, or after: while
Python imports torch and the models load (a second or more), SIGTERM's default action ended
the process with -15 and SIGINT's a KeyboardInterrupt traceback. `mha-serve` installs these
first (main.py); the server, once its event loop's handlers replace them, stops as for a
signal received then: nothing was serving yet, and it exits 0. Once the server has stopped,
the loop's end would give the signals their default action back for the rest of the exit
(joining threads, removing files, the interpreter's end): ignore_stop_signals keeps them
from ending it there. Standard library only."""

from __future__ import annotations

import signal
from collections.abc import Iterable
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # (main.py imports this first: nothing it need not)
    import asyncio

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def ignore_stop_signals(
    loop: asyncio.AbstractEventLoop, signals: Iterable[int] = STOP_SIGNALS
) -> None:
    """The server has stopped (its coroutine's last step): these signals are ignored from
    here to the process's exit, which then has the server's exit code. (loop.close() would
    remove the loop's handlers, giving back the default action: a signal arriving while
    the process ends would end it with that signal, -15, or a KeyboardInterrupt.)"""
    for sig in signals:
        loop.remove_signal_handler(sig)
        signal.signal(sig, signal.SIG_IGN)


class EarlyStop:
    """Counts SIGTERM/SIGINT from `with EarlyStop()` on, until an event loop takes them
    over (loop.add_signal_handler); the previous handlers come back at the end, unless
    another took a signal since (ignore_stop_signals: the process is ending)."""

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
            if signal.getsignal(sig) == self._note:  # (still ours: nothing ran)
                signal.signal(sig, handler)

    def _note(self, signum: int, frame: FrameType | None) -> None:
        self.received += 1
