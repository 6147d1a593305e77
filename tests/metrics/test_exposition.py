"""/metrics with frontend workers (metrics/exposition.py): the process tree's figures, and
the files of a frontend that died. process_cpu_seconds_total is a counter: a process of the
tree that exits (a frontend that dies and is started again) keeps its CPU seconds in the
total, over a real child process; so do its counters and histograms, over a real server."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from prometheus_client import multiprocess
from prometheus_client.parser import text_string_to_metric_families

from mha_client.api import attention_pb2 as pb
from mha_client.api import attention_pb2_grpc as pb_grpc
from mha_serve.metrics import ProcessTree, process_gone
from tests.helpers import ServerProcess

CHILD_CPU_S = 0.5  # burnt by the child, as its own CPU time says (no wall-clock)
# /proc counts CPU in clock ticks, process_time() finer: the child shows at least this much.
SEEN_CPU_S = CHILD_CPU_S - 0.1
# A child that burns CHILD_CPU_S of CPU, says so, and exits once its stdin closes (the gate).
BURN = """
import sys, time
while time.process_time() < float(sys.argv[1]):
    pass
print("burnt", flush=True)
sys.stdin.read()
"""


def cpu_seconds(tree: ProcessTree) -> float:
    for family in tree.collect():
        if family.name == "process_cpu_seconds":
            return family.samples[0].value
    raise AssertionError("no process_cpu_seconds_total collected")


def test_a_child_that_exits_keeps_its_cpu_seconds_in_the_total():
    child = subprocess.Popen(
        [sys.executable, "-c", BURN, str(CHILD_CPU_S)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    live = [child.pid]
    tree = ProcessTree(lambda: list(live))  # what the engine process reports
    try:
        assert child.stdout.readline() == "burnt\n"
        alone = cpu_seconds(ProcessTree(list))  # this process and its children gone before
        with_child = cpu_seconds(tree)
        assert with_child >= alone + SEEN_CPU_S
    finally:
        child.stdin.close()
        child.wait()  # reaped, as the engine process joins a frontend that died
        child.stdout.close()
    live.clear()  # (gone from the frontends the engine lists)
    after = cpu_seconds(tree)
    print(f"\nCPU seconds: {alone:.2f} alone, {with_child:.2f} with the child, {after:.2f} after")
    assert after >= with_child  # a counter: it never goes down
    assert after >= alone + SEEN_CPU_S  # the child's seconds are still in it


# --- a process's files once it is gone (process_gone) ------------------------------------

# A process of the tree (as a frontend is): counts, observes and is in flight, then exits.
# Values that add exactly in any order (the archive adds them in another than a scrape).
CHILD = """
import os, sys
os.environ["PROMETHEUS_MULTIPROC_DIR"] = sys.argv[1]
from mha_serve import metrics
n = int(sys.argv[2])
metrics.count_lost("replica_killed", n)
metrics.count_moved()
for _ in range(n):
    metrics.observe_restore("mha", 0.25 * n)
metrics.in_flight(1)
metrics.READY.set(1)
"""


GAUGES = ("mha_serve_requests_in_flight", "mha_serve_ready")  # live: the live processes'


def scraped(folder: Path) -> dict[tuple, float]:
    """What /metrics would serve from the folder's files."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for m in multiprocess.MultiProcessCollector(None, path=str(folder)).collect()
        for s in m.samples
    }


