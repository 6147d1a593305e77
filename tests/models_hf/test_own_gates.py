"""Output gates from a projection of their own (hf_families.OWN_GATE), not q_proj's rows:
AFMoE's gate_proj (per dim); each family as its config class ships it, read as transformers
builds it; what they cannot serve exactly refused by name. (Parity over gRPC, sessions and
the null sweep are the shared tests', on reference.CHECKPOINTS.)"""

from __future__ import annotations

import pytest
import torch
from transformers import AfmoeConfig, AfmoeModel, AutoConfig

from mha_serve.model.hf import load_hf_layer
from mha_serve.model.hf_config import read_hf_layer
from tests.models_hf.reference import ROTARY, reference_attention
from tests.models_hf.test_config_json import checkpoint

AFMOE_MOE = {"num_experts": 2, "num_experts_per_tok": 1, "num_shared_experts": 1}
AFMOE_MOE["moe_intermediate_size"] = 32


@pytest.mark.parametrize("layer", [0, 3], ids=["local", "global"])
def test_afmoe_defaults_are_its_configs(tmp_path, layer):
    AutoConfig.for_model("afmoe").save_pretrained(tmp_path)
    c = read_hf_layer(tmp_path, layer).attention
    assert (c.embed_dim, c.num_heads, c.num_kv_heads, c.head_dim) == (2048, 16, 16, 128)
    assert c.output_gate and not c.output_gate_per_head and c.gate_width == 16 * 128
    assert c.qk_norm.scope == "head" and c.qk_norm.eps == 1e-5 and not c.bias
    if layer == 0:
        assert c.sliding_window == 1024 and c.rope.theta == 10000.0
    else:
        assert c.sliding_window is None and c.rope is None


@pytest.mark.parametrize("layer", [0, 1, 2], ids=["local", "local2", "global"])
def test_afmoe_layers_without_layer_types_as_its_config_derives_them(tmp_path, layer):
    """global_attn_every_n_layers 3, layer_types left out: AfmoeConfig derives local, local,
    global; each layer served as transformers computes it (its gate and biases: a zero bias
    on the gate beside biased projections)."""
    config = AfmoeConfig(
        num_key_value_heads=4,
        head_dim=8,
        attention_bias=True,
        sliding_window=5,
        global_attn_every_n_layers=3,
        **AFMOE_MOE,
        **{**ROTARY, "num_hidden_layers": 3},
    )
    directory = checkpoint(tmp_path, AfmoeModel, config, layer_types=None)
    base = AfmoeModel.from_pretrained(directory, attn_implementation="eager").eval()
    assert base.config.layer_types[layer] == (
        "full_attention" if layer == 2 else "sliding_attention"
    )
    with torch.no_grad():
        base.layers[layer].self_attn.gate_proj.weight.mul_(4.0)
    module, info = load_hf_layer(directory, layer)
    module.wgate.weight.data.copy_(base.layers[layer].self_attn.gate_proj.weight)
    assert torch.equal(module.wgate.bias, torch.zeros(64))
    assert (info.attention.rope is None) == (layer == 2)
    x = torch.randn(1, 12, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want, want_w = reference_attention("afmoe", base, layer, x)
        out = module(x, causal=True, need_weights=True)
    torch.testing.assert_close(out.output, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.weights, want_w, atol=1e-5, rtol=1e-5)
