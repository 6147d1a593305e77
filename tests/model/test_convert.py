"""MHA -> GQA/MQA conversion by mean-pooling K/V heads: exact where the heads of a group are
equal already, the pooled weights are the means, the report's figures, the command."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from mha_serve.engine import Engine
from mha_serve.model import AttentionConfig, MultiHeadAttention, init_weights, load_checkpoint
from mha_serve.model.convert import conversion_report, main, pool_kv_heads
from mha_serve.model.weights import save_checkpoint
from mha_serve.spec import ModelSpec
from tests.engine_calls import req, run

ATOL = 1e-5  # float32, same math in another order
ROPE = {"theta": 10000.0}


def assert_close(got, want, what):
    diff = (got - want).abs()
    assert diff.max() < ATOL, f"{what}: max abs diff {diff.max():.3e}, mean {diff.mean():.3e}"


def gqa_as_mha(gqa: MultiHeadAttention) -> MultiHeadAttention:
    """The same function as an MHA module: each KV head repeated for its query heads."""
    c = gqa.config
    mha = MultiHeadAttention(dataclasses.replace(c, num_kv_heads=c.num_heads))
    H, KVH, D, G = c.num_heads, c.num_kv_heads, c.head_dim, c.group_size
    wq, wk, wv = gqa.wqkv.weight.detach().split([H * D, KVH * D, KVH * D])
    bq, bk, bv = gqa.wqkv.bias.detach().split([H * D, KVH * D, KVH * D])

    def rep(t):
        return t.reshape(KVH, D, *t.shape[1:]).repeat_interleave(G, 0).reshape(H * D, *t.shape[1:])

    mha.load_state_dict(
        {
            "wqkv.weight": torch.cat([wq, rep(wk), rep(wv)]),
            "wqkv.bias": torch.cat([bq, rep(bk), rep(bv)]),
            "wo.weight": gqa.wo.weight.detach(),
            "wo.bias": gqa.wo.bias.detach(),
        }
    )
    return mha.eval()


@pytest.mark.parametrize("rope", [None, ROPE])
@pytest.mark.parametrize("kvh", [2, 1])
def test_pooling_an_mha_whose_group_heads_agree_is_exact(kvh, rope):
    gqa = MultiHeadAttention(AttentionConfig(64, 8, kvh, rope=rope))
    init_weights(gqa, 3)
    mha = gqa_as_mha(gqa)
    x = torch.randn(2, 11, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert_close(mha(x, causal=True).output, gqa(x, causal=True).output, "MHA copy of GQA")
    back = pool_kv_heads(mha, kvh)
    assert back.config == gqa.config
    report = conversion_report(mha, back, x)
    assert report["max_abs_error"] < ATOL, report
    assert report["kv_bytes_per_token_before"] == 2 * 8 * 8 * 4
    assert report["kv_bytes_per_token_after"] == 2 * kvh * 8 * 4
    assert report["kv_bytes_saved_fraction"] == pytest.approx(1 - kvh / 8)


def test_pooled_weights_are_group_means_and_queries_are_kept():
    mha = MultiHeadAttention(AttentionConfig(32, 4))
    init_weights(mha, 5)
    gqa = pool_kv_heads(mha, 2)
    D = 8
    wk = mha.wqkv.weight[32:64].detach()
    want_k0 = (wk[0:D] + wk[D : 2 * D]) / 2  # KV head 0 = mean of heads 0 and 1
    assert torch.allclose(gqa.wqkv.weight[32 : 32 + D], want_k0, atol=1e-7)
    assert torch.equal(gqa.wqkv.weight[:32], mha.wqkv.weight[:32])
    assert torch.equal(gqa.wo.weight, mha.wo.weight)
    x = torch.randn(1, 9, 32)
    report = conversion_report(mha, gqa, x)
    assert report["max_abs_error"] > 1e-3, "random heads differ: pooling changes the output"


def test_num_kv_heads_must_divide():
    mha = MultiHeadAttention(AttentionConfig(48, 6))
    with pytest.raises(ValueError, match="num_kv_heads 4 must divide the model's 6"):
        pool_kv_heads(mha, 4)


def test_command_writes_a_servable_checkpoint_and_reports(tmp_path, capsys):
    gqa = MultiHeadAttention(AttentionConfig(64, 8, 2, rope=ROPE, causal=True))
    init_weights(gqa, 7)
    src = tmp_path / "mha.safetensors"
    save_checkpoint(gqa_as_mha(gqa), src)
    out = tmp_path / "gqa.safetensors"
    assert main([str(src), "--num-kv-heads", "2", "--out", str(out), "--samples", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["max_abs_error"] < ATOL and report["kv_bytes_saved_fraction"] == 0.75
    loaded = load_checkpoint(out)
    assert loaded.config == gqa.config  # GQA, RoPE and causal kept
    # served as it is written: the engine's session steps equal the converted forward
    engine = Engine(
        [ModelSpec("g", loaded.config, checkpoint=str(out))],
        device=torch.device("cpu"),
        dtype=torch.float32,
        max_response_bytes=2**24,
    )
    hosted = engine.get("g")
    x = torch.randn(1, 6, 64)
    full = run(engine, hosted, req("g", x, causal=True)).output
    sid = engine.create_session("g").session_id
    steps = [
        run(engine, hosted, req("g", x[:, a:b], session_id=sid)).output
        for a, b in ((0, 4), (4, 5), (5, 6))
    ]
    assert_close(torch.cat(steps, 1), full, "served converted steps")
    assert main([str(src), "--num-kv-heads", "3", "--out", str(out)]) == 2
    assert "must divide" in capsys.readouterr().err


@pytest.mark.parametrize("bias", [True, False])
def test_command_takes_a_torch_multihead_attention_file_given_its_heads(tmp_path, capsys, bias):
    """A torch.nn.MultiheadAttention state_dict (the checkpoint README serves) converts with
    --num-heads: kept at its K/V heads it equals torch's own module, pooled it equals
    pool_kv_heads; without --num-heads the command asks for it."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(64, 4, bias=bias, batch_first=True).eval()
    src = tmp_path / "torch.safetensors"
    save_file(mha.state_dict(), str(src))
    out = tmp_path / "out.safetensors"
    assert main([str(src), "--num-kv-heads", "4", "--out", str(out)]) == 2
    assert "give it with --num-heads N" in capsys.readouterr().err and not out.exists()
    x = torch.randn(2, 9, 64)
    with torch.no_grad():
        want, _ = mha(x, x, x, need_weights=False)
    for kvh in (4, 2):
        argv = [str(src), "--num-heads", "4", "--num-kv-heads", str(kvh), "--out", str(out)]
        assert main(argv) == 0
        assert json.loads(capsys.readouterr().out)["num_kv_heads_after"] == kvh
        converted = load_checkpoint(out)
        assert converted.config.bias is bias and converted.config.num_kv_heads == kvh
        with torch.no_grad():
            got = converted(x).output
        if kvh == 4:
            assert_close(got, want, "kept at 4 K/V heads vs torch's module")
        else:
            original = load_checkpoint(
                src, config=AttentionConfig(64, 4, bias=bias), dtype=torch.float32
            )
            with torch.no_grad():
                assert_close(got, pool_kv_heads(original, 2)(x).output, "pooled")
    assert main([str(out), "--num-heads", "4", "--num-kv-heads", "1", "--out", str(src)]) == 2
    assert "leave --num-heads out" in capsys.readouterr().err
