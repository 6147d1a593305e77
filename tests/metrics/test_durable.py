"""The durable-session metrics (issue 24): what each function counts, the label values it
refuses, the spill tier's gauges read at scrape time, and all of it through /metrics in
prometheus-client's multiprocess mode (frontend workers), summed over processes."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from mha_serve import metrics
from tests.helpers import free_port

MODEL = "durable-test"  # a model name no other test counts under


def value(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_spills_count_sessions_by_reason_and_their_bytes():
    room = ("mha_serve_sessions_spilled_total", {"model": MODEL, "reason": "room"})
    before = value(room[0], **room[1]), value("mha_serve_spilled_bytes_total", model=MODEL)
    metrics.count_spilled(MODEL, 4096, "room")
    metrics.count_spilled(MODEL, 1000, "room")
    assert value(room[0], **room[1]) == before[0] + 2
    assert value("mha_serve_spilled_bytes_total", model=MODEL) == before[1] + 5096
    # the other reason's series exists from the first spill, at 0
    shutdown = {"model": MODEL, "reason": "shutdown"}
    assert REGISTRY.get_sample_value("mha_serve_sessions_spilled_total", shutdown) == 0


def test_restores_count_and_land_in_their_bucket():
    count = value("mha_serve_session_restores_total", model=MODEL)
    low = value("mha_serve_session_restore_seconds_bucket", model=MODEL, le="0.0025")
    high = value("mha_serve_session_restore_seconds_bucket", model=MODEL, le="0.005")
    metrics.observe_restore(MODEL, 0.003)
    assert value("mha_serve_session_restores_total", model=MODEL) == count + 1
    assert value("mha_serve_session_restore_seconds_bucket", model=MODEL, le="0.0025") == low
    assert value("mha_serve_session_restore_seconds_bucket", model=MODEL, le="0.005") == high + 1
    assert metrics.RESTORE_BUCKETS_S[0] == 0.001 and metrics.RESTORE_BUCKETS_S[-1] == 30.0


def test_adopted_moved_and_lost():
    adopted = value("mha_serve_sessions_adopted_total", model=MODEL)
    metrics.count_adopted(MODEL, 3)
    metrics.count_adopted(MODEL, 0)
    assert value("mha_serve_sessions_adopted_total", model=MODEL) == adopted + 3
    for reason in metrics.LOST_REASONS:  # exported from the start, at 0 or more
        assert REGISTRY.get_sample_value("mha_serve_sessions_lost_total", {"reason": reason}) >= 0
    lost = value("mha_serve_sessions_lost_total", reason="bad_file")
    metrics.count_lost("bad_file", 2)
    metrics.count_lost("bad_file")
    assert value("mha_serve_sessions_lost_total", reason="bad_file") == lost + 3
    moved = REGISTRY.get_sample_value("mha_serve_sessions_moved_total")
    assert moved is not None
    metrics.count_moved(4)
    metrics.count_moved()
    assert value("mha_serve_sessions_moved_total") == moved + 5


def test_unknown_reasons_are_refused_with_the_valid_ones():
    """A reason is a label value: an unbounded one would grow the series without end."""
    before = value("mha_serve_spilled_bytes_total", model=MODEL)
    with pytest.raises(ValueError, match=r"'evicted'.*\('room', 'shutdown'\)"):
        metrics.count_spilled(MODEL, 10, "evicted")
    assert value("mha_serve_spilled_bytes_total", model=MODEL) == before
    with pytest.raises(ValueError, match=r"'crashed'.*spill_full"):
        metrics.count_lost("crashed")
    assert REGISTRY.get_sample_value("mha_serve_sessions_lost_total", {"reason": "crashed"}) is None


def test_spill_gauges_are_read_at_scrape_time():
    live = metrics.LiveGauges()  # its own, not the registered LIVE
    held = SimpleNamespace(num_sessions=2, nbytes=3000, budget_bytes=10_000)
    live.watch_spill("", lambda: held)
    live.watch_spill("mha", lambda: SimpleNamespace(num_sessions=0, nbytes=0, budget_bytes=5))

    def read() -> dict[tuple[str, str], float]:
        return {
            (s.name, s.labels["model"]): s.value
            for family in live.collect()
            if family.name.startswith("mha_serve_spill_")
            for s in family.samples
        }

    assert read() == {
        ("mha_serve_spill_sessions", ""): 2,
        ("mha_serve_spill_bytes_used", ""): 3000,
        ("mha_serve_spill_budget_bytes", ""): 10_000,
        ("mha_serve_spill_sessions", "mha"): 0,
        ("mha_serve_spill_bytes_used", "mha"): 0,
        ("mha_serve_spill_budget_bytes", "mha"): 5,
    }
    held.num_sessions, held.nbytes = 3, 4500  # the next scrape sees the tier as it is
    assert read()[("mha_serve_spill_sessions", "")] == 3
    assert read()[("mha_serve_spill_bytes_used", "")] == 4500


# --- multiprocess mode ------------------------------------------------------------------

# Each process sets PROMETHEUS_MULTIPROC_DIR before prometheus-client is imported, as
# `mha-serve --frontend-workers N` does. The frontend counts and exits; the engine process
# counts, watches its caches and spill tier, serves /metrics and prints what it serves.
PRELUDE = """
import os, sys, urllib.request
from types import SimpleNamespace
os.environ["PROMETHEUS_MULTIPROC_DIR"] = sys.argv[1]
from mha_serve import metrics
"""
FRONTEND = """
metrics.count_lost("replica_killed")
metrics.count_moved(2)
"""
ENGINE = """
cache = SimpleNamespace(num_blocks=8, num_blocks_used=2, budget_bytes=8192, bytes_per_block=1024,
                        num_sessions=1, num_blocks_out_of_window=0)
