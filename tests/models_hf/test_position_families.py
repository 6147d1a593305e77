"""Families whose queries are scaled by position or whose q/k norm comes after RoPE
(Ministral 3, Llama 4, nanochat, Hunyuan v1, Mistral 4), served against transformers' own
attention module loaded from the same directory: one pass over positions crossing the
query scale's floors, and the same tokens fed in steps through its DynamicCache against the
module's steps projected at their absolute positions (as a session's)."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    DynamicCache,
    HunYuanDenseV1Config,
    HunYuanDenseV1Model,
    HunYuanMoEV1Config,
    HunYuanMoEV1Model,
    Llama4Config,
    Llama4ForConditionalGeneration,
    Llama4TextConfig,
    Llama4TextModel,
    Ministral3Config,
    Ministral3Model,
    Mistral3Config,
    Mistral3ForConditionalGeneration,
    Mistral4Config,
    Mistral4Model,
    NanoChatConfig,
    NanoChatModel,
)

from mha_serve.model.hf import load_hf_layer
from mha_serve.model.hf_config import read_hf_layer
from tests.models_hf.reference import attention_module, layer_mask
from tests.models_hf.test_config_json import SMALL, checkpoint

L = 40
CUTS = [0, 7, 8, 9, 17, 18, 30, 40]  # a prompt, single tokens and chunks across the floors
ATOL = 1e-5


@torch.no_grad()
def transformers_steps(base, layer: int, x: torch.Tensor, cuts: list[int]) -> torch.Tensor:
    """transformers' attention of `layer` over x (1, L, E) fed in chunks [cuts[i],
    cuts[i+1]) through a DynamicCache, at absolute positions (its position_ids and
    cache_position; the rotary table of those positions): the chunks' outputs, (1, L, E)."""
    cache = DynamicCache(config=base.config)
    outs = []
    for a, b in zip(cuts, cuts[1:], strict=False):
        pos = torch.arange(a, b)[None]  # (1, n)
        chunk = x[:, a:b]
        mask = layer_mask(base, layer, chunk, pos, cache)
        out = attention_module(base, layer)(
            chunk,
            attention_mask=mask,
            position_ids=pos,
            cache_position=pos[0],
            past_key_values=cache,
            position_embeddings=base.rotary_emb(chunk, pos),
        )[0]
        outs.append(out)
    return torch.cat(outs, dim=1)


@torch.no_grad()
def served_steps(module, x: torch.Tensor, cuts: list[int]) -> torch.Tensor:
    """The served module over the same chunks: each projected at its absolute positions,
    its K/V appended, attended over every key so far (attend_cached)."""
    keys, values, outs = [], [], []
    for a, b in zip(cuts, cuts[1:], strict=False):
        q, k, v = module.project(x[:, a:b], torch.arange(a, b))
        keys.append(k)
        values.append(v)
        kv = [(torch.cat(keys, dim=2), torch.cat(values, dim=2))]
        outs.append(module.attend_cached(q, kv, past_lengths=[a], new_lengths=[b - a]).output)
    return torch.cat(outs, dim=1)


def assert_served_in_one_pass_and_in_steps(directory, cls, layer: int) -> None:
    base = cls.from_pretrained(directory, attn_implementation="eager").eval()
    base = getattr(base, "model", None) or base
    module, _ = load_hf_layer(directory, layer)
    x = torch.randn(1, L, base.config.hidden_size, generator=torch.Generator().manual_seed(1))
    whole = transformers_steps(base, layer, x, [0, L])
    with torch.no_grad():
        got = module(x, causal=True).output
    torch.testing.assert_close(got, whole, atol=ATOL, rtol=ATOL)
    steps = transformers_steps(base, layer, x, CUTS)
    torch.testing.assert_close(steps, whole, atol=ATOL, rtol=ATOL)  # (its own cache's)
    torch.testing.assert_close(served_steps(module, x, CUTS), steps, atol=ATOL, rtol=ATOL)


