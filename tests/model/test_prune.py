"""Head pruning: the pruned model equals the original with those heads masked (fp32), for
every variant and family option; its compute and KV bytes shrink in proportion; the
selection of the least important heads or groups; what cannot be pruned exactly is refused."""

from __future__ import annotations

import json

import pytest
import torch

from mha_serve.model import AttentionConfig, MultiHeadAttention, init_weights, load_checkpoint
from mha_serve.model.config import QKNormConfig, RopeConfig
from mha_serve.model.convert import main
from mha_serve.model.heads import analyze_heads, group_importance
from mha_serve.model.prune import cost_per_token, kept_heads, least_important, prune_heads

ATOL = 1e-5


def make(num_heads=8, num_kv_heads=None, seed=0, **options) -> MultiHeadAttention:
    module = MultiHeadAttention(AttentionConfig(48, num_heads, num_kv_heads, 12, **options))
    init_weights(module, seed)
    return module.eval()


def masked(module, heads):
    gate = torch.ones(module.config.num_heads)
    gate[heads] = 0
    return gate


def assert_equals_masked(module, pruned, heads, *, causal=True):
    x = torch.randn(3, 10, 48, generator=torch.Generator().manual_seed(1))
    lengths = torch.tensor([10, 6, 3])
    with torch.no_grad():
        want = module(x, lengths=lengths, causal=causal, head_mask=masked(module, heads)).output
        got = pruned(x, lengths=lengths, causal=causal).output
        # the cached path too: a prefill and two decode steps
        q, k, v = pruned.project(x[:1])
        steps = [
            pruned.attend_cached(
                q[:, :, a:b], [(k[:, :, :b], v[:, :, :b])], past_lengths=[a], new_lengths=[b - a]
            ).output
            for a, b in ((0, 8), (8, 9), (9, 10))
        ]
    diff = (got - want).abs().max()
    assert diff < ATOL, f"pruned vs masked: max abs diff {diff:.3e}"
    if causal:
        diff = (torch.cat(steps, dim=1) - want[:1]).abs().max()
        assert diff < ATOL, f"pruned session steps vs masked: max abs diff {diff:.3e}"


OPTIONS = {
    "plain": {},
    "rope_window": {"rope": RopeConfig(), "sliding_window": 4},
    "norm_softcap": {"qk_norm": QKNormConfig("head"), "softcap": 2.0, "softmax_scale": 0.4},
    "no_bias": {"bias": False},
    "sinks": {"sinks": True, "rope": RopeConfig()},
}


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize(
    ("kvh", "heads", "after"),
    [
        (None, [0, 5, 6], (5, 5)),  # MHA: any heads, their K/V heads go with them
        (2, [4, 5, 6, 7], (4, 1)),  # GQA: a whole group
        (2, [1, 6], (6, 2)),  # GQA: one query head of each group
        (1, [2, 3, 7], (5, 1)),  # MQA: query heads; the one K/V head stays
    ],
)
def test_pruned_equals_masked(option, kvh, heads, after):
    module = make(num_kv_heads=kvh, **OPTIONS[option])
    pruned = prune_heads(module, heads)
    c = pruned.config
    assert (c.num_heads, c.num_kv_heads) == after
    assert c.head_dim == 12 and c.scale == module.config.scale
    assert_equals_masked(module, pruned, heads)
    if not option.startswith("rope"):
        assert_equals_masked(module, pruned, heads, causal=False)


def test_compute_and_kv_bytes_shrink_in_proportion():
    module = make(num_kv_heads=None)
    pruned = prune_heads(module, [1, 2, 3, 4])  # 8 -> 4 heads, 8 -> 4 KV heads
    before, after = cost_per_token(module.config, 4), cost_per_token(pruned.config, 4)
    assert after["kv_bytes"] * 2 == before["kv_bytes"] == 2 * 8 * 12 * 4
    assert after["projection_flops"] * 2 == before["projection_flops"]
    assert after["attention_flops_per_key"] * 2 == before["attention_flops_per_key"]
    params = [sum(p.numel() for p in m.parameters()) for m in (module, pruned)]
    assert params[1] - 48 == (params[0] - 48) // 2  # all but wo's bias halve


@pytest.mark.parametrize(
    ("kvh", "heads", "options", "piece"),
    [
        (2, [0, 1, 4], {}, "groups of unequal size (query heads kept per KV group: [2, 3])"),
        (None, list(range(8)), {}, "leaves no model"),
        (None, [8], {}, "out of range"),
        (None, [1, 1], {}, "name a head twice"),
        (None, [], {}, "name at least one"),
        (None, [3], {"qk_norm": QKNormConfig("projection")}, "normalises all heads"),
    ],
)
def test_what_cannot_be_pruned_exactly_is_refused(kvh, heads, options, piece):
    with pytest.raises(ValueError) as err:
        kept_heads(make(num_kv_heads=kvh, **options).config, heads)
    assert piece in str(err.value), str(err.value)


