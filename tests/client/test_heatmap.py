"""Heatmap PNGs: a valid file per call, clear errors for bad shapes or a missing matplotlib."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from mha_client.heatmap import MATPLOTLIB_MISSING, require_matplotlib, save_heatmap

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("num_heads", [1, 3, 6])
def test_writes_a_png(tmp_path, num_heads):
    pytest.importorskip("matplotlib", reason="matplotlib is the optional 'plot' extra")
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((num_heads, 5, 7))
    weights = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    path = tmp_path / "w.png"
    save_heatmap(weights, list(range(num_heads)), path, title="test", query_start=2)
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert len(data) > 1000


def test_bad_inputs_say_what_was_expected(tmp_path):
    with pytest.raises(ValueError, match=r"expected \(heads, rows, keys\)"):
        save_heatmap(np.zeros((2, 2)), [0], tmp_path / "x.png")
    with pytest.raises(ValueError, match="1 head labels for 2 heads"):
        save_heatmap(np.zeros((2, 2, 2)), [0], tmp_path / "x.png")
    with pytest.raises(ValueError, match="empty"):
        save_heatmap(np.zeros((1, 0, 2)), [0], tmp_path / "x.png")


def test_missing_matplotlib_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    with pytest.raises(ImportError) as err:
        require_matplotlib()
    assert str(err.value) == MATPLOTLIB_MISSING
    assert "pip install 'mha-serve[plot]'" in MATPLOTLIB_MISSING
    with pytest.raises(ImportError, match="install matplotlib"):
        save_heatmap(np.full((1, 2, 2), 0.5), [0], tmp_path / "x.png")
