"""The conversion command on real checkpoints: MiniLM (MHA, 12 heads) to GQA 4 and MQA, a
transformers-written Llama (GQA 2) to MQA; the written file keeps RoPE and reloads."""

from __future__ import annotations

import json

import pytest
import torch

from mha_serve.model import load_checkpoint
from mha_serve.model.convert import main, pool_kv_heads
from mha_serve.model.hf import load_hf_layer


@pytest.mark.parametrize(("kvh", "saved"), [(4, 2 / 3), (1, 11 / 12)])
def test_minilm_to_gqa_and_mqa(minilm_dir, tmp_path, capsys, kvh, saved):
    out = tmp_path / f"minilm_kv{kvh}.safetensors"
    argv = [str(minilm_dir), "--layer", "2", "--num-kv-heads", str(kvh), "--out", str(out)]
    assert main([*argv, "--samples", "2", "--seq-len", "16"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["kv_bytes_per_token_before"] == 2 * 12 * 32 * 4
    assert report["kv_bytes_saved_fraction"] == pytest.approx(saved)
    assert report["relative_error"] > 0.01, "untrained pooling must change the output"
    original, _ = load_hf_layer(minilm_dir, 2)
    x = torch.randn(1, 7, 384, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = pool_kv_heads(original, kvh)(x).output
        got = load_checkpoint(out)(x).output
    diff = (got - want).abs()  # the file holds exactly the pooled weights: float32 rounding only
    assert diff.max() < 1e-6, f"reloaded: max abs diff {diff.max():.3e}, mean {diff.mean():.3e}"


def test_llama_gqa_to_mqa_keeps_rope(hf_dirs, tmp_path, capsys):
    out = tmp_path / "llama_mqa.safetensors"
    assert (
        main([str(hf_dirs["llama"]), "--layer", "1", "--num-kv-heads", "1", "--out", str(out)]) == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert (report["num_kv_heads_before"], report["num_kv_heads_after"]) == (2, 1)
    original, _ = load_hf_layer(hf_dirs["llama"], 1)
    converted = load_checkpoint(out)
    assert converted.config.rope == original.config.rope and converted.config.causal
