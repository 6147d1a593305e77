"""bench/step_layers.py runs end to end with tiny counts, this checkout against itself as the
baseline: every layer of a streamed decode step's path (STEP_PATH: a plain step that finds
its lane idle, in one call) is found in the code and timed on both sides, and no other, no
layer takes longer than the layer around it, and the table names each.
Timings are not asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from step_layers import LAYERS, STEP_PATH, parents_of  # noqa: E402

pytestmark = pytest.mark.slow


def test_every_layer_is_timed_inside_the_one_around_it(tmp_path):
    out = tmp_path / "layers.json"
    run = subprocess.run(
        [
            *(sys.executable, str(ROOT / "bench" / "step_layers.py"), "--baseline-tree", str(ROOT)),
            *("--context", "64", "--steps", "8", "--rounds", "2", "--json-out", str(out)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    data = json.loads(out.read_text())
    labels = list(dict.fromkeys(label for label, *_ in LAYERS))
    parents = {label: parents_of(parent) for label, _, _, parent, _ in LAYERS}
    for side in ("now", "before"):
        layers = data["runs"][side]["layers"]
        # each layer of a plain decode step's path found in the code and called, no other
        assert sorted(layers) == sorted(STEP_PATH), side
        for label in STEP_PATH:
            ran = [p for p in parents[label] if p is None or p in layers]
            assert ran, (side, label)  # under a layer that ran: the last (the report's)
            if ran[-1] is not None:  # (a child's median under its parent's, with slack)
                assert layers[label] <= layers[ran[-1]] * 1.5 + 5, (side, label, layers)
        assert data["runs"][side]["round_trip_us"] > 0
    assert data["bare_us"] > 0 and data["bare_after_wait_us"] > 0
    for label in labels:
        assert label in run.stdout
