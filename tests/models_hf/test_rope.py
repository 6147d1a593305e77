"""RoPE frequencies and rotation against transformers' own (ROPE_INIT_FUNCTIONS,
LlamaRotaryEmbedding, apply_rotary_pos_emb), for every type we serve, and config.json in
transformers 4's keys (rope_theta + rope_scaling) read like transformers 5's."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.gpt_oss import modeling_gpt_oss as gpt_oss
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from mha_serve.model.config import RopeConfig
from mha_serve.model.hf_config import read_hf_layer
from mha_serve.model.rope import cos_sin, doubled, inv_freq, rotate

PARAMETERS = [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "linear", "rope_theta": 500000.0, "factor": 3.0},
    {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    {
        "rope_type": "yarn",
        "rope_theta": 1e6,
        "factor": 8.0,
        "original_max_position_embeddings": 32,
        "mscale": 1.0,
        "mscale_all_dim": 0.5,
        "beta_fast": 16.0,
        "truncate": False,
    },
    {
        "rope_type": "yarn",
        "rope_theta": 1e4,
        "factor": 2.0,
        "original_max_position_embeddings": 128,
        "attention_factor": 0.9,
    },
]


def llama_config(params):
    return LlamaConfig(
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=1,
        max_position_embeddings=256,
        rope_parameters=params,
    )


@pytest.mark.parametrize("params", PARAMETERS, ids=lambda p: p["rope_type"])
def test_frequencies_cos_sin_and_rotation_equal_transformers(tmp_path, params):
    config = llama_config(dict(params))
    (tmp_path / "config.json").write_text(json.dumps({**config.to_dict(), "model_type": "llama"}))
    rope = read_hf_layer(tmp_path, 0).attention.rope
    assert rope.type == params["rope_type"]
    ours, scaling = inv_freq(rope, 32)
    if params["rope_type"] == "default":
        theirs, their_scaling = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    else:
        theirs, their_scaling = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, "cpu")
    assert torch.equal(ours, theirs.float()), (ours - theirs).abs().max()
    assert scaling == pytest.approx(their_scaling, rel=1e-12)
    positions = torch.tensor([[0, 1, 7, 63, 200], [3, 4, 5, 6, 7]])
    cos, sin = cos_sin(doubled(ours), scaling, positions, torch.float32)  # (B, 1, L, D)
    x = torch.randn(2, 5, 128)
    their_cos, their_sin = LlamaRotaryEmbedding(config)(x, positions)  # (B, L, D)
    assert torch.equal(cos[:, 0], their_cos) and torch.equal(sin[:, 0], their_sin)
    q, k = torch.randn(2, 4, 5, 32), torch.randn(2, 2, 5, 32)
    want_q, want_k = apply_rotary_pos_emb(q, k, their_cos, their_sin)
    assert torch.equal(rotate(q, cos, sin), want_q) and torch.equal(rotate(k, cos, sin), want_k)


def test_transformers_4_keys_read_as_transformers_5(tmp_path):
    base = {
        "model_type": "llama",
        "hidden_size": 128,
        "num_attention_heads": 4,
        "num_hidden_layers": 1,
        "max_position_embeddings": 256,
    }
    old = {
        **base,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    }
    new = {
        **base,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    }
    ropes = []
    for name, cfg in (("old", old), ("new", new)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
        ropes.append(read_hf_layer(tmp_path / name, 0).attention.rope)
    assert ropes[0] == ropes[1] and ropes[0].type == "llama3" and ropes[0].theta == 500000.0


GPT_OSS = {
    "model_type": "gpt_oss",
    "hidden_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_hidden_layers": 2,
}
GPT_OSS_SHIPPED = {  # openai/gpt-oss-20b's config.json (transformers 4 keys)
    "rope_theta": 150000,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
}


@pytest.mark.parametrize(
    "keys",
    [
        GPT_OSS_SHIPPED,
        {},
        {"rope_theta": 1000.0},
        {"rope_scaling": {"type": "linear", "factor": 2.0}},
    ],
    ids=["shipped", "none", "theta_only", "linear"],
)
def test_gpt_oss_rope_equals_transformers(tmp_path, keys):
    """GPT-OSS's RoPE as transformers 5 reads config.json (GptOssConfig: YaRN with factor 32
    and truncate false when no table is given, rope_theta 150000 when none is) and rotates
    (its own apply_rotary_pos_emb over half-width cos/sin): bit for bit."""
    (tmp_path / "config.json").write_text(json.dumps({**GPT_OSS, **keys}))
    rope = read_hf_layer(tmp_path, 1).attention.rope
    theirs = gpt_oss.GptOssRotaryEmbedding(AutoConfig.from_pretrained(tmp_path))
    ours, scaling = inv_freq(rope, 32)
    assert torch.equal(ours, theirs.inv_freq.float()), (ours - theirs.inv_freq).abs().max()
    assert scaling == pytest.approx(theirs.attention_scaling, rel=1e-12)
    positions = torch.tensor([[0, 1, 7, 4095, 70000], [3, 4, 5, 6, 7]])
    cos, sin = cos_sin(doubled(ours), scaling, positions, torch.float32)  # (B, 1, L, D)
    their_cos, their_sin = theirs(torch.randn(2, 5, 128), positions)  # (B, L, D / 2)
    for half in (slice(None, 16), slice(16, None)):
        assert torch.equal(cos[:, 0, :, half], their_cos)
        assert torch.equal(sin[:, 0, :, half], their_sin)
    q, k = torch.randn(2, 4, 5, 32), torch.randn(2, 2, 5, 32)
    want_q, want_k = gpt_oss.apply_rotary_pos_emb(q, k, their_cos, their_sin)
    assert torch.equal(rotate(q, cos, sin), want_q) and torch.equal(rotate(k, cos, sin), want_k)


@pytest.mark.parametrize(("partial", "factor"), [(0.25, 1.0), (0.5, 2.0), (1.0, 1.0)])
def test_proportional_frequencies_equal_transformers(partial, factor):
    """Gemma 4's global layers' RoPE: frequencies over the whole head, theta ** (-2i /
    head_dim) for the first int(partial * head_dim // 2) and 0 past them, divided by factor."""
    params = {"rope_type": "proportional", "rope_theta": 1e4}
    params.update({"partial_rotary_factor": partial, "factor": factor})
    theirs, their_scaling = ROPE_INIT_FUNCTIONS["proportional"](llama_config(params), "cpu")
    rope = RopeConfig(theta=1e4, type="proportional", partial=partial, factor=factor)
    ours, scaling = inv_freq(rope, 32)
    assert torch.equal(ours, theirs.float()), (ours - theirs).abs().max()
    assert scaling == their_scaling == 1.0
    assert int((ours != 0).sum()) == int(partial * 32 // 2)


@pytest.mark.parametrize(
    ("table", "beside", "want"),
    [
        ({"partial_rotary_factor": 0.25}, {}, (0.25, 1.0)),
        ({"factor": 4.0}, {"partial_rotary_factor": 0.5}, (0.5, 4.0)),
        ({"partial_rotary_factor": 0.75}, {"partial_rotary_factor": 0.5}, (0.75, 1.0)),
        ({}, {}, (1.0, 1.0)),
    ],
    ids=["table", "beside_moved_in", "table_over_beside", "left_out"],
)
def test_a_proportional_table_in_any_family_is_read_as_transformers(tmp_path, table, beside, want):
    """A proportional table in a family that reads one table (Llama's; LFM3's full layers:
    test_own_gates): its partial_rotary_factor, else one beside it (convert_rope_params_to_dict
    moves it in), else 1.0; its factor, else 1.0. Frequencies and rotation bit for bit
    transformers' (LlamaRotaryEmbedding through ROPE_INIT_FUNCTIONS)."""
    params = {"rope_type": "proportional", "rope_theta": 1000.0, **table}
    cfg = {**llama_config(params).to_dict(), "model_type": "llama", **beside}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    info = read_hf_layer(tmp_path, 0).attention
    assert (info.rope.type, info.rope.partial, info.rope.factor) == ("proportional", *want)
    assert info.rope_dim == 32  # (the whole head: the frequencies past the proportion are 0)
    theirs = LlamaRotaryEmbedding(AutoConfig.from_pretrained(tmp_path))
    ours, scaling = inv_freq(info.rope, 32)
    assert torch.equal(ours, theirs.inv_freq.float()), (ours - theirs.inv_freq).abs().max()
    assert scaling == theirs.attention_scaling == 1.0
    positions = torch.tensor([[0, 1, 7, 63, 200]])
    cos, sin = cos_sin(doubled(ours), scaling, positions, torch.float32)  # (B, 1, L, D)
    their_cos, their_sin = theirs(torch.randn(1, 5, 128), positions)  # (B, L, D)
    assert torch.equal(cos[:, 0], their_cos) and torch.equal(sin[:, 0], their_sin)


@pytest.mark.parametrize("family", ["phi", "deepseek_v3"])
def test_a_proportional_table_where_the_attention_turns_part_of_each_head_is_refused(
    tmp_path, family
):
    """Phi turns the first partial_rotary_factor of each head, DeepSeek-V3 its
    qk_rope_head_dim dims, by frequencies over those dims: a proportional table's run over the
    whole head_dim, which their attention turns otherwise or fails on; refused by name."""
    cfg = AutoConfig.for_model(family, num_hidden_layers=1).to_dict()
    cfg["rope_parameters"] = {"rope_type": "proportional", "rope_theta": 1e4}
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "model_type": family}))
    with pytest.raises(ValueError, match=f"'proportional' is not supported for {family}"):
        read_hf_layer(tmp_path, 0)
