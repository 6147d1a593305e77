"""Output gates from a projection of their own (hf_families.OWN_GATE), not q_proj's rows:
AFMoE's gate_proj (per dim), Ling 3.0's g_proj (per head, on its MLA layers), LFM3's g_proj
(per head, on its sliding and full layers, the full ones with proportional RoPE); each family
as its config class ships it, read as transformers builds it; what they cannot serve exactly
refused by name. (Parity over gRPC, sessions and
the null sweep are the shared tests', on reference.CHECKPOINTS.)"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AfmoeConfig, AfmoeModel, AutoConfig, BailingHybridModel, Lfm3Model

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


def test_ling3_as_shipped_serves_its_mla_layers_and_refuses_kda_naming_them(tmp_path):
    """BailingHybridConfig's defaults: every 6th layer MLA (q_proj, no q latent, RoPE by
    pairs, theta 6e6) with a sigmoid gate per head; the others KDA, refused naming them."""
    AutoConfig.for_model("bailing_hybrid").save_pretrained(tmp_path)
    c = read_hf_layer(tmp_path, 5).attention
    assert (c.embed_dim, c.num_heads, c.mla.kv_lora_rank, c.mla.v_head_dim) == (2560, 32, 512, 128)
    assert (c.mla.rope_dim, c.mla.nope_dim, c.mla.q_lora_rank) == (64, 128, None)
    assert c.rope.interleaved and c.rope.theta == 6e6 and not c.bias
    assert c.output_gate and c.output_gate_per_head and c.gate_width == 32
    with pytest.raises(ValueError) as err:
        read_hf_layer(tmp_path, 0)
    message = str(err.value)
    assert "layer 0 of bailing_hybrid is a 'linear_attention' layer" in message, message
    assert "KDA linear attention" in message and "[5, 11, 17, 23, 29, 35, 41]" in message


@pytest.fixture(scope="module")
def ling3(tmp_path_factory, hf_dirs):
    """The shared Ling 3.0 checkpoint (a KDA layer, then an MLA one) and transformers' model."""
    directory = hf_dirs["bailing_hybrid"]
    return directory, BailingHybridModel.from_pretrained(directory, attn_implementation="eager")


def _edited(tmp_path, directory, **edits):
    """A copy of the checkpoint directory with config.json's keys set (None: removed)."""
    copy = tmp_path / "edited"
    shutil.copytree(directory, copy)
    cfg = json.loads((copy / "config.json").read_text())
    for key, value in edits.items():
        cfg.pop(key, None) if value is None else cfg.__setitem__(key, value)
    (copy / "config.json").write_text(json.dumps(cfg))
    return copy


