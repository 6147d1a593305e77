"""The conversion command on real checkpoints: MiniLM (MHA, 12 heads) to GQA 4 and MQA, a
transformers-written Llama (GQA 2) to MQA; the written file keeps RoPE and reloads; q/k
normed layers pool exactly where heads agree. Pruned checkpoints served over gRPC equal
their originals with the heads masked; the head analysis of a Gemma 2 layer over gRPC."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from mha_client.heads import analyze_heads
from mha_serve.model import load_checkpoint
from mha_serve.model.convert import main, pool_kv_heads
from mha_serve.model.heads import analyze_heads as local_analysis
from mha_serve.model.hf import load_hf_layer
from tests.models_hf.conftest import PRUNED


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


@pytest.mark.parametrize("name", list(PRUNED))
def test_pruned_model_served_equals_the_original_with_heads_masked(served, name):
    """Over gRPC: the pruned checkpoint (MiniLM MHA; Gemma 2 without a KV group; Qwen3
    and GPT-OSS with one query head of each group gone) against the original model with those heads'
    head_mask at 0, stateless (padded) and in a session (prefill, decode past the window)."""
    client, models = served
    original, heads = PRUNED[name]
    info = {m.name: m for m in client.list_models()}
    H = info[original].num_heads
    assert info[name].num_heads == H - len(heads)
    gate = [0.0 if h in heads else 1.0 for h in range(H)]
    E = info[original].embed_dim
    x = np.random.default_rng(5).standard_normal((3, 20, E)).astype(np.float32)
    lengths = [20, 13, 4]
    want = client.attend(original, x, lengths=lengths, head_mask=gate).output
    got = client.attend(name, x, lengths=lengths).output
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    kv = [(info[m].kv_cache.bytes_per_token, info[m].num_kv_heads) for m in (original, name)]
    assert kv[1][0] * kv[0][1] == kv[0][0] * kv[1][1], "KV bytes in proportion to KV heads"
    with client.create_session(original) as a, client.create_session(name) as b:
        for lo, hi in ((0, 12), (12, 13), (13, 14), (14, 20)):
            want = a.step(x[0, lo:hi], head_mask=gate).output
            got = b.step(x[0, lo:hi]).output
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_gemma2_analysis_over_grpc_equals_the_layers_own(served, hf_dirs):
    """AnalyzeHeads on a soft-capped, windowed GQA layer."""
    client, _ = served
    x = np.random.default_rng(6).standard_normal((2, 14, 64)).astype(np.float32)
    report = analyze_heads(client, "gemma2", x, lengths=[14, 9])
    module, _ = load_hf_layer(hf_dirs["gemma2"], 0)
    want = local_analysis(module, torch.from_numpy(x), lengths=torch.tensor([14, 9]))
    np.testing.assert_allclose([h.importance for h in report.heads], want.importance, rtol=1e-5)
    assert report.least_important(3) == [p.head for p in want.pruning[:3]]


@pytest.mark.parametrize(
    ("name", "layer", "kvh"), [("qwen3", 1, 1), ("olmo2", 0, 2), ("gpt_oss", 0, 1)]
)
def test_gqa_conversion_keeps_the_options_and_is_exact_for_agreeing_heads(
    hf_dirs, name, layer, kvh
):
    """Pooling K/V heads of q/k-normed layers (per head; over the projection, whose k gains
    pool too) and of a layer with attention sinks (one per query head: kept): the options
    survive, and a layer whose grouped heads already agree (their
    K/V rows and gains made equal here) converts exactly."""
    module, _ = load_hf_layer(hf_dirs[name], layer)
    c = module.config
    D, KVH = c.head_dim, c.num_kv_heads
    with torch.no_grad():  # make each group's K/V heads (and k gains) equal
        group = KVH // kvh
        for part in (1, 2):  # k, v
            start = (c.num_heads + (part - 1) * KVH) * D
            w = module.wqkv.weight[start : start + KVH * D].view(kvh, group, D, -1)
            w.copy_(w[:, :1].expand_as(w).clone())
            if module.wqkv.bias is not None:
                b = module.wqkv.bias[start : start + KVH * D].view(kvh, group, D)
                b.copy_(b[:, :1].expand_as(b).clone())
        if c.qk_norm is not None and c.qk_norm.scope == "projection":
            g = module.k_norm.view(kvh, group, D)
            g.copy_(g[:, :1].expand_as(g).clone())
    pooled = pool_kv_heads(module, kvh)
    assert pooled.config.qk_norm == c.qk_norm and pooled.config.sliding_window == c.sliding_window
    assert pooled.config.sinks == c.sinks
    x = torch.randn(2, 16, c.embed_dim, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        diff = (pooled(x).output - module(x).output).abs().max()
    assert diff < 1e-5, f"{name}: max abs diff {diff:.3e}"


def test_gpt_oss_analysis_over_grpc_equals_the_layers_own(served, hf_dirs):
    """AnalyzeHeads on a layer with attention sinks (rows summing to less than 1): the
    server's report is the module's own analysis of the same inputs."""
    client, _ = served
    x = np.random.default_rng(7).standard_normal((2, 14, 64)).astype(np.float32)
    report = analyze_heads(client, "gpt_oss", x, lengths=[14, 9])
    module, _ = load_hf_layer(hf_dirs["gpt_oss"], 0)
    want = local_analysis(module, torch.from_numpy(x), lengths=torch.tensor([14, 9]))
    np.testing.assert_allclose([h.importance for h in report.heads], want.importance, rtol=1e-5)
    np.testing.assert_allclose([h.mean_entropy for h in report.heads], want.mean_entropy, rtol=1e-5)
    assert report.least_important(3) == [p.head for p in want.pruning[:3]]
