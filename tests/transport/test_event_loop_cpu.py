"""--event-loop-cpu: the event loop's thread (and the threads started from it: gRPC's) runs
on one CPU, the compute threads on every CPU the process had; bad values are refused with a
message that says why. Linux only (sched_setaffinity); the affinity is read back from the
kernel (/proc and os.sched_getaffinity), never timed."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from mha_client.sdk import Client
from mha_serve.config import build_config
from mha_serve.engine import threads
from tests.helpers import ServerProcess

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity"), reason="CPU affinity is Linux-only (sched_setaffinity)"
)

ALLOWED = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else frozenset()


@pytest.mark.parametrize("value", ["none", "auto", "0", " AUTO "])
def test_the_setting_takes_none_auto_or_a_number(value):
    assert build_config(None, {"event_loop_cpu": value}).event_loop_cpu == value.strip().lower()


@pytest.mark.parametrize("value", ["-1", "two", "1.5", ""])
def test_other_values_are_refused_saying_what_is_taken(value):
    with pytest.raises(ValueError, match="is not none, auto or a CPU's number"):
        build_config(None, {"event_loop_cpu": value})


def test_frontend_workers_are_pinned_by_process_not_by_this_setting():
    with pytest.raises(ValueError, match="pin the processes instead"):
        build_config(None, {"event_loop_cpu": "auto", "frontend_workers": 2})


def _in_a_thread(fn):
    """fn() on a thread of its own (its pin never reaches the test's thread); its result."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # handed to the caller
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


@pytest.fixture
def restore_unpinned(monkeypatch):
    monkeypatch.setattr(threads, "_unpinned", None)


def test_the_pinned_thread_and_its_children_run_on_one_cpu_compute_threads_on_all(
    restore_unpinned,
):
    def pinned():
        cpu = threads.pin_event_loop("auto")
        mine = os.sched_getaffinity(0)
        child = _in_a_thread(lambda: os.sched_getaffinity(0))  # started here: inherits
        compute = ThreadPoolExecutor(1, initializer=threads._compute_thread, initargs=(1,))
        try:
            theirs = compute.submit(os.sched_getaffinity, 0).result()
        finally:
            compute.shutdown()
        return cpu, mine, child, theirs

    cpu, mine, child, theirs = _in_a_thread(pinned)
    assert cpu == max(ALLOWED)
    assert mine == child == {cpu}
    assert theirs == ALLOWED
    assert os.sched_getaffinity(0) == ALLOWED  # the test's own thread never was pinned


def test_a_cpu_the_process_may_not_use_is_refused_naming_those_it_may(restore_unpinned):
    outside = max(ALLOWED) + 1
    with pytest.raises(ValueError, match=f"event_loop_cpu {outside} is not a CPU"):
        _in_a_thread(lambda: threads.pin_event_loop(str(outside)))
    assert threads._unpinned is None  # nothing pinned, nothing to take back


def _allowed_list(pid: int, tid: int) -> str:
    status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
    return next(
        line.split()[1] for line in status.splitlines() if line.startswith("Cpus_allowed_list")
    )


def test_a_pinned_server_serves_with_its_loop_on_one_cpu(tmp_path):
    proc = ServerProcess("--event-loop-cpu", "auto", log_path=tmp_path / "mha-serve.log")
    try:
        proc.wait_serving()
        with Client(proc.target) as client:
            session = client.create_session("gqa")
            x = np.random.default_rng(0).standard_normal((3, 512), dtype=np.float32)
            out = session.step(x)  # the prompt (crosses to the compute thread: 3 tokens)
            step = session.step(x[:1])  # a lone decode step: on the pinned loop's thread
            assert out.output.shape == (3, 512) and step.output.shape == (1, 512)
        pid = proc.proc.pid
        tasks = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        lists = {tid: _allowed_list(pid, tid) for tid in tasks}
        assert lists[pid] == str(max(ALLOWED))  # the main thread runs the event loop
        # the compute threads (loading, warm-up, the prompt) keep every CPU
        full = _allowed_list(os.getpid(), os.getpid())
        assert len(ALLOWED) == 1 or full in lists.values()
        assert f"event loop pinned to CPU {max(ALLOWED)}" in proc.log()
    finally:
        assert proc.stop() == 0, proc.log()


def test_a_server_asked_for_a_cpu_it_may_not_use_exits_saying_so(tmp_path):
    outside = max(ALLOWED) + 1
    result = subprocess.run(
        [sys.executable, "-m", "mha_serve.transport.main", "--host", "127.0.0.1"]
        + ["--port", "0", "--metrics-port", "0", "--event-loop-cpu", str(outside)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1, result.stderr
    assert f"event_loop_cpu {outside} is not a CPU this process may run on" in result.stderr
