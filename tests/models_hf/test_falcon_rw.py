"""Falcon-RW (model_type "falcon", alibi true) served equal to FalconAttention's ALiBi path:
build_alibi_tensor's bias (bfloat16(slope) * position, rounded to bfloat16) added to q . k
before both are scaled by 1 / sqrt(head_dim), no RoPE, in each of FalconAttention's layouts.
(Parity over gRPC, sessions and transformers' incremental decode: the "falcon_rw" checkpoint
of reference.py, in the shared tests.)"""

from __future__ import annotations

import pytest
import torch
from transformers import FalconConfig, FalconForCausalLM
from transformers.models.falcon.modeling_falcon import build_alibi_tensor

from mha_serve.model.alibi import alibi_slopes
from mha_serve.model.hf import load_hf_layer
from mha_serve.model.hf_config import read_hf_layer
from tests.models_hf.reference import FALCON, reference_attention
from tests.models_hf.test_config_json import checkpoint


@pytest.mark.parametrize("H", range(1, 129))
def test_slopes_in_bfloat16_are_falcons(H):
    """Our float32 slopes rounded to bfloat16 are the slopes of Falcon's build_alibi_tensor
    (its bias at position 1), every head count up to 128 (Falcon-RW-7B has 71)."""
    theirs = build_alibi_tensor(torch.ones(1, 2, dtype=torch.long), H, torch.float32)[:, 0, 1]
    assert torch.equal(alibi_slopes(H).bfloat16().float(), theirs)


def test_the_bias_is_falcons_bfloat16_form_scaled_by_the_scores_factor(tmp_path):
    """The config read: ALiBi in Falcon-RW's form (bias scaled by 1 / sqrt(head_dim) = the
    scores' factor, bfloat16 terms), no RoPE, MHA over 12 heads with biases."""
    read = read_hf_layer(
        checkpoint(
            tmp_path,
            FalconForCausalLM,
            FalconConfig(alibi=True, multi_query=False, bias=True, **FALCON),
        ),
        1,
    )
    c = read.attention
    assert c.alibi and c.alibi_bfloat16 and c.rope is None and c.alibi_bias_max == 8.0
    assert c.alibi_scale == pytest.approx(8**-0.5) and c.scale == pytest.approx(8**-0.5)
    assert (c.num_heads, c.num_kv_heads, c.bias) == (8, 8, True)


@pytest.mark.parametrize(
    ("layout", "kv_heads"),
    [
        ({"multi_query": False}, 12),  # Falcon-RW-1B/7B: MHA, rows per head
        ({"multi_query": True}, 1),  # one KV head, [q_0..q_H-1; k; v]
        ({"new_decoder_architecture": True, "num_kv_heads": 4}, 4),  # GQA 12:4, per group
    ],
    ids=["mha", "multi_query", "new_decoder"],
)
def test_each_layout_with_alibi_equals_falcon_attention(tmp_path, layout, kv_heads):
    """FalconAttention's ALiBi path over its three fused layouts, past 256 positions (where a
    position itself is rounded to bfloat16), outputs and weights; random biases. Judged by
    transformers in float64 (the same bfloat16 bias): at 300 keys its own float32 is 1.4e-5
    off that, ours 1.0e-5."""
    config = FalconConfig(
        alibi=True,
        bias=True,
        **layout,
        **{**FALCON, "hidden_size": 96, "num_attention_heads": 12, "max_position_embeddings": 512},
    )
    torch.manual_seed(3)
    model = FalconForCausalLM(config)
    with torch.no_grad():
        for key, parameter in model.named_parameters():
            if key.endswith(".bias"):
                parameter.normal_(0.0, 0.2)
    model.save_pretrained(tmp_path, safe_serialization=True)
    base = FalconForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    base = base.double().eval()
    module, info = load_hf_layer(tmp_path, 1)
    assert info.attention.num_kv_heads == kv_heads
    x = torch.randn(1, 300, 96, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, want_w = reference_attention("falcon_rw", base.transformer, 1, x.double())
        got = module(x, need_weights=True)
    torch.testing.assert_close(got.output.double(), want, atol=3e-5, rtol=1e-5)
    torch.testing.assert_close(got.weights.double(), want_w, atol=3e-5, rtol=1e-5)
