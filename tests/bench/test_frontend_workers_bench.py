"""bench/frontend_workers.py runs end to end with tiny counts: real servers at N = 1 and 2,
both load paths (in process and a pool of client processes, for stateless loads and sessions
decoding together), its table with each N's ratio
to N = 1, its JSON, and every server exiting 0 on SIGTERM. Timings are not asserted."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("client_processes", [1, 2])
def test_the_bench_prints_its_table_and_the_servers_exit_0(tmp_path, client_processes):
    out = tmp_path / "fw.json"
    run = subprocess.run(
        [
            *(sys.executable, str(ROOT / "bench" / "frontend_workers.py"), "--workers", "1,2"),
            *("--rounds", "1", "--duration", "0.3", "--steps", "2", "--seq-lens", "16,128"),
            *("--concurrency", "4", "--channels", "4", "--sessions", "3", "--together-steps", "2"),
            *("--client-processes", str(client_processes), "--json-out", str(out)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    rows = {int(m[1]): m[0] for m in re.finditer(r"^\| (\d+) \|.*\|$", run.stdout, re.M)}
    assert sorted(rows) == [1, 2], run.stdout
    # N=1 is the base of every ratio: 16 tokens, 128 tokens, sessions together, the step.
    assert rows[1].count("| 1.00 |") == 4, rows[1]
    assert "3 gqa sessions x 2 steps together" in run.stdout
    assert "servers' exit codes on SIGTERM: N=1: 0, N=2: 0" in run.stdout
    assert re.search(r"machine: .+, \d+ cores", run.stdout)
    results = json.loads(out.read_text())
    assert [r["workers"] for r in results["rows"]] == [1, 2]
    assert results["exit_codes"] == {"1": 0, "2": 0}
    for row in results["rows"]:
        assert row["seq_per_s_16"] > 0 and row["seq_per_s_128"] > 0 and row["decode_p50_ms"] > 0
        assert row["together_tok_per_s"] > 0 and len(row["together_samples"]) == 1
        assert set(row["cores"]) == {
            "engine",
            "engine_loop",
            "engine_busiest_other",
            "frontends",
            "client",
            "steal",
            "server_ms_per_seq",
        }
        # the engine's threads are part of the engine process's total (read a moment apart,
        # in ticks of 10 ms over a 0.3 s load: a few ticks of slack)
        c = row["cores"]
        assert c["engine_loop"] >= 0 and c["engine_busiest_other"] >= 0
        assert c["engine_loop"] + c["engine_busiest_other"] <= c["engine"] + 0.2
