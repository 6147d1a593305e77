"""bench/step_essentials.py runs with tiny counts: the three sides and every essential op are
timed and reported, and the steps reach the session (each round's 64 tokens kept).
Timings are not asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from step_essentials import OPS  # noqa: E402


def test_the_sides_and_every_op_are_timed(tmp_path):
    out = tmp_path / "essentials.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "step_essentials.py"), "--model", "mqa"]
        + ["--context", "80", "--rounds", "1", "--json-out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    data = json.loads(out.read_text())
    assert sorted(data["steps_us"]) == ["bare", "essential", "path"]
    assert all(v > 0 for v in data["steps_us"].values())
    assert list(data["ops_us"]) == OPS and all(v > 0 for v in data["ops_us"].values())
    for op in OPS:
        assert op in run.stdout
