"""The HTTP /metrics endpoint: this process's registry, or in prometheus-client's multiprocess
mode (frontend workers) every process's files, the LIVE gauges and the process tree's figures."""

from __future__ import annotations

import os
import resource
import threading
from collections.abc import Callable, Iterator

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    ProcessCollector,
    multiprocess,
    start_http_server,
)

from mha_serve.net import host_port

from .live import LIVE

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def multiprocess_mode() -> bool:
    """Whether this process writes its metrics to PROMETHEUS_MULTIPROC_DIR's files."""
    return bool(os.environ.get(MULTIPROC_ENV))


class ProcessTree:
    """process_* (CPU seconds, memory, open files) summed over this process and `others()`
    (the frontend workers), so that one server's CPU and memory are what the dashboard
    shows whether it runs in one process or several; the start time is this process's.

    process_cpu_seconds_total is a counter, and a frontend that dies and is started again
    must not take its CPU seconds with it (rate() would read the drop as a counter reset
    and a spike): it adds the CPU of this process's children that have exited and been
    reaped (RUSAGE_CHILDREN), and it never reports less than it reported before (a child
    reaped while one scrape reads it is counted twice for that scrape, then held)."""

    SUMMED = (
        "process_cpu_seconds_total",
        "process_resident_memory_bytes",
        "process_virtual_memory_bytes",
        "process_open_fds",
    )
    CPU = "process_cpu_seconds_total"

    def __init__(self, others: Callable[[], list[int]]) -> None:
        self.others = others
        self._cpu_reported = 0.0  # the highest process_cpu_seconds_total given
        self._lock = threading.Lock()  # (scrapes may run at once, one thread each)

    def collect(self) -> Iterator:
        families = {}
        for pid in [os.getpid(), *self.others()]:
            collector = ProcessCollector(pid=lambda p=pid: p, registry=None)
            for family in collector.collect():  # nothing for a process gone meanwhile
                name = family.name + ("_total" if family.type == "counter" else "")
                if name not in families:
                    families[name] = family
                elif name in self.SUMMED:
                    kept = families[name].samples[0]
                    value = kept.value + family.samples[0].value
                    families[name].samples[0] = kept._replace(value=value)
        cpu = families.get(self.CPU)
        if cpu is not None:  # (read after the live ones: a child reaped meanwhile is kept)
            exited = resource.getrusage(resource.RUSAGE_CHILDREN)
            kept = cpu.samples[0]
            with self._lock:
                total = max(self._cpu_reported, kept.value + exited.ru_utime + exited.ru_stime)
                self._cpu_reported = total
            cpu.samples[0] = kept._replace(value=total)
        return iter(families.values())


def serve_metrics(
    port: int, host: str = "0.0.0.0", *, others: Callable[[], list[int]] | None = None
) -> None:
    """Starts the HTTP /metrics endpoint in a background thread: this process's metrics,
    or in multiprocess mode every process's files, this process's LIVE gauges and the
    process_* figures of this process and `others()`. host: an address or name, an IPv6
    address with or without brackets. OSError saying which port when it cannot listen."""
    addr = host.strip("[]")
    registry = REGISTRY
    if multiprocess_mode():
        registry = CollectorRegistry(auto_describe=True)
        multiprocess.MultiProcessCollector(registry)
        registry.register(LIVE)
        registry.register(ProcessTree(others or list))
    try:
        start_http_server(port, addr=addr, registry=registry)
    except OSError as e:
        raise OSError(
            f"could not serve /metrics on {host_port(addr, port)} (--metrics-port, --metrics-host): "
            f"{e.strerror or e}"
        ) from e


def process_gone(pid: int) -> None:
    """Multiprocess mode: a process exited; its live* gauges stop counting."""
    if multiprocess_mode():
        multiprocess.mark_process_dead(pid)