# Ministral 3: yarn RoPE with the query scale over a pretraining context of 8 (floors at 8,
# 16, 24, 32 within the 40 tokens), GQA 8:2, head_dim 16 != 64 / 8
MINISTRAL3_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 500.0,
    "factor": 4.0,
    "original_max_position_embeddings": 8,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "llama_4_scaling_beta": 0.5,
}


def ministral3_config(**edits) -> Ministral3Config:
    options = {"num_key_value_heads": 2, "head_dim": 16, "rope_parameters": MINISTRAL3_ROPE}
    return Ministral3Config(**{**SMALL, **options, **edits})


@pytest.mark.parametrize("window", [None, 12])
def test_ministral3_is_served_as_transformers_runs_it(tmp_path, window):
    config = ministral3_config(sliding_window=window)
    directory = checkpoint(tmp_path, Ministral3Model, config)
    served = read_hf_layer(directory, 1).attention
    assert served.query_scale is not None and served.query_scale.floor_div == 8.0
    assert served.sliding_window == window
    assert_served_in_one_pass_and_in_steps(directory, Ministral3Model, 1)


def test_ministral3_without_its_scaling_beta_is_refused_by_name(tmp_path):
    rope = {k: v for k, v in MINISTRAL3_ROPE.items() if k != "llama_4_scaling_beta"}
    directory = checkpoint(tmp_path, Ministral3Model, ministral3_config(), rope_parameters=rope)
    with pytest.raises(ValueError, match=r"rope_parameters.llama_4_scaling_beta must be a number"):
        read_hf_layer(directory, 0)


