"""The threads that run torch in the server: one for every model's batched lane, one for weights.

torch's CPU builds use libgomp, which gives every thread that runs a parallel op an OpenMP
team of its own, kept alive with the thread. While a process holds more team threads than
there are cores, libgomp stops spinning between parallel regions and puts its threads to
sleep instead, so every op of a decode step pays a wake-up. With the models loaded on one
thread and each lane computing on another, a streamed MHA decode step at context 3500 took
6.3-7.1 ms end to end here; with loading and every batched lane on one thread, 4.7-5.0 ms
(the two alternated in one A/B run, 2 cores).

So one thread runs all multi-threaded torch work: loading, warm-up and every model's fast
lane (batches of different models take turns). Requests for attention weights keep a thread
of their own so that they never hold up the fast lanes; by default it runs torch
single-threaded, which starts no second team. On a machine with cores to spare, give it
more (`weights_torch_threads`), keeping both counts together within the cores.

A lone small request runs on the event loop's own thread instead (batching/inline.py:
no thread crossing): `on_caller` makes that thread's torch single-threaded, so it never
starts a team of its own either.

`pin_event_loop` (the server's event_loop_cpu) keeps the event loop's thread on one CPU.
Threads inherit their starter's CPUs, so the threads started from it afterwards (gRPC's,
/metrics') share that CPU, while the compute threads and asyncio's default executor take
back every CPU the process had (`unpin`, their initializer).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")


# The CPUs the process could run on before pin_event_loop pinned its thread (None: never).
_unpinned: frozenset[int] | None = None


def pin_event_loop(cpu: str) -> int:
    """Runs the calling thread (the event loop's) on one CPU alone: `cpu` is its number, or
    "auto" for the highest-numbered one the process may run on. Threads started from it
    afterwards inherit that, but for the compute threads and any thread `unpin` runs in.
    Returns the CPU. Linux only (sched_setaffinity)."""
    global _unpinned
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError("event_loop_cpu needs Linux (sched_setaffinity); use none here")
    allowed = frozenset(os.sched_getaffinity(0))
    cpu = max(allowed) if cpu == "auto" else int(cpu)
    if cpu not in allowed:
        raise ValueError(
            f"event_loop_cpu {cpu} is not a CPU this process may run on: "
            f"{', '.join(map(str, sorted(allowed)))}"
        )
    if _unpinned is None:
        _unpinned = allowed
    os.sched_setaffinity(0, {cpu})
    return cpu


def unpin() -> None:
    """The calling thread back on every CPU the process had before pin_event_loop (a thread
    started from the pinned event loop: a compute thread, the default executor's)."""
    if _unpinned is not None:
        os.sched_setaffinity(0, _unpinned)


def _use_threads(n: int) -> None:
    """This thread's torch intra-op threads. torch sets a thread's count from a process-wide
    value on its first op; asking for the count first does that, so a later call in another
    thread cannot change this one's."""
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


def _compute_thread(n: int) -> None:
    """A compute thread's start: every CPU the process had (unpin), n torch threads."""
    unpin()
    _use_threads(n)


class ComputeThreads:
    """`main`: the one multi-threaded torch thread; `weights`: the weights lane's thread;
    `analysis`: AnalyzeHeads' (one at a time, queued: a flood of them holds no other call)."""

    def __init__(self, torch_threads: int = 0, weights_torch_threads: int = 1) -> None:
        if weights_torch_threads < 1:
            raise ValueError(f"weights_torch_threads must be >= 1, got {weights_torch_threads}")
        self.torch_threads = torch_threads if torch_threads > 0 else torch.get_num_threads()
        self.weights_torch_threads = weights_torch_threads
        self.main = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="compute",
            initializer=_compute_thread,
            initargs=(self.torch_threads,),
        )
        self.weights = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="compute-weights",
            initializer=_compute_thread,
            initargs=(weights_torch_threads,),
        )
        self.analysis = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="compute-analysis",
            initializer=_compute_thread,
            initargs=(weights_torch_threads,),
        )

    def on_caller(self, fn: Callable[..., T]) -> Callable[..., T]:
        """fn for the caller's thread (the event loop's): torch runs single-threaded there,
        set on its first call. torch.set_num_threads also sets the count that threads yet
        to start take; a helper thread puts that back, so only the caller's changes."""
        local = threading.local()

        def run(*args, **kwargs) -> T:
            if not getattr(local, "single", False):
                default = torch.get_num_threads()
                _use_threads(1)
                restore = threading.Thread(target=torch.set_num_threads, args=(default,))
                restore.start()
                restore.join()
                local.single = True
            return fn(*args, **kwargs)

        return run

    def shutdown(self) -> None:
        """Waits for work already running; the executors take nothing after this."""
        self.main.shutdown(wait=True)
        self.weights.shutdown(wait=True)
        self.analysis.shutdown(wait=True)
