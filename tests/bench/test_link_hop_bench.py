"""bench/link_hop.py end to end, tiny: both measures run in a checkout's own process, against a
baseline tree (this checkout again: every ratio is the same code's), and the table and JSON
say what they measured."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_the_bench_prints_both_sides_and_their_ratios(tmp_path):
    out = tmp_path / "link.json"
    run = subprocess.run(
        [
            *(sys.executable, str(ROOT / "bench" / "link_hop.py"), "--baseline-tree", str(ROOT)),
            *("--rounds", "2", "--messages", "50", "--calls", "64", "--window", "8"),
            *("--json-out", str(out)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    for message in ("call", "reply", "step call", "step reply"):
        assert re.search(rf"^\| {message} \| \d+ B, [\d.]+ / [\d.]+ \| \d+ B, ", run.stdout, re.M)
    assert re.search(r"^- now / before: [\d.]+$", run.stdout, re.M), run.stdout
    results = json.loads(out.read_text())
    assert set(results["sides"]) == {"now", "before"}
    assert [len(r) for r in results["rounds"].values()] == [2, 2]
    for side in results["sides"].values():
        # the same code both sides: the same frames; a call's 16 tokens of float32 ride in it
        assert side["codec"]["call"]["bytes"] > 16 * 512 * 4
        assert side["engine"]["cpu_us"] > 0 and side["engine"]["wall_us"] > 0
    now, before = (results["sides"][s]["codec"] for s in ("now", "before"))
    assert {m: c["bytes"] for m, c in now.items()} == {m: c["bytes"] for m, c in before.items()}
