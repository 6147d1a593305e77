"""AnalyzeHeads over gRPC on a real MiniLM layer, from the SDK and `mha-client heads`:
the figures equal the model layer's own analysis, and --png writes both images."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from mha_client import ops
from mha_client.cli import main as cli_main
from mha_client.errors import MhaServeError
from mha_client.heads import analyze_heads, build_heads_request
from mha_serve.model.heads import analyze_heads as local_analysis
from mha_serve.model.hf import load_hf_layer


def test_sdk_report_equals_the_layers_own_analysis(served, minilm_dir):
    client, _ = served
    x = np.random.default_rng(0).standard_normal((2, 12, 384)).astype(np.float32)
    report = analyze_heads(client, "minilm1", x, lengths=[12, 8], include_weights=True)
    module, _ = load_hf_layer(minilm_dir, 1)
    want = local_analysis(module, torch.from_numpy(x), lengths=torch.tensor([12, 8]))
    assert [h.head for h in report.heads] == list(range(12))
    np.testing.assert_allclose([h.importance for h in report.heads], want.importance, rtol=1e-5)
    np.testing.assert_allclose([h.mean_entropy for h in report.heads], want.mean_entropy, rtol=1e-5)
    assert report.least_important(3) == [p.head for p in want.pruning[:3]]
    assert report.weights.shape == (12, 12, 12)
    np.testing.assert_allclose(report.weights.sum(-1), 1.0, atol=1e-5)
    req = build_heads_request("minilm1", x[0])
    req.attend.head_mask.extend([1.0] * 12)  # the analysis masks heads itself
    with pytest.raises(MhaServeError, match="leave head_mask empty") as err:
        client._run(ops.Rpc("AnalyzeHeads", req, lambda r, _: r), 10)
    assert err.value.code.name == "INVALID_ARGUMENT"
    req = build_heads_request("minilm1", x[0])
    req.attend.weights.enabled = True  # refused as the docs say, not silently ignored
    req.attend.weights.heads.append(99)
    with pytest.raises(MhaServeError, match="leave attend.weights unset") as err:
        client._run(ops.Rpc("AnalyzeHeads", req, lambda r, _: r), 10)
    assert err.value.code.name == "INVALID_ARGUMENT"


def test_cli_heads_prints_json_and_writes_pngs(served, tmp_path, capsys):
    client, _ = served
    prefix = tmp_path / "minilm0"
    code = cli_main(
        [
            "heads",
            "minilm0",
            "--random",
            "10",
            "--png",
            str(prefix),
            "--json",
            "--target",
            client.target,
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    report = json.loads(out)
    assert len(report["heads"]) == 12 and len(report["pruning"]) == 12
    assert report["pruning"][-1]["head_mask"] == [0.0] * 12
    for name in ("heatmap", "pruning"):
        png = tmp_path / f"minilm0-{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


async def test_async_client_gets_the_same_report(served):
    from mha_client.sdk import AsyncClient

    client, _ = served
    x = np.random.default_rng(3).standard_normal((6, 384)).astype(np.float32)
    want = analyze_heads(client, "minilm4", x)
    async with AsyncClient(client.target) as c:
        got = await analyze_heads(c, "minilm4", x)
    assert [h.importance for h in got.heads] == [h.importance for h in want.heads]