def test_ling3_reads_no_q_latent_and_derives_its_layers_as_its_config(tmp_path, ling3):
    """A q_lora_rank in config.json is not BailingHybridConfig's (its attention has q_proj
    only): not read; without layer_types, every layer_group_size-th layer is MLA."""
    directory, base = ling3
    edited = _edited(tmp_path, directory, q_lora_rank=8, layer_types=None, layer_group_size=2)
    assert AutoConfig.from_pretrained(edited).layer_types == ["linear_attention", "full_attention"]
    module, info = load_hf_layer(edited, 1)
    assert info.attention.mla.q_lora_rank is None
    x = torch.randn(1, 10, 64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want, _ = reference_attention("bailing_hybrid", base.eval(), 1, x)
        torch.testing.assert_close(module(x, causal=True).output, want, atol=1e-5, rtol=1e-5)


def test_ling3_without_its_gate_tensor_is_refused_naming_it(tmp_path, ling3):
    directory, _ = ling3
    copy = _edited(tmp_path, directory)
    tensors = load_file(str(copy / "model.safetensors"))
    del tensors["layers.1.attention.g_proj.weight"]
    save_file(tensors, str(copy / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing tensor 'layers.1.attention.g_proj.weight' "):
        load_hf_layer(copy, 1)


def test_lfm3_as_shipped_serves_its_attention_layers_and_names_what_it_refuses(tmp_path):
    """Lfm3Config's defaults: sliding layers 4, 8, ... (RoPE at 10000, a window of 256, a
    sigmoid gate per head) and full layers 2, 6, ... (its default table's proportional RoPE:
    theta 1e6, half of the frequencies non-zero, over the whole head) served; its
    short-convolution layers refused by name."""
    AutoConfig.for_model("lfm3").save_pretrained(tmp_path)
    c = read_hf_layer(tmp_path, 4).attention
    assert (c.embed_dim, c.num_heads, c.num_kv_heads, c.head_dim) == (2048, 16, 4, 128)
    assert c.output_gate and c.output_gate_per_head and c.gate_width == 16
    assert c.sliding_window == 256 and c.rope.theta == 10_000.0 and c.rope.partial == 1.0
    assert c.qk_norm.scope == "head" and c.qk_norm.eps == 1e-5 and not c.bias
    full = read_hf_layer(tmp_path, 2).attention
    assert full.sliding_window is None and full.output_gate_per_head and full.rope_dim == 128
    assert (full.rope.type, full.rope.theta, full.rope.partial, full.rope.factor) == (
        "proportional",
        1e6,
        0.5,
        1.0,
    )
    with pytest.raises(ValueError) as err:
        read_hf_layer(tmp_path, 0)
    message = str(err.value)
    assert "layer 0 of lfm3 is a 'conv' layer (a short convolution (Lfm3ShortConv)" in message
    assert "full_attention/sliding_attention layers are [2, 4, 6, 8," in message, message


def _lfm3_full_table(tmp_path, hf_dirs, edit, **beside):
    """A copy of the shared LFM3 checkpoint with its full_attention table edited (None:
    the key removed) and keys set beside the tables."""
    directory = tmp_path / "lfm3"
    shutil.copytree(hf_dirs["lfm3"], directory)
    path = directory / "config.json"
    cfg = json.loads(path.read_text())
    table = cfg["rope_parameters"]["full_attention"]
    for key, value in edit.items():
        table.pop(key) if value is None else table.__setitem__(key, value)
    path.write_text(json.dumps({**cfg, **beside}))
    return directory


@pytest.mark.parametrize(
    ("edit", "beside", "want"),
    [
        ({}, {}, (0.5, 2.0)),
        ({"partial_rotary_factor": None, "factor": None}, {}, (1.0, 1.0)),
        ({"partial_rotary_factor": None}, {"partial_rotary_factor": 0.25}, (0.25, 2.0)),
        ({"partial_rotary_factor": 0.3}, {"partial_rotary_factor": 0.25}, (0.3, 2.0)),
    ],
    ids=["table", "left_out", "beside_moved_in", "table_over_beside"],
)
def test_lfm3_full_layer_proportional_rope_as_transformers_reads_it(
    tmp_path, hf_dirs, edit, beside, want
):
    """The full table's partial_rotary_factor and factor, 1.0 where left out; a
    partial_rotary_factor beside the tables moved into one without its own (Lfm3Config's
    convert_rope_params_to_dict); int(0.3 * 16 // 2) = 2 frequencies turned: served as
    Lfm3Attention computes it, against transformers' own layer."""
    directory = _lfm3_full_table(tmp_path, hf_dirs, edit, **beside)
    base = Lfm3Model.from_pretrained(directory, attn_implementation="eager").eval()
    module, info = load_hf_layer(directory, 1)
    rope = info.attention.rope
    assert (rope.type, rope.theta, rope.partial, rope.factor) == ("proportional", 1000.0, *want)
    x = torch.randn(1, 40, 64, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want_out, want_w = reference_attention("lfm3", base, 1, x)
        out = module(x, causal=True, need_weights=True)
    torch.testing.assert_close(out.output, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.weights, want_w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("edit", "key"),
    [
        ({"factor": None}, "factor"),
        ({"partial_rotary_factor": 0}, "partial_rotary_factor"),
        ({"partial_rotary_factor": 1.5}, "partial_rotary_factor"),
        ({"factor": -2.0}, "factor"),
        ({"factor": "2"}, "factor"),
    ],
    ids=["null_factor", "partial_0", "partial_past_1", "negative_factor", "string_factor"],
)
@pytest.mark.parametrize("layer", [0, 1], ids=["sliding", "full"])
def test_lfm3_bad_proportional_table_is_refused_naming_its_key(tmp_path, hf_dirs, edit, key, layer):
    """A full_attention table from which transformers builds no model (a null, a string, a
    partial past 1: its rotary embedding fails, for every layer type at once) or turns what
    we do not serve (no frequency, negative ones): refused on both layers, naming the key."""
    directory = _lfm3_full_table(tmp_path, hf_dirs, {})
    cfg = json.loads((directory / "config.json").read_text())
    cfg["rope_parameters"]["full_attention"].update(edit)  # (a null kept, not removed)
    (directory / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=rf"rope_parameters\.full_attention\.{key} must be"):
        read_hf_layer(directory, layer)


@pytest.mark.parametrize("gate", [True, False], ids=["gated", "use_attention_gate_false"])
def test_lfm3_sliding_layer_with_and_without_its_gate(tmp_path, hf_dirs, gate):
    """use_attention_gate false: no g_proj, no gate (served as transformers runs it); a
    sliding table without rope_theta takes Lfm3Config's default_theta (1e6), not 10000."""
    directory = tmp_path / "lfm3"
    shutil.copytree(hf_dirs["lfm3"], directory)
    path = directory / "config.json"
    cfg = json.loads(path.read_text())
    cfg["rope_parameters"]["sliding_attention"].pop("rope_theta")
    cfg["use_attention_gate"] = gate
    path.write_text(json.dumps(cfg))
    base = Lfm3Model.from_pretrained(directory, attn_implementation="eager").eval()
    module, info = load_hf_layer(directory, 0)
    assert info.attention.output_gate == gate and info.attention.rope.theta == 1e6
    assert (module.wgate is not None) == gate
    x = torch.randn(1, 12, 64, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want, _ = reference_attention("lfm3", base, 0, x)
        torch.testing.assert_close(module(x, causal=True).output, want, atol=1e-5, rtol=1e-5)


def test_beam_as_shipped_serves_its_sliding_layers_and_refuses_its_position_scaled_ones(
    tmp_path,
):
    """BeamConfig's defaults: five sliding layers (RoPE at 10000, a window of 512) and a
    full one, whose null RoPE table means NoPE with queries scaled by position: refused by
    name. Its gate per dim carries gate_bias (one per head) as wgate's bias, so the
    projections, unbiased, take zero biases."""
    AutoConfig.for_model("beam").save_pretrained(tmp_path)
    info = read_hf_layer(tmp_path, 0)
    c = info.attention
    assert (c.embed_dim, c.num_heads, c.num_kv_heads, c.head_dim) == (5120, 48, 8, 128)
    assert c.output_gate and not c.output_gate_per_head and c.gate_width == 48 * 128
    assert c.bias and info.zero_biases == ("q", "k", "v", "o")
    assert c.sliding_window == 512 and c.rope.theta == 10_000.0 and c.qk_norm.scope == "head"
    with pytest.raises(ValueError, match=r"full_attention layers .* queries scaled by position"):
        read_hf_layer(tmp_path, 5)


def test_beam_gate_bias_is_each_heads_over_its_dims(hf_dirs):
    module, _ = load_hf_layer(hf_dirs["beam"], 0)
    tensors = load_file(str(hf_dirs["beam"] / "model.safetensors"))
    per_head = tensors["layers.0.self_attn.gate_bias"]  # (H,)
    assert per_head.abs().min() > 0  # (drawn: transformers writes zeros)
    assert torch.equal(module.wgate.bias, per_head.repeat_interleave(16))
    assert not module.wqkv.bias.any() and not module.wo.bias.any()
