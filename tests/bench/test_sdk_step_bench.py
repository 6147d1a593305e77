"""bench/sdk_step.py runs end to end with tiny counts, this checkout against itself as the
baseline: every side of every row measured (raw bytes, the SDK, the sync SDK, the SDK before) against
one real server, each in a client process of its own. Timings are not asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_every_side_of_every_row_is_measured(tmp_path):
    out = tmp_path / "sdk.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "sdk_step.py"), "--baseline-tree", str(ROOT)]
        + ["--rounds", "2", "--steps", "12", "--rows", "mqa:16,gqa:20"]
        + ["--json-out", str(out)],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(r["model"], r["context"]) for r in rows] == [("mqa", 16), ("gqa", 20)]
    for r in rows:
        assert sorted(r["median_us"]) == ["raw", "sdk", "sdk before", "sync"]
        assert all(v > 0 for v in r["median_us"].values()) and r["sdk_over_before"] > 0
        assert f"{r['model']} context {r['context']}: raw" in run.stdout
