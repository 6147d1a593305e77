"""Gated attention (Qwen3-Next, Qwen3.5 and its MoE, text and multimodal): the
full_attention layers served as transformers 5 runs them (q_proj's rows per head split into
the queries and the output gate, the q/k norms' 1 + w, partial RoPE, Qwen3.5's multimodal
RoPE at text positions), variants of biases, head_dim, KV heads and rotated share; the
multimodal checkpoints' language model, not their vision tower; a linear_attention layer
refused by its type, naming the layers that are served."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import (
    AutoConfig,
    Qwen3_5Config,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeConfig,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3_5MoeTextConfig,
    Qwen3_5MoeTextModel,
    Qwen3_5TextConfig,
    Qwen3_5TextModel,
    Qwen3NextConfig,
    Qwen3NextModel,
)

from mha_serve.model.hf import load_hf_layer
from mha_serve.model.hf_config import read_hf_layer
from tests.models_hf.reference import GATED, GATED_MOE, INIT, reference_attention

L = 24  # tokens


def _checkpoint(tmp_path, model, **edits):
    """model saved by transformers with its biases and q/k norm gains random (it writes
    zeros: a bias on the wrong rows, or a gain read as w, not 1 + w, would go unseen), then
    config.json's keys set (None: removed)."""
    with torch.no_grad():
        for key, parameter in model.named_parameters():
            if key.endswith((".bias", "q_norm.weight", "k_norm.weight")):
                parameter.normal_(0.0, INIT)
    model.save_pretrained(tmp_path, safe_serialization=True)
    path = tmp_path / "config.json"
    cfg = json.loads(path.read_text())
    for key, value in edits.items():
        cfg.pop(key, None) if value is None else cfg.__setitem__(key, value)
    path.write_text(json.dumps(cfg))
    return tmp_path


def _assert_served(directory, base, layer, family="qwen3_next"):
    """Our layer against transformers' own (eager) on L tokens at positions 0.., weights too."""
    module, _ = load_hf_layer(directory, layer)
    x = torch.randn(1, L, base.config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, want_w = reference_attention(family, base, layer, x)
        out = module(x, causal=True, need_weights=True)
    torch.testing.assert_close(out.output, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.weights, want_w, atol=1e-5, rtol=1e-5)


VARIANTS = {
    # Qwen3-Next's defaults: a quarter of each head rotated, GQA, no biases
    "next_default": (Qwen3NextModel, Qwen3NextConfig, {"num_key_value_heads": 2}),
    "next_bias_head_dim_32": (
        Qwen3NextModel,
        Qwen3NextConfig,
        {"num_key_value_heads": 4, "head_dim": 32, "attention_bias": True},
    ),
    "next_mha_all_rotated": (
        Qwen3NextModel,
        Qwen3NextConfig,
        {"num_key_value_heads": 8, "head_dim": 8, "partial_rotary_factor": 1.0},
    ),
    "qwen3_5_mqa_half_rotated": (
        Qwen3_5TextModel,
        Qwen3_5TextConfig,
        {"num_key_value_heads": 1, "head_dim": 16, "partial_rotary_factor": 0.5},
    ),
    "qwen3_5_theta_bias": (
        Qwen3_5TextModel,
        Qwen3_5TextConfig,
        {"num_key_value_heads": 2, "rope_theta": 1e7, "attention_bias": True},
    ),
    "qwen3_5_moe_default": (
        Qwen3_5MoeTextModel,
        Qwen3_5MoeTextConfig,
        {"num_key_value_heads": 2, "head_dim": 16},
    ),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gated_layer_equals_transformers(tmp_path, variant):
    cls, config_cls, options = VARIANTS[variant]
    moe = GATED_MOE if cls is not Qwen3_5TextModel else {}
    torch.manual_seed(0)
    model = cls(config_cls(**options, **moe, **GATED))
    directory = _checkpoint(tmp_path, model)
    base = cls.from_pretrained(directory, attn_implementation="eager").eval()
    info = read_hf_layer(directory, 1)
    assert info.attention.output_gate and info.attention.qk_norm.scope == "head"
    head_dim = options.get("head_dim", 256)  # (their configs' default)
    partial = options.get("partial_rotary_factor", 0.25)
    assert info.attention.rope_dim == int(head_dim * partial)
    _assert_served(directory, base, 1)


@pytest.mark.parametrize(
    ("cls", "config_cls", "family"),
    [
        (Qwen3_5ForConditionalGeneration, Qwen3_5Config, "qwen3_5"),
        (Qwen3_5MoeForConditionalGeneration, Qwen3_5MoeConfig, "qwen3_5_moe"),
    ],
)
def test_multimodal_qwen3_5_serves_its_language_model(tmp_path, cls, config_cls, family):
    """Qwen3.5's multimodal checkpoint: its text_config's layer, its tensors under
    language_model (the vision tower's blocks hold attention projections too)."""
    moe = GATED_MOE if family == "qwen3_5_moe" else {}
    text = {"num_key_value_heads": 2, "head_dim": 16, "attention_bias": True, **moe, **GATED}
    vision = {
        "depth": 1,
        "hidden_size": 32,
        "intermediate_size": 32,
        "num_heads": 2,
        "out_hidden_size": 64,
        "patch_size": 4,
        "num_position_embeddings": 16,
    }
    torch.manual_seed(0)
    model = cls(config_cls(text_config=text, vision_config=vision))
    directory = _checkpoint(tmp_path, model)
    base = cls.from_pretrained(directory, attn_implementation="eager").eval().model.language_model
    info = read_hf_layer(directory, 1)
    assert (info.family, info.tensor_scope) == (family, "language_model")
    assert info.attention.output_gate
    _assert_served(directory, base, 1)


@pytest.mark.parametrize(
    ("edits", "layer", "served"),
    [
        ({}, 0, "1"),  # layer_types as written: [linear_attention, full_attention]
        # without layer_types, as their configs derive them: every interval-th layer full
        ({"layer_types": None, "num_hidden_layers": 8}, 5, "3, 7"),
        ({"layer_types": None, "full_attention_interval": 2, "num_hidden_layers": 4}, 2, "1, 3"),
    ],
)
def test_a_linear_attention_layer_is_refused_naming_the_layers_served(
    tmp_path, edits, layer, served
):
    torch.manual_seed(0)
    directory = _checkpoint(
        tmp_path, Qwen3NextModel(Qwen3NextConfig(**GATED_MOE, **GATED)), **edits
    )
    cfg = json.loads((directory / "config.json").read_text())
    if "full_attention_interval" in cfg:  # (transformers reads it; it is not a field)
        theirs = AutoConfig.from_pretrained(directory).layer_types
        assert [i for i, t in enumerate(theirs) if t == "full_attention"] == [1, 3]
    with pytest.raises(ValueError) as err:
        read_hf_layer(directory, layer)
    message = str(err.value)
    assert f"layer {layer} of qwen3_next is a 'linear_attention' layer" in message
    assert message.endswith(f"its full_attention layers are: {served}"), message
    full = int(served.split(",")[0])
    assert read_hf_layer(directory, full).attention.output_gate