def test_a_gone_process_files_are_archived_with_their_counts(tmp_path, monkeypatch):
    """Three real processes count, observe and exit; process_gone for each adds its
    counters and histograms into one archive per kind and removes its files: every counter
    and histogram sample reads the same after each as before, its live gauges drop out."""
    folder = tmp_path / "multiproc"
    folder.mkdir()
    for n in (1, 2, 3):
        child = subprocess.run(
            [sys.executable, "-c", CHILD, str(folder), str(n)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert child.returncode == 0, child.stderr
    pids = sorted({int(f.stem.rsplit("_", 1)[1]) for f in folder.glob("*.db")})
    assert len(pids) == 3
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(folder))
    before = scraped(folder)
    lost = ("mha_serve_sessions_lost_total", (("reason", "replica_killed"),))
    restores = ("mha_serve_session_restore_seconds_count", (("model", "mha"),))
    assert before[lost] == 6 and before[restores] == 6
    assert before[("mha_serve_requests_in_flight", ())] == 3
    for gone, pid in enumerate(pids, 1):
        process_gone(pid)
        after = scraped(folder)
        in_flight = after.pop(("mha_serve_requests_in_flight", ()), 0)
        ready = after.pop(("mha_serve_ready", ()), 0)
        assert (in_flight, ready) == (3 - gone, 1 if gone < 3 else 0)
        assert after == {k: v for k, v in before.items() if k[0] not in GAUGES}, gone
        files = sorted(f.name for f in folder.glob("*.db"))
        assert not [f for f in files if str(pid) in f], files
    assert files == ["counter_archive.db", "histogram_archive.db"]


# --- a frontend worker that dies and is started again ---------------------------------------

KILLS = 4  # alternating between the two frontends: never 3 quick deaths of one (a crash loop)
MAX_CHANNELS = 64  # fresh channels (the kernel picks a frontend for each) until one is hit
WAIT_S = 120.0


def frontend_pids(server: ServerProcess) -> dict[int, int]:
    """index -> pid of each frontend, the latest start of each (from the engine's log)."""
    found = re.findall(r"frontend worker (\d+) \(pid (\d+)\) listening", server.log())
    return {int(i): int(p) for i, p in found}


def requests_counted(folder: Path, pid: int) -> float:
    """mha_serve_requests_total in one process's own file (read as /metrics reads it)."""
    path = folder / f"counter_{pid}.db"
    if not path.exists():
        return 0.0
    return sum(
        s.value
        for m in multiprocess.MultiProcessCollector.merge([str(path)])
        if m.name == "mha_serve_requests"
        for s in m.samples
    )


def counts(server: ServerProcess) -> dict[tuple, float]:
    """Every counter and histogram sample of /metrics."""
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        if family.type in ("counter", "histogram")
        for s in family.samples
    }


def hit(server: ServerProcess, folder: Path, pid: int) -> None:
    """Calls over fresh channels until the frontend `pid` has counted one."""
    request = pb.GetModelInfoRequest(name="mha")
    for _ in range(MAX_CHANNELS):
        with grpc.insecure_channel(server.target) as channel:
            pb_grpc.AttentionServiceStub(channel).GetModelInfo(request, timeout=30)
        if requests_counted(folder, pid) > 0:
            return
    raise AssertionError(f"no call reached frontend pid {pid} over {MAX_CHANNELS} channels")


@pytest.mark.slow
def test_a_restarted_frontends_counts_are_kept_and_its_files_do_not_pile_up(tmp_path):
    """A frontend killed and started again, KILLS times over a real server: each dead
    frontend's counters and histograms are added into one archive file per kind and its
    files removed (mark_process_dead alone left them, every scrape reading every dead pid's
    files, forever); every counter and histogram /metrics serves is the same across each
    death (process_cpu_seconds_total never lower), and the folder holds only the live
    processes' files and the archives."""
    folder = tmp_path / "multiproc"
    folder.mkdir()
    server = ServerProcess(
        "--frontend-workers",
        "2",
        env={"PROMETHEUS_MULTIPROC_DIR": str(folder)},
        log_path=tmp_path / "server.log",
    )
    try:
        server.wait_serving()
        for kill in range(KILLS):
            index = kill % 2
            victim = frontend_pids(server)[index]
            hit(server, folder, victim)
            before = counts(server)
            os.kill(victim, signal.SIGKILL)
            deadline = time.monotonic() + WAIT_S
            while frontend_pids(server)[index] == victim:  # the engine logs its restart
                assert time.monotonic() < deadline, f"not started again:\n{server.log()}"
                time.sleep(0.1)
            after = counts(server)
            cpu = ("process_cpu_seconds_total", ())
            assert after.pop(cpu) >= before.pop(cpu)
            lower = {k: (v, after.get(k)) for k, v in before.items() if after.get(k) != v}
            assert not lower, f"after kill {kill + 1}, changed (before, after): {lower}"
            live = {str(server.proc.pid), *map(str, frontend_pids(server).values()), "archive"}
            files = sorted(f.name for f in folder.glob("*.db"))
            dead = [f for f in files if f.removesuffix(".db").rsplit("_", 1)[1] not in live]
            assert not dead, f"after kill {kill + 1}, dead processes' files: {dead}"
        assert "counter_archive.db" in files, files  # (a frontend observes no histogram)
        # each dead frontend had counted a call: none of them lost
        requests = sum(v for (name, _), v in after.items() if name == "mha_serve_requests_total")
        assert requests >= KILLS, after
    finally:
        code = server.stop()
    assert code == 0, server.log()