def test_a_mistral3_whose_text_model_is_ministral3_serves_it(tmp_path):
    """Mistral Small 3.x / Ministral 3 checkpoints wrap a ministral3 text model in mistral3:
    its language model is served with the query scale (it was refused)."""
    config = Mistral3Config(
        text_config=ministral3_config().to_dict(),
        vision_config={
            "model_type": "pixtral",
            "hidden_size": 32,
            "intermediate_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "head_dim": 16,
            "image_size": 28,
            "patch_size": 14,
        },
    )
    directory = checkpoint(tmp_path, Mistral3ForConditionalGeneration, config)
    info = read_hf_layer(directory, 0)
    assert info.attention.query_scale is not None and info.tensor_scope == "language_model"
    base = Mistral3ForConditionalGeneration.from_pretrained(
        directory, attn_implementation="eager"
    ).eval()
    text = base.model.language_model
    module, _ = load_hf_layer(directory, 0)
    x = torch.randn(1, L, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = module(x, causal=True).output
    torch.testing.assert_close(got, transformers_steps(text, 0, x, [0, L]), atol=ATOL, rtol=ATOL)


def test_nanochat_is_served_as_transformers_runs_it(tmp_path):
    """nanochat: RoPE by its own rotate_half ([x2, -x1]: the other way round), then a q/k
    RMSNorm without gains; GQA 8:2 here (its config's num_key_value_heads)."""
    config = NanoChatConfig(num_key_value_heads=2, **SMALL)
    directory = checkpoint(tmp_path, NanoChatModel, config)
    norm = read_hf_layer(directory, 1).attention.qk_norm
    assert norm.after_rope and not norm.gain
    assert_served_in_one_pass_and_in_steps(directory, NanoChatModel, 1)


HUNYUAN = {"num_key_value_heads": 2, "head_dim": 16, "attention_bias": True}


@pytest.mark.parametrize(
    ("cls", "config"),
    [
        (  # its checkpoints' RoPE: "dynamic" with a fixed alpha (NTK alpha, fixed frequencies)
            HunYuanDenseV1Model,
            HunYuanDenseV1Config(
                rope_parameters={
                    "rope_type": "dynamic",
                    "rope_theta": 10000.0,
                    "alpha": 50.0,
                    "factor": 1.0,
                },
                **HUNYUAN,
                **SMALL,
            ),
        ),
        (HunYuanMoEV1Model, HunYuanMoEV1Config(num_experts=2, moe_topk=1, **HUNYUAN, **SMALL)),
    ],
    ids=["dense_ntk_alpha", "moe"],
)
def test_hunyuan_v1_is_served_as_transformers_runs_it(tmp_path, cls, config):
    """Hunyuan v1: RoPE by halves, then query_layernorm and key_layernorm (RMSNorms with
    gains, random here: with gains a norm after RoPE is not one before it)."""
    torch.manual_seed(0)
    model = cls(config)
    with torch.no_grad():
        for key, parameter in model.named_parameters():
            if key.endswith((".bias", "layernorm.weight")):
                parameter.normal_(1.0 if "layernorm" in key else 0.0, 0.2)
    model.save_pretrained(tmp_path)
    norm = read_hf_layer(tmp_path, 1).attention.qk_norm
    assert norm.after_rope and norm.gain and norm.eps == 1e-5
    assert_served_in_one_pass_and_in_steps(tmp_path, cls, 1)


def llama4_config(**edits) -> Llama4TextConfig:
    """Layer 0 a RoPE layer (llama3 RoPE by pairs, the L2 norm after it, chunked in 64),
    layer 1 a NoPE one (queries scaled by position, floor_scale 8: floors at positions 7,
    15, 23, 31 within the 40 tokens); GQA 8:2, head_dim 16; experts of 2 (never read)."""
    options = {
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size_mlp": 96,
        "num_local_experts": 2,
        "no_rope_layers": [1, 0],
        "attention_chunk_size": 64,
        "floor_scale": 8,
        "attn_scale": 0.5,
        "attention_bias": True,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    }
    return Llama4TextConfig(**{**SMALL, **options, **edits})


@pytest.mark.parametrize("layer", [0, 1], ids=["rope_chunked", "nope_scaled"])
def test_llama4_text_is_served_as_transformers_runs_it(tmp_path, layer):
    directory = checkpoint(tmp_path, Llama4TextModel, llama4_config())
    served = read_hf_layer(directory, layer).attention
    if layer == 0:  # RoPE by pairs, the L2 norm after it, chunks of 64 (40 tokens: causal)
        assert served.rope.interleaved and served.chunk_size == 64
        assert served.qk_norm.after_rope and not served.qk_norm.gain
        assert served.query_scale is None
    else:  # NoPE: no norm, no chunks, the queries scaled from (p + 1) / 8 in float32
        assert served.rope is None and served.qk_norm is None and served.chunk_size is None
        assert served.query_scale.offset == 1 and served.query_scale.float32
    assert_served_in_one_pass_and_in_steps(directory, Llama4TextModel, layer)


@pytest.mark.parametrize(
    ("edits", "layer", "piece"),
    [
        ({"attention_chunk_size": 0}, 0, "attention_chunk_size is 0"),
        ({"attention_chunk_size": "null"}, 0, "attention_chunk_size is None"),
        ({"no_rope_layers": [1]}, 0, "no_rope_layers must list a 0 or 1 for each of 2 layers"),
        ({"layer_types": ["sliding_attention", "full_attention"]}, 0, "'sliding_attention'"),
        ({"attn_scale": -1.0}, 1, "query_scale beta must be >= 0"),
    ],
)
def test_llama4_settings_we_cannot_serve_are_refused_by_name(tmp_path, edits, layer, piece):
    directory = checkpoint(tmp_path, Llama4TextModel, llama4_config(), **edits)
    path = directory / "config.json"  # ("null": written as null, which transformers fails on)
    path.write_text(path.read_text().replace('"null"', "null"))
    with pytest.raises(ValueError) as err:
        read_hf_layer(directory, layer)
    assert piece in str(err.value), str(err.value)


def test_llama4_serves_its_text_model(tmp_path):
    """Llama 4 (Scout, Maverick): its text_config's layer, tensors under language_model."""
    config = Llama4Config(
        text_config=llama4_config().to_dict(),
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": 28,
            "patch_size": 14,
            "vision_output_dim": 32,
            "projector_input_dim": 32,
            "projector_output_dim": 32,
        },
    )
    torch.manual_seed(0)
    Llama4ForConditionalGeneration(config).save_pretrained(tmp_path)
    base = Llama4ForConditionalGeneration.from_pretrained(tmp_path, attn_implementation="eager")
    text = base.eval().language_model.model
    for layer in (0, 1):
        module, info = load_hf_layer(tmp_path, layer)
        assert info.family == "llama4" and info.tensor_scope == "language_model"
        x = torch.randn(1, L, 64, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            got = module(x, causal=True).output
        want = transformers_steps(text, layer, x, [0, L])
        torch.testing.assert_close(got, want, atol=ATOL, rtol=ATOL)


def mistral4_config(**edits) -> Mistral4Config:
    """Mistral Small 4's MLA: q through its latent, RoPE by pairs (rope_interleave) over 8
    of each head's 16 q/k dims (partial_rotary_factor 0.5, its config's rope / (nope +
    rope)), yarn with mscale_all_dim (its scale times mscale^2), the query scale over a
    pretraining context of 8; biases (attention_bias); experts of 2 (never read)."""
    options = {
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "kv_lora_rank": 16,
        "q_lora_rank": 24,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 8,
        "v_head_dim": 12,
        "moe_intermediate_size": 32,
        "n_routed_experts": 2,
        "num_experts_per_tok": 1,
        "attention_bias": True,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 500.0,
            "factor": 4.0,
            "original_max_position_embeddings": 8,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "llama_4_scaling_beta": 0.5,
            "partial_rotary_factor": 0.5,
        },
    }
    return Mistral4Config(**{**SMALL, **options, **edits})


