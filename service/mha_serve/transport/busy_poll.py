"""Busy polling of a server process's event loop (ServerConfig.busy_poll_us).

An idle asyncio loop blocks in epoll until gRPC's poller thread (or the engine link's
socket) wakes it: the thread sleeps, the kernel may move it to another core, and the next
message's work (and a lone decode step run on the loop's thread) starts on a core whose
caches and clock went cold meanwhile. With busy polling the loop first polls without
blocking (epoll with timeout 0) for up to busy_poll_us, and only then blocks for the rest of
its timeout: a message that arrives within the window is taken at once, by a thread that
never slept. The cost is CPU: at most busy_poll_us of one core each time the loop runs out
of work, none while it has work (under load it never idles), and none while a batch of
this process computes on its compute thread (batching.computing(): the loop would take a
core and the interpreter lock that thread needs, and a step too large to run on the loop's
thread was measured slower so). For a machine the server has to itself; off (0) by
default.
"""

from __future__ import annotations

import asyncio
import os
import selectors
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

from mha_serve.batching.batcher import computing

T = TypeVar("T")


class BusyPollSelector(selectors.DefaultSelector):
    """The platform's default selector (epoll on Linux), polling without blocking for
    `spin_s` before it blocks for what is left of a select's timeout."""

    def __init__(self, spin_s: float) -> None:
        super().__init__()
        self.spin_s = spin_s

    def select(self, timeout: float | None = None) -> list:
        if (timeout is not None and timeout <= 0) or computing():
            # (a batch on a compute thread of this process: the cores are its)
            return super().select(timeout)
        start = time.perf_counter()
        end = start + self.spin_s
        while True:
            ready = super().select(0)
            if ready:
                return ready
            now = time.perf_counter()
            if now >= end:
                break
            os.sched_yield()
        if timeout is not None:
            timeout = max(0.0, timeout - (now - start))
        return super().select(timeout)


def run(main: Coroutine[Any, Any, T], busy_poll_us: int = 0) -> T:
    """asyncio.run(main), its loop busy polling for busy_poll_us first when not 0."""
    if not busy_poll_us:
        return asyncio.run(main)
    spin_s = busy_poll_us * 1e-6
    with asyncio.Runner(
        loop_factory=lambda: asyncio.SelectorEventLoop(BusyPollSelector(spin_s))
    ) as runner:
        return runner.run(main)