for model in ("mha", "gqa"):
    metrics.watch_kv_cache(model, lambda: cache)
metrics.watch_spill("", lambda: SimpleNamespace(num_sessions=5, nbytes=7000, budget_bytes=9000))
metrics.count_spilled("mha", 3000, "room")
metrics.count_spilled("mha", 4000, "shutdown")
metrics.observe_restore("mha", 0.02)
metrics.count_adopted("gqa", 6)
metrics.count_lost("bad_file")
metrics.count_lost("replica_killed", 2)
metrics.count_moved()
port = int(sys.argv[2])
metrics.serve_metrics(port, "127.0.0.1")
print(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode())
"""


def run(code: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(PRELUDE + code), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


@pytest.fixture(scope="module")
def multiprocess_text(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("multiproc")
    run(FRONTEND, str(folder))
    return run(ENGINE, str(folder), str(free_port()))


def test_multiprocess_metrics_sum_every_process(multiprocess_text):
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(multiprocess_text)
        for s in family.samples
    }

    def get(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted(labels.items())))]

    assert get("mha_serve_sessions_lost_total", reason="replica_killed") == 3  # 1 + 2
    assert get("mha_serve_sessions_lost_total", reason="bad_file") == 1
    assert get("mha_serve_sessions_lost_total", reason="spill_full") == 0
    assert get("mha_serve_sessions_moved_total") == 3
    assert get("mha_serve_sessions_spilled_total", model="mha", reason="room") == 1
    assert get("mha_serve_sessions_spilled_total", model="mha", reason="shutdown") == 1
    assert get("mha_serve_spilled_bytes_total", model="mha") == 7000
    assert get("mha_serve_session_restores_total", model="mha") == 1
    assert get("mha_serve_session_restore_seconds_count", model="mha") == 1
    assert get("mha_serve_session_restore_seconds_bucket", model="mha", le="0.025") == 1
    assert get("mha_serve_session_restore_seconds_bucket", model="mha", le="0.01") == 0
    assert get("mha_serve_sessions_adopted_total", model="gqa") == 6
    # a model with a cache has its series from the start, at 0
    assert get("mha_serve_sessions_spilled_total", model="gqa", reason="room") == 0
    assert get("mha_serve_session_restore_seconds_count", model="gqa") == 0
    assert get("mha_serve_sessions_adopted_total", model="mha") == 0
    # the spill tier's gauges, from the engine process's live collector
    assert get("mha_serve_spill_sessions", model="") == 5
    assert get("mha_serve_spill_bytes_used", model="") == 7000
    assert get("mha_serve_spill_budget_bytes", model="") == 9000


def test_multiprocess_metrics_pass_promtool(multiprocess_text):
    beside = Path(sys.executable).parent / "promtool"  # .ci/get-promtool puts it there
    promtool = str(beside) if beside.exists() else shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not found: `make test` fetches it (.ci/get-promtool)")
    lint = subprocess.run(
        [promtool, "check", "metrics"],
        input=multiprocess_text,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert lint.returncode == 0, lint.stdout + lint.stderr