def test_least_important_heads_and_groups():
    mha, gqa, mqa = (make(num_kv_heads=n).config for n in (None, 2, 1))
    imp = [0.5, 0.1, 0.9, 0.2, 0.3, 0.05, 0.7, 0.8]
    assert least_important(mha, 3, unit="head", importance=imp) == [1, 3, 5]
    assert least_important(mqa, 2, unit="head", importance=imp) == [1, 5]
    # GQA by heads: the least important of each group, in equal numbers
    assert least_important(gqa, 2, unit="head", importance=imp) == [1, 5]
    with pytest.raises(ValueError, match="multiple of 2"):
        least_important(gqa, 3, unit="head", importance=imp)
    assert least_important(gqa, 1, unit="group", importance=imp, group_importance=[0.9, 0.2]) == [
        4,
        5,
        6,
        7,
    ]
    with pytest.raises(ValueError, match="one KV group"):
        least_important(mqa, 1, unit="group", importance=imp, group_importance=[1.0])


def test_group_importance_is_the_error_of_masking_a_group():
    module = make(num_kv_heads=2)
    x = torch.randn(2, 6, 48)
    errors = group_importance(module, x)
    with torch.no_grad():
        full = module(x).output
        alone = module(x, head_mask=masked(module, [0, 1, 2, 3])).output
    want = float((alone - full).double().norm() / full.double().norm())
    assert errors[0] == pytest.approx(want, rel=1e-6) and errors[1] > 0


def test_cli_drops_the_least_important_and_the_file_serves_them_masked(tmp_path, capsys):
    module = make(num_kv_heads=None, rope=RopeConfig(), sliding_window=5)
    from mha_serve.model import save_checkpoint

    src = tmp_path / "src.safetensors"
    save_checkpoint(module, src)
    out = tmp_path / "pruned.safetensors"
    argv = [str(src), "--drop-least-important", "3", "--out", str(out), "--samples", "2"]
    assert main([*argv, "--seq-len", "12"]) == 0
    report = json.loads(capsys.readouterr().out)
    x = torch.randn(2, 12, 48, generator=torch.Generator().manual_seed(0))  # the samples
    want = sorted(p.head for p in analyze_heads(module, x).pruning[:3])
    assert report["heads_removed"] == want
    assert (report["num_heads_before"], report["num_heads_after"]) == (8, 5)
    assert report["kv_bytes_per_token_after"] * 8 == report["kv_bytes_per_token_before"] * 5
    assert report["max_abs_diff_from_masked"] < ATOL and report["relative_error"] > 0
    pruned = load_checkpoint(out)
    assert pruned.config.sliding_window == 5 and pruned.config.rope == module.config.rope
    assert_equals_masked(module, pruned, want)
    # ranked by a saved `mha-client heads --json` report instead
    saved = tmp_path / "heads.json"
    imp = [0.9, 0.1, 0.8, 0.7, 0.6, 0.5, 0.4, 0.2]
    saved.write_text(
        json.dumps({"heads": [{"head": h, "importance": v} for h, v in enumerate(imp)]})
    )
    argv = [str(src), "--drop-least-important", "2", "--report", str(saved), "--out", str(out)]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["heads_removed"] == [1, 7]


@pytest.mark.parametrize(
    ("argv", "piece"),
    [
        (["--drop-heads", "0,x"], "comma-separated head numbers"),
        (["--drop-heads", "0,1,4"], "unequal size"),
        (["--drop-least-important", "3"], "k must be in 1..1 KV groups"),
        (["--drop-least-important", "3", "--unit", "head"], "multiple of 2"),
        (["--drop-heads", "0,1", "--out", "{src}"], "is the source's own weights file"),
        (["--drop-heads", "0,1", "--out", "{tmp}/none/o.safetensors"], "does not exist"),
        (["--drop-heads", "0,1", "--out", "{tmp}"], "is a directory"),
        (["--num-kv-heads", "1", "--inputs", "{src}"], "is not a .npy array of (L, 48)"),
        (["--num-kv-heads", "1", "--layer", "2"], "--layer is for a Hugging Face model"),
    ],
)
def test_cli_refusals_say_what_to_change(tmp_path, capsys, argv, piece):
    """Refused before anything is written: the source unchanged, no output file."""
    from mha_serve.model import save_checkpoint

    src = tmp_path / "gqa.safetensors"
    save_checkpoint(make(num_kv_heads=2), src)
    before = src.read_bytes()
    argv = [a.format(src=src, tmp=tmp_path) for a in argv]
    out = tmp_path / "o.safetensors"
    code = main([str(src), "--out", str(out), *argv, "--samples", "1"])
    err = capsys.readouterr().err
    assert code == 2 and piece in err, err
    assert src.read_bytes() == before and not out.exists()


@pytest.mark.parametrize(
    ("argv", "piece"),
    [
        (["--samples", "0"], "--samples: must be 1 or more, got 0"),
        (["--seq-len", "-3"], "--seq-len: must be 1 or more, got -3"),
    ],
)
def test_cli_refuses_sample_counts_below_one(tmp_path, capsys, argv, piece):
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path / "none.safetensors"), "--num-kv-heads", "1", "--out", "o", *argv])
    assert e.value.code == 2 and piece in capsys.readouterr().err


def test_cli_names_a_missing_source(tmp_path, capsys):
    missing = tmp_path / "none"
    argv = [str(missing), "--layer", "3", "--num-kv-heads", "1"]
    assert main([*argv, "--out", str(tmp_path / "o.safetensors")]) == 2
    assert f"source {missing} does not exist" in capsys.readouterr().err
