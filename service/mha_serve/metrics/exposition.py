"""The HTTP /metrics endpoint: this process's registry, or in prometheus-client's multiprocess
mode (frontend workers) every process's files, the LIVE gauges and the process tree's figures;
and what becomes of a process's files once it has exited (process_gone)."""

from __future__ import annotations

import contextlib
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
from prometheus_client.mmap_dict import MmapedDict, mmap_key

from mha_serve.net import host_port

from .live import LIVE

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
# The kinds of files whose values outlive their process (a counter never goes down); a dead
# process's are added into one archive file per kind, `<kind>_archive.db`.
ARCHIVED_KINDS = ("counter", "histogram", "summary")
# Held by a scrape while it reads the files and by process_gone while it moves a dead
# process's values into the archive: a scrape sees them in one place, never both or neither.
_FILES_LOCK = threading.Lock()


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
        _Files(registry)
        registry.register(LIVE)
        registry.register(ProcessTree(others or list))
    try:
        start_http_server(port, addr=addr, registry=registry)
    except OSError as e:
        raise OSError(
            f"could not serve /metrics on {host_port(addr, port)} (--metrics-port, --metrics-host): "
            f"{e.strerror or e}"
        ) from e


class _Files(multiprocess.MultiProcessCollector):
    """Every process's files, read while no dead process's are being archived."""

    def collect(self):
        with _FILES_LOCK:
            return list(super().collect())


def process_gone(pid: int) -> None:
    """Multiprocess mode: a process exited and was reaped (a frontend worker). Its live*
    gauges stop counting (mark_process_dead); its counters and histograms are added into
    the archive files and its own files removed, so that their totals stay (a counter never
    goes down) while the files of dead processes do not pile up, each read at every scrape,
    as frontends die and are started again. (Briefly waits for a scrape reading the files.)"""
    if not multiprocess_mode():
        return
    path = os.environ[MULTIPROC_ENV]
    with _FILES_LOCK:
        multiprocess.mark_process_dead(pid, path)
        for kind in ARCHIVED_KINDS:
            _archive(path, kind, pid)


def _archive(path: str, kind: str, pid: int) -> None:
    """Adds the values of `<kind>_<pid>.db` into `<kind>_archive.db`, then removes it: as
    prometheus-client's MultiProcessCollector.merge reads them, sums per series (histogram
    buckets unaccumulated, as the files hold them), written back with the files' keys."""
    dead = os.path.join(path, f"{kind}_{pid}.db")
    if not os.path.exists(dead):
        return
    archive = os.path.join(path, f"{kind}_archive.db")
    files = [dead, archive] if os.path.exists(archive) else [dead]
    merged = multiprocess.MultiProcessCollector.merge(files, accumulate=False)
    new = archive + ".new"  # (not *.db: no scrape reads it)
    with contextlib.suppress(FileNotFoundError):
        os.remove(new)  # (one a crash left half written)
    out = MmapedDict(new)
    try:
        for metric in merged:
            for sample in metric.samples:
                labels = sample.labels
                key = mmap_key(
                    metric.name,
                    sample.name,
                    list(labels),
                    list(labels.values()),
                    metric.documentation,
                )
                out.write_value(key, sample.value, 0.0)
    finally:
        out.close()
    os.replace(new, archive)
    os.remove(dead)
