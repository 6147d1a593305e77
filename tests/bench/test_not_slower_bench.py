"""bench/not_slower.py runs end to end with tiny counts (4 clients per Attend point), this
checkout against itself as the baseline: its four rows (decode together, Attend at 128 and
1024 tokens, frontend workers), each with both sides measured in every round and a ratio.
Timings are not asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_the_bench_measures_both_sides_of_every_row(tmp_path):
    out = tmp_path / "ns.json"
    run = subprocess.run(
        [
            *(sys.executable, str(ROOT / "bench" / "not_slower.py"), "--baseline-tree", str(ROOT)),
            *("--rounds", "1", "--steps", "2", "--sessions", "4", "--context", "16"),
            *("--duration", "0.3", "--clients", "4", "--json-out", str(out)),
        ],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["load"] for r in rows] == [
        "4 sessions decoding together",
        "Attend 128 tokens, 4 clients",
        "Attend 1024 tokens, 4 clients",
        "frontend workers 2, Attend 16 tokens, 4 clients",
    ]
    for r in rows:
        assert r["after"] > 0 and r["before"] > 0 and r["ratio"] > 0, r
    assert "after/before" in run.stdout
