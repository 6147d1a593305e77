"""Head analysis: entropy and peak weight as the weights say, importance by ablation (a head
that writes nothing is worth nothing), the pruning curve's masks, padding ignored."""

from __future__ import annotations

import math

import pytest
import torch

from mha_serve.model import AttentionConfig, MultiHeadAttention, init_weights
from mha_serve.model.heads import analyze_heads, output_error

E, H = 32, 4


def make(**config):
    module = MultiHeadAttention(AttentionConfig(E, H, **config))
    init_weights(module, 1)
    return module.eval()


def test_with_attention_sinks_entropy_is_over_the_keys_share_and_peaks_as_returned():
    """Rows of a sinks model sum to less than 1 (the sink takes the rest): the entropy is
    that of the row renormalised over its keys (log(keys) still uniform, 0 one key), the
    peak the largest weight as returned; a sink far above every score leaves the keys
    uniform, whatever share it takes."""
    module = make(causal=True, sinks=True)
    x = torch.randn(2, 9, E, generator=torch.Generator().manual_seed(0))
    a = analyze_heads(module, x)
    w = module(x, need_weights=True).weights.double()  # (B, H, L, L)
    total = w.sum(-1)  # (B, H, L)
    assert (total < 1 - 1e-3).all() and (total > 0).all()
    p = w / total[..., None]
    entropy = -(p * p.clamp_min(1e-300).log()).sum(-1).mean((0, 2))
    assert torch.allclose(torch.tensor(a.mean_entropy, dtype=torch.float64), entropy, atol=1e-6)
    assert torch.allclose(
        torch.tensor(a.mean_max_weight, dtype=torch.float64), w.amax(-1).mean((0, 2)), atol=1e-6
    )
    with torch.no_grad():
        module.wqkv.weight.zero_()  # every score 0: uniform over the keys each row sees
        module.wqkv.bias.zero_()
        module.sinks.fill_(30.0)  # and nearly all of each row on the sink
    a = analyze_heads(module, x)
    uniform = sum(math.log(i + 1) for i in range(9)) / 9  # causal row i sees i + 1 keys
    assert a.mean_entropy == pytest.approx([uniform] * H, rel=1e-9)
    assert max(a.mean_max_weight) < 1e-12


def test_stats_match_the_weights_and_a_silent_head_is_pruned_first():
    module = make()
    with torch.no_grad():
        module.wo.weight[:, 16:24] = 0.0  # head 2 writes nothing to the output
    x = torch.randn(2, 9, E, generator=torch.Generator().manual_seed(0))
    a = analyze_heads(module, x, include_weights=True)
    w = module(x, need_weights=True).weights.double()  # (B, H, L, L)
    entropy = -(w * w.clamp_min(1e-300).log()).sum(-1).mean((0, 2))
    assert torch.allclose(torch.tensor(a.mean_entropy, dtype=torch.float64), entropy, atol=1e-6)
    assert torch.allclose(
        torch.tensor(a.mean_max_weight, dtype=torch.float64), w.amax(-1).mean((0, 2)), atol=1e-6
    )
    assert all(0 <= e <= math.log(9) + 1e-6 for e in a.mean_entropy)
    assert a.importance[2] == 0.0 and min(a.importance[h] for h in (0, 1, 3)) > 1e-3
    assert [p.num_pruned for p in a.pruning] == [1, 2, 3, 4]
    assert a.pruning[0].head == 2 and a.pruning[0].output_error == 0.0
    order = [p.head for p in a.pruning]
    assert sorted(order) == list(range(H))
    for p in a.pruning:  # each level's mask zeroes exactly the heads pruned so far
        assert [h for h in range(H) if p.head_mask[h] == 0.0] == sorted(order[: p.num_pruned])
        gate = torch.tensor(p.head_mask)
        assert p.output_error == pytest.approx(
            output_error(module(x, head_mask=gate).output, module(x).output), rel=1e-9
        )
    assert a.weights.shape == (H, 9, 9) and torch.equal(a.weights, w[0].float())


def test_padding_is_ignored():
    module = make(causal=True)
    x = torch.randn(2, 7, E, generator=torch.Generator().manual_seed(1))
    x[1, 4:] = 1e3  # padding: must change nothing
    padded = analyze_heads(module, x, lengths=torch.tensor([7, 4]), include_weights=True)
    first = analyze_heads(module, x[:1])
    second = analyze_heads(module, x[1:, :4])
    for h in range(H):  # stats over 7 + 4 real rows: the row-weighted mean of the two
        want = (7 * first.mean_entropy[h] + 4 * second.mean_entropy[h]) / 11
        assert padded.mean_entropy[h] == pytest.approx(want, rel=1e-6)
    assert padded.weights.shape == (H, 7, 7)