def test_mistral4_is_served_as_transformers_runs_it(tmp_path):
    """Its absorbed q' = [rope(q_rope); W_uk^T q_nope] is linear in q: scaled whole."""
    directory = checkpoint(tmp_path, Mistral4Model, mistral4_config())
    served = read_hf_layer(directory, 1).attention
    assert served.mla is not None and served.query_scale.floor_div == 8.0
    assert served.rope.interleaved and served.rope.partial == 1.0
    assert_served_in_one_pass_and_in_steps(directory, Mistral4Model, 1)


def test_mistral4_with_another_partial_rotary_factor_is_refused(tmp_path):
    rope = {**mistral4_config().rope_parameters, "partial_rotary_factor": 0.25}
    directory = checkpoint(tmp_path, Mistral4Model, mistral4_config(), rope_parameters=rope)
    with pytest.raises(ValueError, match="partial_rotary_factor 0.25 is not supported"):
        read_hf_layer(directory, 0)


def test_mistral4s_long_prompt_runs_expanded_and_scaled(tmp_path, monkeypatch):
    """A prompt of mla.EXPAND_MIN_ROWS rows or more attends in the expanded form
    (project_expanded: each head decompressed), which must scale its queries by position as
    the absorbed form does: one pass and a session's chunks (the first expanded, a decode
    step and a short chunk absorbed) equal transformers' own module and cache."""
    from mha_serve.model import mla

    directory = checkpoint(tmp_path, Mistral4Model, mistral4_config())
    base = Mistral4Model.from_pretrained(directory, attn_implementation="eager").eval()
    module, _ = load_hf_layer(directory, 1)
    n = mla.EXPAND_MIN_ROWS + 16
    assert mla.expands(module.config, n, 0)
    expanded = []
    real = mla.expand_keys
    monkeypatch.setattr(mla, "expand_keys", lambda *a, **k: expanded.append(1) or real(*a, **k))
    x = torch.randn(1, n + 4, base.config.hidden_size, generator=torch.Generator().manual_seed(2))
    cuts = [0, n, n + 1, n + 4]
    whole = transformers_steps(base, 1, x, [0, n + 4])
    with torch.no_grad():
        got = module(x, causal=True).output
    assert expanded, "the long prompt did not run expanded"
    torch.testing.assert_close(got, whole, atol=ATOL, rtol=ATOL)
    steps = served_steps(module, x, cuts)
    torch.testing.assert_close(steps, transformers_steps(base, 1, x, cuts), atol=ATOL, rtol=ATOL)
