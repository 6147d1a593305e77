"""The families whose attention is one we already serve with other config keys (Mixtral,
Ministral, Starcoder2, Qwen2-MoE, Qwen3-MoE, OLMoE, OLMo, Granite and its MoEs, SmolLM3,
Cohere 2's global layers): keys config.json leaves out read with the family's own defaults
(not the family it resembles), checked against transformers' attention loaded from the same
directory; and the variants we cannot serve exactly refused by name. (Parity over gRPC,
sessions included, is test_parity_grpc's, on reference.CHECKPOINTS.)"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import (
    ApertusConfig,
    ApertusModel,
    AutoConfig,
    BambaConfig,
    BambaModel,
    CodeGenConfig,
    CodeGenModel,
    Cohere2Config,
    Cohere2Model,
    CwmConfig,
    CwmModel,
    Dots1Config,
    Dots1Model,
    Ernie4_5_MoeConfig,
    Ernie4_5_MoeModel,
    Exaone4Config,
    ExaoneMoeConfig,
    ExaoneMoeModel,
    FlexOlmoConfig,
    FlexOlmoModel,
    Glm4MoeConfig,
    Glm4MoeModel,
    GPTJConfig,
    GPTJModel,
    GPTNeoXConfig,
    GPTNeoXModel,
    GraniteConfig,
    GraniteModel,
    GraniteMoeHybridConfig,
    GraniteMoeHybridModel,
    HyperCLOVAXConfig,
    HyperCLOVAXModel,
    HYV3Config,
    HYV3Model,
    Jais2Config,
    Jais2Model,
    JambaConfig,
    JambaModel,
    Lfm2Config,
    Lfm2Model,
    Lfm2MoeConfig,
    MiniMaxConfig,
    MiniMaxM2Config,
    MiniMaxM2Model,
    MiniMaxModel,
    MinistralConfig,
    MinistralModel,
    Mistral3Config,
    Mistral3ForConditionalGeneration,
    MistralConfig,
    MixtralConfig,
    MixtralForCausalLM,
    NemotronConfig,
    NemotronHConfig,
    NemotronHModel,
    NemotronModel,
    Olmo3Config,
    Olmo3Model,
    OlmoConfig,
    OlmoeConfig,
    OlmoHybridConfig,
    OlmoHybridModel,
    PhiConfig,
    PhiModel,
    PhimoeConfig,
    PhimoeModel,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen2MoeModel,
    Qwen3MoeConfig,
    Qwen3MoeModel,
    RecurrentGemmaConfig,
    RecurrentGemmaModel,
    SeedOssConfig,
    SeedOssModel,
    SmolLM3Config,
    SmolLM3Model,
    SolarOpenConfig,
    SolarOpenModel,
    StableLmConfig,
    StableLmModel,
    Starcoder2Config,
    Starcoder2Model,
    VaultGemmaConfig,
    VaultGemmaModel,
)

from mha_serve.model.hf import load_hf_layer
from mha_serve.model.hf_config import read_hf_layer
from tests.models_hf.reference import NEMOTRON_H, OLMO_HYBRID, reference_attention
from tests.models_hf.test_config_json import SMALL, assert_served_as_transformers, checkpoint

MOE = {"num_experts": 2, "num_experts_per_tok": 1, "moe_intermediate_size": 32}
NO_TOKENS = {"pad_token_id": None, "bos_token_id": None, "eos_token_id": None}
NEOX = {**SMALL, "num_attention_heads": 4}  # heads of 16: a quarter of each is 4 dims
GPTJ = {"n_layer": 2, "n_positions": 256, "vocab_size": 64, "initializer_range": 0.2}
# Llama's RoPE keys beside GPT-J's: GPTJConfig and GPTJAttention read none of them (theta
# 10000, rotary_dim's dims)
LLAMA_ROPE = {
    "rope_theta": 1e6,
    "rope_parameters": {"rope_type": "linear", "rope_theta": 500.0, "factor": 4.0},
    "partial_rotary_factor": 1.0,
}


@pytest.mark.parametrize(
    ("cls", "config", "family", "edits", "layer"),
    [
        # Qwen3-MoE's config has no head_dim: E // H (8), not Qwen3's default of 128
        (Qwen3MoeModel, Qwen3MoeConfig(num_key_value_heads=2, **MOE, **SMALL), "qwen3_moe", {}, 0),
        # Starcoder2's use_bias defaults to True, Qwen2-MoE's qkv_bias too
        (
            Starcoder2Model,
            Starcoder2Config(num_key_value_heads=2, use_bias=True, **SMALL),
            "starcoder2",
            {"use_bias": None},
            1,
        ),
        (
            Qwen2MoeModel,
            Qwen2MoeConfig(
                num_key_value_heads=4, shared_expert_intermediate_size=32, **MOE, **SMALL
            ),
            "qwen2_moe",
            {"qkv_bias": None},
            0,
        ),
        # Qwen2-MoE derives its sliding layers otherwise than Qwen2: odd layers below
        # max_window_layers (layer 0 slides, layer 1 not)
        *[
            (
                Qwen2MoeModel,
                Qwen2MoeConfig(
                    num_key_value_heads=4,
                    use_sliding_window=True,
                    sliding_window=6,
                    max_window_layers=2,
                    shared_expert_intermediate_size=32,
                    **MOE,
                    **SMALL,
                ),
                "qwen2_moe",
                {"layer_types": None},
                layer,
            )
            for layer in (0, 1)
        ],
        # Granite without attention_multiplier: a scale of 1.0, not head_dim ** -0.5
        (
            GraniteModel,
            GraniteConfig(num_key_value_heads=2, attention_multiplier=0.03, **SMALL),
            "granite",
            {"attention_multiplier": None},
            0,
        ),
        # SmolLM3 without no_rope_layers nor its interval: every 4th layer is NoPE (here
        # none of two), where the checkpoint was written with every 2nd
        (
            SmolLM3Model,
            SmolLM3Config(num_key_value_heads=2, no_rope_layer_interval=2, **NO_TOKENS, **SMALL),
            "smollm3",
            {"no_rope_layers": None, "no_rope_layer_interval": None, "layer_types": None},
            1,
        ),
        # SmolLM3 with a window: the NoPE layers slide (layer_types derived)
        (
            SmolLM3Model,
            SmolLM3Config(
                num_key_value_heads=2,
                no_rope_layer_interval=2,
                use_sliding_window=True,
                sliding_window=6,
                **NO_TOKENS,
                **SMALL,
            ),
            "smollm3",
            {"layer_types": None},
            1,
        ),
        # Cohere 2 without layer_types: sliding_window_pattern (2 here) makes layer 1 global
        (
            Cohere2Model,
            Cohere2Config(num_key_value_heads=2, sliding_window=6, pad_token_id=0, **SMALL),
            "cohere2",
            {"layer_types": None, "sliding_window_pattern": 2},
            1,
        ),
        # Cohere 2 with head_dim 16 != 64 / 8: Cohere2Attention reads config.head_dim (E // H
        # only without one), where we served E // H whatever config.json said
        (
            Cohere2Model,
            Cohere2Config(
                num_key_value_heads=2,
                head_dim=16,
                layer_types=["sliding_attention", "full_attention"],
                sliding_window=6,
                pad_token_id=0,
                **SMALL,
            ),
            "cohere2",
            {},
            1,
        ),
        # Seed-OSS: attention_bias (q/k/v, default on) and attention_out_bias (o) apart;
        # here o_proj's alone (q/k/v's served as zero)
        (
            SeedOssModel,
            SeedOssConfig(
                num_key_value_heads=2, attention_bias=False, attention_out_bias=True, **SMALL
            ),
            "seed_oss",
            {},
            0,
        ),
        (
            SeedOssModel,
            SeedOssConfig(num_key_value_heads=2, attention_bias=True, **SMALL),
            "seed_oss",
            {"attention_bias": None, "head_dim": None},
            0,
        ),
        # OLMo 3 as transformers 4 wrote it: rope_scaling for the global layers only, and
        # rope_theta 500000 (the default) for both kinds
        *[
            (
                Olmo3Model,
                Olmo3Config(
                    num_key_value_heads=4,
                    sliding_window=6,
                    layer_types=["sliding_attention", "full_attention"],
                    pad_token_id=1,
                    **SMALL,
                ),
                "olmo3",
                {"rope_parameters": None, "rope_scaling": {"rope_type": "linear", "factor": 4.0}},
                layer,
            )
            for layer in (0, 1)
        ],
        # GPT-NeoX (Pythia) as transformers 4 wrote it: rotary_pct and rotary_emb_base, which
        # GPTNeoXConfig reads (not rope_theta nor partial_rotary_factor beside them)
        (
            GPTNeoXModel,
            GPTNeoXConfig(**NEOX),
            "gpt_neox",
            {
                "rope_parameters": None,
                "rotary_pct": 0.5,
                "rotary_emb_base": 500.0,
                "rope_theta": 1e6,
                "partial_rotary_factor": 1.0,
            },
            0,
        ),
        # GPT-NeoX without them: a quarter of each head rotated (GPTNeoXConfig's 0.25)
        (GPTNeoXModel, GPTNeoXConfig(**NEOX), "gpt_neox", {"rope_parameters": None}, 1),
        # Phi as transformers 4 wrote it (rope_theta, partial_rotary_factor beside no
        # table), and without them: half of each head rotated (PhiConfig's 0.5)
        (
            PhiModel,
            PhiConfig(**NEOX),
            "phi",
            {"rope_parameters": None, "rope_theta": 500.0, "partial_rotary_factor": 0.25},
            1,
        ),
        (PhiModel, PhiConfig(**NEOX), "phi", {"rope_parameters": None}, 0),
        # StableLM: the same keys; without them a quarter of each head (StableLmConfig's)
        (
            StableLmModel,
            StableLmConfig(num_key_value_heads=4, **NEOX),
            "stablelm",
            {"rope_parameters": None, "rope_theta": 500.0, "partial_rotary_factor": 0.5},
            0,
        ),
        (
            StableLmModel,
            StableLmConfig(num_key_value_heads=2, use_qkv_bias=True, **NEOX),
            "stablelm",
            {"rope_parameters": None},
            1,
        ),
        # Nemotron as transformers 4 wrote it (rope_theta, partial_rotary_factor beside no
        # table); without them half of each head (NemotronConfig's 0.5), also beside a
        # table of its own without one (linear: frequencies over the turned dims, scaled)
        (
            NemotronModel,
            NemotronConfig(num_key_value_heads=4, **NEOX),
            "nemotron",
            {"rope_parameters": None, "rope_theta": 500.0, "partial_rotary_factor": 0.25},
            1,
        ),
        (
            NemotronModel,
            NemotronConfig(num_key_value_heads=2, **SMALL),
            "nemotron",
            {"rope_parameters": None, "head_dim": None},
            0,
        ),
        (
            NemotronModel,
            NemotronConfig(num_key_value_heads=1, head_dim=16, **SMALL),
            "nemotron",
            {"rope_parameters": {"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0}},
            1,
        ),
        # GPT-J without rotary_dim: 64 of each head's 128 (GPTJConfig's default), whatever
        # Llama's RoPE keys beside it say
        (
            GPTJModel,
            GPTJConfig(n_embd=256, n_head=2, **GPTJ),
            "gptj",
            {"rotary_dim": None, **LLAMA_ROPE},
            0,
        ),
        # GPT-J's sizes by their aliases, which GPTJConfig takes over n_embd and n_head
        (
            GPTJModel,
            GPTJConfig(n_embd=64, n_head=4, rotary_dim=8, **GPTJ),
            "gptj",
            {"n_embd": 32, "hidden_size": 64, "n_head": 2, "num_attention_heads": 4},
            1,
        ),
        # rotary_dim 30 of heads of 44: 30 / 44 * 44 is 29.999..., and int() of it 29
        (GPTJModel, GPTJConfig(n_embd=88, n_head=2, rotary_dim=30, **GPTJ), "gptj", {}, 0),
        # CodeGen likewise: 64 of each head's 128, its 4 groups of one head each (weights
        # smaller: n_embd 512 at 0.2 gives outputs in the hundreds)
        (
            CodeGenModel,
            CodeGenConfig(n_embd=512, n_head=4, **{**GPTJ, "initializer_range": 0.05}),
            "codegen",
            {"rotary_dim": None, **LLAMA_ROPE},
            1,
        ),
        # GLM-4-MoE without use_qk_norm (no q/k norm: GLM-4.5-Air's) nor a partial factor
        # (half of each head: Glm4MoeConfig's 0.5), its head_dim hidden_size / heads
        (
            Glm4MoeModel,
            Glm4MoeConfig(num_key_value_heads=2, n_routed_experts=2, **MOE, **SMALL),
            "glm4_moe",
            {"use_qk_norm": None, "rope_parameters": None, "head_dim": None},
            1,
        ),
        # Apertus without a RoPE table: ApertusConfig's llama3 table, theta 12e6 included
        # (a transformers 4 rope_theta beside no table is ignored), MHA without
        # num_key_value_heads; and a table without rope_theta: its default_theta 12e6
        (
            ApertusModel,
            ApertusConfig(num_key_value_heads=2, **SMALL),
            "apertus",
            {"rope_parameters": None, "rope_theta": 500.0},
            1,
        ),
        (
            ApertusModel,
            ApertusConfig(**SMALL),
            "apertus",
            {
                "rope_parameters": {"rope_type": "linear", "factor": 2.0},
                "num_key_value_heads": None,
            },
            0,
        ),
        # ERNIE 4.5 MoE without num_key_value_heads (4: Ernie4_5_MoeConfig's, not the heads)
        # nor a RoPE table (theta 500000, its default_theta)
        (
            Ernie4_5_MoeModel,
            Ernie4_5_MoeConfig(num_key_value_heads=4, moe_num_experts=2, moe_k=1, **SMALL),
            "ernie4_5_moe",
            {"num_key_value_heads": None, "rope_parameters": None},
            0,
        ),
        # dots.llm1 without layer_types: layers from max_window_layers on slide (layer 1 of
        # 2 here), where Qwen2 asks use_sliding_window too; without max_window_layers (62)
        # none of them
        *[
            (
                Dots1Model,
                Dots1Config(
                    num_key_value_heads=2,
                    sliding_window=6,
                    max_window_layers=1,
                    n_routed_experts=2,
                    first_k_dense_replace=2,
                    **SMALL,
                ),
                "dots1",
                {"layer_types": None, **edits},
                1,
            )
            for edits in ({}, {"max_window_layers": None})
        ],
        # MiniMax-M2 as released (no RoPE table): the first rotary_dim dims of each head
        # (rotary_dim / head_dim), theta 5e6 (its default_theta); a partial_rotary_factor
        # beside rotary_dim wins; without either every dim rotates
        *[
            (
                MiniMaxM2Model,
                MiniMaxM2Config(
                    num_key_value_heads=2, head_dim=16, num_local_experts=2, **MOE, **SMALL
                ),
                "minimax_m2",
                {"rope_parameters": None, **edits},
                1,
            )
            for edits in (
                {"rotary_dim": 8},
                {"rotary_dim": 8, "partial_rotary_factor": 0.25},
                {"rotary_dim": None},
            )
        ],
        # VaultGemma with Gemma 2's keys left out: query_pre_attn_scalar 256 (not head_dim),
        # soft-capping 50, local layers first (layer_types derived)
        (
            VaultGemmaModel,
            VaultGemmaConfig(
                num_key_value_heads=2,
                head_dim=16,
                query_pre_attn_scalar=256,
                attn_logit_softcapping=50.0,
                sliding_window=6,
                **SMALL,
            ),
            "vaultgemma",
            {"query_pre_attn_scalar": None, "attn_logit_softcapping": None, "layer_types": None},
            0,
        ),
        # EXAONE 4 MoE without layer_types: every sliding_window_pattern-th layer global
        # (layer 1 with 2: no RoPE), the others local
        *[
            (
                ExaoneMoeModel,
                ExaoneMoeConfig(num_key_value_heads=2, sliding_window=6, **MOE, **SMALL),
                "exaone_moe",
                {"layer_types": None, "sliding_window_pattern": 2},
                layer,
            )
            for layer in (0, 1)
        ],
        # LFM2 without layer_types: its attention layers are full_attn_idxs' (layer 1 here);
        # num_key_value_heads 8, norm_eps 1e-5 and rope_theta 1e6 left out
        (
            Lfm2Model,
            Lfm2Config(num_key_value_heads=8, full_attn_idxs=[1], **SMALL),
            "lfm2",
            {"layer_types": None, "num_key_value_heads": None, "norm_eps": None},
            1,
        ),
        # Solar Open with its defaults: head_dim 128 (not hidden_size / heads), 8 KV heads,
        # rope_theta 1e6
        (
            SolarOpenModel,
            SolarOpenConfig(
                num_key_value_heads=8,
                head_dim=128,
                n_routed_experts=2,
                num_experts_per_tok=1,
                moe_intermediate_size=32,
                **{**SMALL, "initializer_range": 0.05},
            ),
            "solar_open",
            {"head_dim": None, "num_key_value_heads": None, "rope_parameters": None},
            0,
        ),
        # FlexOlmo without num_key_value_heads (the heads) nor a RoPE table (theta 500000)
        (
            FlexOlmoModel,
            FlexOlmoConfig(
                num_experts=2, num_experts_per_tok=1, pad_token_id=1, eos_token_id=2, **SMALL
            ),
            "flex_olmo",
            {"num_key_value_heads": None, "rope_parameters": None},
            1,
        ),
        # HyperCLOVA X without attention_multiplier nor head_dim: head_dim ** -0.5 (where
        # Granite's default is 1.0), heads of hidden_size / num_attention_heads
        (
            HyperCLOVAXModel,
            HyperCLOVAXConfig(num_key_value_heads=2, **SMALL),
            "hyperclovax",
            {"attention_multiplier": None, "head_dim": None},
            0,
        ),
        # PhiMoE without sliding_window (none, where Mistral's is 4096) nor
        # num_key_value_heads (8) nor a RoPE table (theta 1e6)
        (
            PhimoeModel,
            PhimoeConfig(num_key_value_heads=8, num_local_experts=2, **MOE, **SMALL),
            "phimoe",
            {"sliding_window": None, "num_key_value_heads": None, "rope_parameters": None},
            1,
        ),
        # CWM without layer_types (a global layer, then three local ones) nor a RoPE table
        # (CwmConfig's llama3 table; a transformers 4 rope_theta beside it is ignored)
        *[
            (
                CwmModel,
                CwmConfig(num_key_value_heads=2, head_dim=16, sliding_window=6, **SMALL),
                "cwm",
                {"layer_types": None, "rope_parameters": None, "rope_theta": 500.0},
                layer,
            )
            for layer in (0, 1)
        ],
        # Jais 2 without attention_bias (true: biases on all four), num_key_value_heads (the
        # heads) nor head_dim (hidden_size / heads)
        (
            Jais2Model,
            Jais2Config(**SMALL),
            "jais2",
            {"attention_bias": None, "num_key_value_heads": None, "head_dim": None},
            1,
        ),
        # HY v3 without a RoPE table: theta 11158840 (HYV3Config's default_theta)
        (
            HYV3Model,
            HYV3Config(num_key_value_heads=2, head_dim=16, **MOE, **SMALL),
            "hy_v3",
            {"rope_parameters": None},
            0,
        ),
        # Jamba without attn_layer_period (8) nor attn_layer_offset (4): layer 4 of 5 is its
        # attention layer; num_key_value_heads 8 left out too
        (
            JambaModel,
            JambaConfig(
                num_experts=2,
                num_experts_per_tok=1,
                mamba_d_state=4,
                **{**SMALL, "num_hidden_layers": 5},
            ),
            "jamba",
            {"attn_layer_period": None, "attn_layer_offset": None, "num_key_value_heads": None},
            4,
        ),
        # Bamba with a partial_rotary_factor beside its RoPE table (BambaConfig overwrites
        # it: half of each head turns) and without num_key_value_heads (8)
        (
            BambaModel,
            BambaConfig(attn_layer_indices=[0], mamba_n_heads=8, mamba_d_head=16, **SMALL),
            "bamba",
            {
                "rope_parameters": {"rope_type": "default", "rope_theta": 500.0},
                "partial_rotary_factor": 1.0,
                "num_key_value_heads": None,
            },
            0,
        ),
        # Nemotron-H without layers_block_type nor hybrid_override_pattern: NemotronHConfig's
        # four blocks (Mamba-2, MoE, attention, MLP), num_hidden_layers not read;
        # num_key_value_heads 8 and head_dim 128 left out too
        (
            NemotronHModel,
            NemotronHConfig(**NEMOTRON_H, **{**SMALL, "initializer_range": 0.05}),
            "nemotron_h",
            {
                "layers_block_type": None,
                "num_key_value_heads": None,
                "head_dim": None,
                "num_hidden_layers": 9,
            },
            2,
        ),
        # Nemotron-H's released configs: hybrid_override_pattern (M: Mamba-2, *: attention)
        (
            NemotronHModel,
            NemotronHConfig(
                num_key_value_heads=2,
                head_dim=16,
                layers_block_type=["linear_attention", "full_attention"],
                **NEMOTRON_H,
                **SMALL,
            ),
            "nemotron_h",
            {"layers_block_type": None, "hybrid_override_pattern": "M*"},
            1,
        ),
        # Granite 4.0 H: no position_embedding_type (NoPE: its attention rotates nothing), no
        # attention_multiplier (1.0), no num_key_value_heads (the heads); layer_types in the
        # legacy names its checkpoints ship (mamba, attention)
        (
            GraniteMoeHybridModel,
            GraniteMoeHybridConfig(
                layer_types=["attention", "mamba"],
                mamba_n_heads=8,
                num_local_experts=2,
                num_experts_per_tok=1,
                shared_intermediate_size=32,
                **SMALL,
            ),
            "granitemoehybrid",
            {
                "position_embedding_type": None,
                "attention_multiplier": None,
                "num_key_value_heads": None,
                "layer_types": ["attention", "mamba"],
            },
            0,
        ),
        # OLMo Hybrid as released: rope_theta null (OlmoHybridModel builds no rotary embedding:
        # NoPE), no layer_types (every 4th layer from layer 3), num_key_value_heads (the heads)
        (
            OlmoHybridModel,
            OlmoHybridConfig(**OLMO_HYBRID, **{**SMALL, "num_hidden_layers": 4}),
            "olmo_hybrid",
            {
                "rope_parameters": {"rope_type": "default", "rope_theta": None},
                "layer_types": None,
                "num_key_value_heads": None,
            },
            3,
        ),
        # MiniMax-01 without layer_types (softmax attention on every other layer from 0), a
        # RoPE table (theta 1e6), num_key_value_heads (8) nor head_dim (hidden_size / heads)
        (
            MiniMaxModel,
            MiniMaxConfig(block_size=16, num_local_experts=2, num_experts_per_tok=1, **SMALL),
            "minimax",
            {
                "layer_types": None,
                "rope_parameters": None,
                "num_key_value_heads": None,
                "head_dim": None,
            },
            0,
        ),
        # RecurrentGemma with its defaults: block_types (two recurrent, then attention: layer 2),
        # the heads' KV heads (MHA), q/k/v without biases (o_proj's), a window of 2048 (longer
        # than the input: its mask is causal here), half of each head rotated
        (
            RecurrentGemmaModel,
            RecurrentGemmaConfig(lru_width=32, **{**SMALL, "num_hidden_layers": 3}),
            "recurrent_gemma",
            {
                "block_types": None,
                "num_key_value_heads": None,
                "attention_bias": None,
                "attention_window_size": None,
                "partial_rotary_factor": None,
            },
            2,
        ),
    ],
    ids=[
        "qwen3_moe_head_dim",
        "starcoder2_use_bias",
        "qwen2_moe_qkv_bias",
        "qwen2_moe_layer_types_0",
        "qwen2_moe_layer_types_1",
        "granite_attention_multiplier",
        "smollm3_no_rope_layers",
        "smollm3_window_layer_types",
        "cohere2_sliding_window_pattern",
        "cohere2_head_dim",
        "seed_oss_o_bias_only",
        "seed_oss_defaults",
        "olmo3_rope_scaling_local",
        "olmo3_rope_scaling_global",
        "gpt_neox_rotary_pct_rotary_emb_base",
        "gpt_neox_rotary_pct_default",
        "phi_rope_theta_partial_rotary_factor",
        "phi_partial_rotary_factor_default",
        "stablelm_rope_theta_partial_rotary_factor",
        "stablelm_partial_rotary_factor_default",
        "nemotron_rope_theta_partial_rotary_factor",
        "nemotron_partial_rotary_factor_default",
        "nemotron_rope_table_without_partial_rotary_factor",
        "gptj_rotary_dim_default",
        "gptj_aliases",
        "gptj_rotary_dim_fraction",
        "codegen_rotary_dim_default",
        "glm4_moe_defaults",
        "apertus_rope_table_default",
        "apertus_default_theta",
        "ernie4_5_moe_defaults",
        "dots1_layer_types_derived",
        "dots1_max_window_layers_default",
        "minimax_m2_rotary_dim",
        "minimax_m2_partial_rotary_factor_over_rotary_dim",
        "minimax_m2_every_dim",
        "vaultgemma_defaults",
        "exaone_moe_layer_types_derived_local",
        "exaone_moe_layer_types_derived_global",
        "lfm2_full_attn_idxs",
        "solar_open_defaults",
        "flex_olmo_defaults",
        "hyperclovax_attention_multiplier_default",
        "phimoe_defaults",
        "cwm_defaults_global",
        "cwm_defaults_local",
        "jais2_defaults",
        "hy_v3_default_theta",
        "jamba_defaults",
        "bamba_partial_rotary_factor_beside_its_table",
        "nemotron_h_defaults",
        "nemotron_h_hybrid_override_pattern",
        "granitemoehybrid_nope_defaults",
        "olmo_hybrid_nope_as_released",
        "minimax_defaults",
        "recurrent_gemma_defaults",
    ],
)
def test_keys_left_out_are_read_with_the_familys_defaults(
    tmp_path, cls, config, family, edits, layer
):
    directory = checkpoint(tmp_path, cls, config, **edits)
    assert_served_as_transformers(directory, cls, family, layer)


@pytest.mark.parametrize(
    ("edits", "piece"),
    [
        # its sin and cos cover rotary_dim + 1 dims (pairs): no layer runs
        ({"rotary_dim": 7}, "gptj rotary_dim 7 is odd"),
        # more dims than a head has, or none (rotary_dim 0 makes it size its table by n_embd)
        ({"rotary_dim": 32}, "gptj rotary_dim must be an int from 2 to head_dim 16, got 32"),
        ({"rotary_dim": 0}, "gptj rotary_dim must be an int from 2 to head_dim 16, got 0"),
        ({"n_embd": 66}, "n_embd 66 is not divisible by n_head 4"),
    ],
    ids=["rotary_dim_odd", "rotary_dim_past_head", "rotary_dim_zero", "n_embd_by_n_head"],
)
def test_gptj_sizes_transformers_runs_no_layer_from_are_refused(tmp_path, edits, piece):
    directory = _config_only(tmp_path, GPTJConfig(n_embd=64, n_head=4, rotary_dim=8, **GPTJ))
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **edits}))
    with pytest.raises((RuntimeError, ValueError)), torch.no_grad():  # transformers' own
        model = GPTJModel(AutoConfig.from_pretrained(directory)).eval()
        model(inputs_embeds=torch.zeros(1, 3, 64 if "n_embd" not in edits else 66))
    for layer in (0, 1):
        with pytest.raises(ValueError, match=piece):
            read_hf_layer(directory, layer)


ROPE_THETA_DEFAULTS = [
    # (model class, config, layer with RoPE, transformers' default_theta for the family)
    (
        MixtralForCausalLM,
        MixtralConfig(num_key_value_heads=2, num_local_experts=2, num_experts_per_tok=1, **SMALL),
        0,
        1e6,
    ),
    (  # (layers 0 to 2 of every 4 have RoPE)
        SmolLM3Model,
        SmolLM3Config(num_key_value_heads=2, **NO_TOKENS, **SMALL),
        0,
        2e6,
    ),
]


@pytest.mark.parametrize(
    ("cls", "config", "layer", "theta"), ROPE_THETA_DEFAULTS, ids=["mixtral", "smollm3"]
)
@pytest.mark.parametrize(
    "rope",
    [None, {"rope_type": "linear", "factor": 2.0}],
    ids=["no_rope_parameters", "table_without_rope_theta"],
)
def test_rope_theta_left_out_takes_the_familys_default_theta(
    tmp_path, cls, config, layer, theta, rope
):
    # MixtralConfig's default_theta is 1e6 and SmolLM3Config's 2e6, not 1e4: served with
    # 1e4 (the generic default), the layer's output was off by ~4 and answered OK
    directory = checkpoint(tmp_path, cls, config, rope_parameters=rope, rope_theta=None)
    assert AutoConfig.from_pretrained(directory).rope_parameters["rope_theta"] == theta
    assert read_hf_layer(directory, layer).attention.rope.theta == theta
    assert_served_as_transformers(directory, cls, config.model_type, layer)


@pytest.mark.parametrize(
    ("config", "key"),
    [
        # Mixtral has no window unless set (Mistral's default is 4096)
        (MixtralConfig(num_key_value_heads=2, sliding_window=6, **SMALL), "sliding_window"),
        # Ministral: 4096 on every layer
        (
            MinistralConfig(num_key_value_heads=2, head_dim=8, sliding_window=6, **SMALL),
            "sliding_window",
        ),
        # Qwen3-MoE: a window only with use_sliding_window (its config drops it otherwise)
        (
            Qwen3MoeConfig(num_key_value_heads=2, use_sliding_window=True, sliding_window=6),
            "use_sliding_window",
        ),
    ],
    ids=["mixtral", "ministral", "qwen3_moe"],
)
def test_windows_left_out_take_transformers_defaults(tmp_path, config, key):
    # (a window of 4096 or none differ too little on a short input to test by outputs: the
    # values themselves are compared, for both layers)
    config.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    cfg = json.loads(path.read_text())
    for gone in (key, "layer_types"):
        cfg.pop(gone, None)
    path.write_text(json.dumps(cfg))
    theirs = AutoConfig.from_pretrained(tmp_path)
    for layer in (0, 1):
        got = read_hf_layer(tmp_path, layer).attention.sliding_window
        assert got == theirs.sliding_window, f"layer {layer}: {got} != {theirs.sliding_window}"


@pytest.mark.parametrize("gone", ["null", "left_out"])
def test_ministral_without_head_dim_is_refused_as_transformers_builds_no_layer(tmp_path, gone):
    # MinistralConfig's head_dim defaults to null and MinistralAttention multiplies by it:
    # we served hidden_size / num_attention_heads, a layer transformers never runs
    config = MinistralConfig(num_key_value_heads=2, sliding_window=6, **SMALL)
    config.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    cfg = json.loads(path.read_text())
    assert cfg["head_dim"] is None  # (as MinistralConfig writes it)
    if gone == "left_out":
        del cfg["head_dim"]
        path.write_text(json.dumps(cfg))
    with pytest.raises(TypeError):  # transformers' own: no layer to compare with
        MinistralModel(AutoConfig.from_pretrained(tmp_path))
    for layer in (0, 1):
        with pytest.raises(ValueError, match="ministral config.json has no head_dim"):
            read_hf_layer(tmp_path, layer)


def test_codegen_heads_not_in_its_four_groups_are_refused(tmp_path):
    # CodeGenAttention reshapes qkv_proj's output into 4 groups (mp_num) of whole heads
    config = CodeGenConfig(n_embd=48, n_head=6, rotary_dim=4, **GPTJ)
    directory = _config_only(tmp_path, config)
    with pytest.raises(RuntimeError), torch.no_grad():  # transformers' own: no layer runs
        model = CodeGenModel(AutoConfig.from_pretrained(directory)).eval()
        model(inputs_embeds=torch.zeros(1, 3, 48))
    with pytest.raises(ValueError, match="codegen n_head 6 is not a multiple of 4"):
        read_hf_layer(directory, 0)


@pytest.mark.parametrize("gone", ["null", "left_out"])
def test_nemotron_without_num_key_value_heads_is_refused_as_transformers_builds_no_layer(
    tmp_path, gone
):
    # NemotronConfig leaves num_key_value_heads null (no fallback to num_attention_heads)
    # and NemotronAttention divides by it: no layer to serve
    NemotronConfig(**SMALL).save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    cfg = json.loads(path.read_text())
    assert cfg["num_key_value_heads"] is None  # (as NemotronConfig writes it)
    if gone == "left_out":
        del cfg["num_key_value_heads"]
        path.write_text(json.dumps(cfg))
    with pytest.raises(TypeError):  # transformers' own: no layer to compare with
        NemotronModel(AutoConfig.from_pretrained(tmp_path))
    for layer in (0, 1):
        with pytest.raises(ValueError, match="nemotron config.json has no num_key_value_heads"):
            read_hf_layer(tmp_path, layer)


@pytest.mark.parametrize("layer", [0, 1])
def test_mistral3_serves_its_language_model_not_the_vision_tower(tmp_path, layer):
    # Mistral Small 3.x: a Pixtral vision tower whose layers hold q_proj/k_proj too
    text = MistralConfig(num_key_value_heads=2, sliding_window=6, **SMALL)
    vision = {
        "model_type": "pixtral",
        "hidden_size": 32,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "head_dim": 16,
        "image_size": 28,
        "patch_size": 14,
    }
    config = Mistral3Config(text_config=text.to_dict(), vision_config=vision)
    torch.manual_seed(0)
    Mistral3ForConditionalGeneration(config).save_pretrained(tmp_path)
    model = Mistral3ForConditionalGeneration.from_pretrained(tmp_path, attn_implementation="eager")
    base = model.eval().model.language_model
    module, info = load_hf_layer(tmp_path, layer)
    assert info.family == "mistral3" and info.attention.sliding_window == 6
    x = torch.randn(1, 20, SMALL["hidden_size"], generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, _ = reference_attention("mistral", base, layer, x)
        got = module(x).output
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _config_only(tmp_path, config, **edits):
    config.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(edits)
    path.write_text(json.dumps(cfg))
    return tmp_path


SLIDING_FIRST = ["sliding_attention", "full_attention"]


@pytest.mark.parametrize(
    ("config", "edits", "layer", "piece"),
    [
        # OLMo and OLMoE clamp q, k and v to +-clip_qkv: not served (their clip_qkv null is)
        (OlmoConfig(pad_token_id=1, **SMALL), {"clip_qkv": 8.0}, 0, "olmo clip_qkv 8.0"),
        (OlmoeConfig(**SMALL), {"clip_qkv": 4.0}, 1, "olmoe clip_qkv 4.0"),
        # Cohere's q/k norm is a LayerNorm (use_qk_norm); partial RoPE outside GLM
        (
            Cohere2Config(pad_token_id=0, **SMALL),
            {"model_type": "cohere", "use_qk_norm": True},
            0,
            "cohere use_qk_norm true is not supported: its q/k norm is a LayerNorm",
        ),
        (
            Qwen2Config(**SMALL),
            {"partial_rotary_factor": 0.5},
            0,
            "partial_rotary_factor 0.5 is not supported for qwen2",
        ),
        (
            Qwen2Config(**SMALL),
            {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
            0,
            "partial_rotary_factor 0.5 is not supported for qwen2",
        ),
        # GPT-NeoX sizes its heads hidden_size / num_attention_heads, its rotary embedding
        # by head_dim
        (GPTNeoXConfig(**NEOX), {"head_dim": 8}, 0, "gpt_neox head_dim 8 is not supported"),
        # Phi's q/k norm is a LayerNorm (qk_layernorm)
        (
            PhiConfig(**SMALL),
            {"qk_layernorm": True},
            1,
            "phi qk_layernorm true is not supported: its q/k norm is a LayerNorm",
        ),
        # StableLM 2 12B's q/k norm is a LayerNorm per head (qk_layernorm)
        (
            StableLmConfig(num_key_value_heads=8, **SMALL),
            {"qk_layernorm": True},
            0,
            "stablelm qk_layernorm true is not supported: its q/k norm is a LayerNorm",
        ),
        (StableLmConfig(**NEOX), {"head_dim": 8}, 0, "stablelm head_dim 8 is not supported"),
        # whole families: the reason is given
        (  # (served since; without head_dim its config builds no layer)
            Qwen2Config(**SMALL),
            {"model_type": "hunyuan_v1_dense"},
            0,
            "hunyuan_v1_dense config.json has no head_dim (or it is null)",
        ),
        (
            StableLmConfig(**NEOX),
            {"model_type": "persimmon"},
            0,
            "model_type 'persimmon' (architectures ?) is not supported (its q/k norm is a LayerNorm",
        ),
        # a sliding layer without use_sliding_window: transformers' Qwen2 fails on it
        # (its config drops the window), SmolLM3's eager and SDPA masks slide where its
        # flash attention does not: no exact answer to serve
        (  # (Qwen2Config writes the window as null: a config.json written otherwise)
            Qwen2Config(layer_types=SLIDING_FIRST, **SMALL),
            {"sliding_window": 6},
            0,
            "use_sliding_window is off",
        ),
        (
            SmolLM3Config(sliding_window=6, layer_types=SLIDING_FIRST, **NO_TOKENS, **SMALL),
            {},
            0,
            "use_sliding_window is off",
        ),
        # Qwen2-MoE's config reads the window as 0 without use_sliding_window
        (
            Qwen2MoeConfig(layer_types=SLIDING_FIRST, **SMALL),
            {},
            0,
            "use_sliding_window is off",
        ),
        (
            SmolLM3Config(**NO_TOKENS, **SMALL),
            {"no_rope_layers": [1]},
            0,
            "no_rope_layers must list one 0 or 1 per layer",
        ),
        # EXAONE 4 without layer_types nor a window: its config cannot derive them
        (
            Exaone4Config(sliding_window=None, layer_types=["full_attention"] * 2, **SMALL),
            {"layer_types": None},  # (its config wrote sliding_window_pattern 0)
            0,
            "exaone4 without layer_types derives them",
        ),
        (  # (Exaone4Config sets any pattern to 0 without a window)
            Exaone4Config(sliding_window=None, layer_types=["full_attention"] * 2, **SMALL),
            {"layer_types": None, "sliding_window_pattern": 4},
            1,
            "exaone4 without layer_types derives them",
        ),
        # OLMo 3 with a rope_theta of its own and no tables: transformers 5 gives its local
        # layers 500000 anyway (4.x gave them rope_theta)
        (
            Olmo3Config(layer_types=SLIDING_FIRST, pad_token_id=1, **SMALL),
            {"rope_parameters": None, "rope_theta": 10000.0},
            0,
            "transformers 5 reads it for the global layers only",
        ),
        # MiniMax-M2's rotary_dim odd (transformers turns one dim more, at frequencies over
        # rotary_dim) or past head_dim (no layer runs)
        *[
            (
                MiniMaxM2Config(head_dim=16, **SMALL),
                {"rotary_dim": turned, "rope_parameters": None},
                0,
                f"minimax_m2 rotary_dim must be an even int from 2 to head_dim 16, got {turned}",
            )
            for turned in (7, 32)
        ],
        # Nemotron's factor turning an odd number of dims of a head (int(16 * 0.2): 3; its
        # rotary embedding turns 4 at frequencies over 3): refused naming the key it is in
        (
            NemotronConfig(num_key_value_heads=2, head_dim=16, **SMALL),
            {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.2}},
            0,
            "rope_parameters.partial_rotary_factor 0.2 of head_dim 16 turns 3 dims",
        ),
        (
            NemotronConfig(num_key_value_heads=2, head_dim=16, **SMALL),
            {"rope_parameters": None, "partial_rotary_factor": 0.1},
            1,
            "partial_rotary_factor 0.1 of head_dim 16 turns 1 dims",
        ),
        # LFM2's short-convolution layers are not attention: refused naming what they are and
        # the attention layers; a layer type it does not know it runs as full attention
        (
            Lfm2Config(layer_types=["conv", "full_attention"], **SMALL),
            {},
            0,
            "layer 0 of lfm2 is a 'conv' layer (a short convolution (Lfm2ShortConv), not "
            "attention); its full_attention layers are [1]",
        ),
        (
            Lfm2Config(full_attn_idxs=[1], **SMALL),
            {"layer_types": None},
            0,
            "its full_attention layers are [1]",
        ),
        (
            Lfm2Config(layer_types=["full_attention", "sliding_attention"], **SMALL),
            {"sliding_window": 6},
            1,
            "layer 1 of lfm2 is a 'sliding_attention' layer (not supported)",
        ),
        # Jamba's Mamba layers: refused naming its attention layers (every attn_layer_period-th
        # from attn_layer_offset; JambaConfig computes them, and loads no config.json that
        # lists them, nor one whose offset is not below the period)
        (
            JambaConfig(attn_layer_period=2, attn_layer_offset=1, **SMALL),
            {},
            0,
            "layer 0 of jamba is a 'linear_attention' layer (a Mamba block (JambaMambaMixer), "
            "not attention); its full_attention layers are [1]",
        ),
        (
            JambaConfig(**SMALL),
            {"layer_types": ["linear_attention", "full_attention"]},
            1,
            "jamba config.json sets layer_types",
        ),
        (
            JambaConfig(attn_layer_period=2, attn_layer_offset=1, **SMALL),
            {"attn_layer_offset": 2},
            1,
            "attn_layer_offset 2 must be smaller than attn_layer_period 2",
        ),
        # Bamba's Mamba-2 layers, and all of them without attn_layer_indices; BambaConfig
        # computes its layer kinds (layer_types is its name of them): a config.json listing
        # them it loads not
        *[
            (
                BambaConfig(attn_layer_indices=indices, **SMALL),
                {},
                0,
                "layer 0 of bamba is a 'linear_attention' layer (a Mamba-2 block (BambaMixer), "
                f"not attention); its full_attention layers are {served}",
            )
            for indices, served in (([1], "[1]"), (None, "none"))
        ],
        (
            BambaConfig(attn_layer_indices=[1], **SMALL),
            {"layer_types": ["linear_attention", "full_attention"]},
            1,
            "bamba config.json sets layer_types",
        ),
        # Nemotron-H's other blocks (Mamba-2, MoE, MLP) refused naming its attention ones,
        # from layers_block_type or its legacy names, or hybrid_override_pattern; a kind or a
        # letter NemotronHConfig does not know loads no config
        *[
            (
                NemotronHConfig(layers_block_type=["linear_attention", "full_attention"]),
                edits,
                layer,
                f"layer {layer} of nemotron_h is a {kind!r} layer ({what}); its full_attention "
                f"layers are {served}",
            )
            for edits, layer, kind, what, served in (
                (
                    {},
                    0,
                    "linear_attention",
                    "a Mamba-2 block (NemotronHMamba2Mixer), not attention",
                    "[1]",
                ),
                (
                    {"layers_block_type": ["mamba", "attention", "mlp"]},
                    2,
                    "mlp",
                    "an MLP block (NemotronHMLP), not attention",
                    "[1]",
                ),
                (
                    {"layers_block_type": None, "hybrid_override_pattern": "M*E*"},
                    2,
                    "moe",
                    "a mixture-of-experts MLP block (NemotronHMoE), not attention",
                    "[1, 3]",
                ),
            )
        ],
        (
            NemotronHConfig(layers_block_type=["linear_attention", "full_attention"]),
            {"layers_block_type": None, "hybrid_override_pattern": "M*X"},
            1,
            "hybrid_override_pattern must be a string of ME*-, got 'M*X'",
        ),
        (
            NemotronHConfig(layers_block_type=["linear_attention", "full_attention"]),
            {"layers_block_type": ["full_attention", "conv"]},
            0,
            "layers_block_type has 'conv', not one of",
        ),
        # Granite 4.0's hybrids: Mamba-2 layers refused naming the attention ones (layer_types,
        # legacy names read as transformers remaps them; none without it)
        *[
            (
                GraniteMoeHybridConfig(**SMALL),
                {"layer_types": kinds},
                0,
                "layer 0 of granitemoehybrid is a 'linear_attention' layer (a Mamba-2 block "
                f"(GraniteMoeHybridMambaLayer), not attention); its full_attention layers are "
                f"{served}",
            )
            for kinds, served in ((["mamba", "attention"], "[1]"), (None, "none"))
        ],
        # LFM2-MoE's short convolutions, refused naming its attention layers; without
        # layer_types (Lfm2MoeConfig derives none, its model builds no layer) refused
        (
            Lfm2MoeConfig(layer_types=["conv", "full_attention"], **SMALL),
            {},
            0,
            "layer 0 of lfm2_moe is a 'conv' layer (a short convolution (Lfm2MoeShortConv), "
            "not attention); its full_attention layers are [1]",
        ),
        (
            Lfm2MoeConfig(**SMALL),
            {},
            1,
            "lfm2_moe config.json has no layer_types (or it is null)",
        ),
        # OLMo Hybrid's Gated DeltaNet layers, refused naming its attention ones (without
        # layer_types: every 4th from layer 3, the last where none is); a list without both
        # kinds OlmoHybridConfig loads not
        *[
            (
                OlmoHybridConfig(**OLMO_HYBRID, **SMALL),
                edits,
                0,
                "layer 0 of olmo_hybrid is a 'linear_attention' layer (Gated DeltaNet: linear "
                f"attention, no softmax over a KV cache); its full_attention layers are {served}",
            )
            for edits, served in (
                ({"layer_types": None, "num_hidden_layers": 8}, "[3, 7]"),
                ({"layer_types": None, "num_hidden_layers": 3}, "[2]"),
            )
        ],
        (
            OlmoHybridConfig(**OLMO_HYBRID, **SMALL),
            {"layer_types": ["full_attention", "full_attention"]},
            0,
            "OlmoHybridConfig expects at least one linear_attention and one attention layer",
        ),
        # MiniMax-01's lightning attention layers, refused naming its softmax ones
        (
            MiniMaxConfig(**SMALL),
            {"layer_types": None},
            1,
            "layer 1 of minimax is a 'linear_attention' layer (lightning attention "
            "(MiniMaxLightningAttention): linear attention, no softmax over a KV cache); its "
            "full_attention layers are [0]",
        ),
        # RecurrentGemma's RG-LRU blocks, refused naming its attention layers; its rotary
        # embedding takes the default RoPE only
        (
            RecurrentGemmaConfig(**SMALL),
            {"block_types": ["recurrent", "attention"]},
            0,
            "layer 0 of recurrent_gemma is a 'linear_attention' layer (an RG-LRU recurrent "
            "block (RecurrentGemmaRecurrentBlock), not attention); its sliding_attention layers "
            "are [1]",
        ),
        (
            RecurrentGemmaConfig(block_types=["recurrent", "attention"], **SMALL),
            {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
            1,
            "recurrent_gemma rope type 'linear' is not supported",
        ),
        # PhiMoE's scaled RoPE is Phi-3's longrope (its config validates any other table as
        # longrope's): refused as Phi-3's
        (
            PhimoeConfig(**SMALL),
            {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
            0,
            "phimoe rope type 'linear' is not supported",
        ),
    ],
    ids=[
        "olmo_clip_qkv",
        "olmoe_clip_qkv",
        "cohere_qk_norm",
        "qwen2_partial_rope",
        "qwen2_partial_rope_table",
        "gpt_neox_head_dim",
        "phi_qk_layernorm",
        "stablelm_qk_layernorm",
        "stablelm_head_dim",
        "hunyuan",
        "persimmon",
        "qwen2_sliding_without_switch",
        "smollm3_sliding_without_switch",
        "qwen2_moe_sliding_without_switch",
        "smollm3_no_rope_layers_short",
        "exaone4_layer_types_underivable",
        "exaone4_pattern_without_window",
        "olmo3_rope_theta_untabled",
        "minimax_m2_rotary_dim_odd",
        "minimax_m2_rotary_dim_past_head",
        "nemotron_partial_rotary_factor_odd",
        "nemotron_partial_rotary_factor_odd_v4",
        "lfm2_conv_layer",
        "lfm2_conv_layer_by_full_attn_idxs",
        "lfm2_sliding_layer_type",
        "jamba_mamba_layer",
        "jamba_layer_types",
        "jamba_offset_past_period",
        "bamba_mamba_layer",
        "bamba_no_attention_layers",
        "bamba_layer_types",
        "nemotron_h_mamba_block",
        "nemotron_h_mlp_block_legacy_names",
        "nemotron_h_moe_block_by_pattern",
        "nemotron_h_pattern_letter",
        "nemotron_h_kind",
        "granitemoehybrid_mamba_layer",
        "granitemoehybrid_no_attention_layers",
        "lfm2_moe_conv_layer",
        "lfm2_moe_without_layer_types",
        "olmo_hybrid_deltanet_layer",
        "olmo_hybrid_deltanet_layer_few",
        "olmo_hybrid_no_deltanet",
        "minimax_lightning_layer",
        "recurrent_gemma_rg_lru_block",
        "recurrent_gemma_rope_type",
        "phimoe_rope_scaling",
    ],
)
def test_variants_we_cannot_serve_exactly_are_refused_by_name(
    tmp_path, config, edits, layer, piece
):
    with pytest.raises(ValueError) as err:
        read_hf_layer(_config_only(tmp_path, config, **edits), layer)
    assert piece in str(err.value), str(err.value)


# Families whose attention needs a feature mha-serve lacks, and the feature the refusal names
# (their config.json as transformers' own config class writes it; docs/models.md's survey).
REFUSED_FAMILIES = {
    **dict.fromkeys(("qwen4_exp", "qwen4_exp_text"), "its QSA indexer picks"),
    "laguna": "softplus(g_proj(x)), not a sigmoid",
    "hrm_text": "two stacks run recurrently (L_module and H_module",
    "diffllama": "differential attention",
    "bitnet": "(attn_sub_norm)",
    "doge": "a dynamic mask",
    "jetmoe": "a mixture of attention heads",
    "falcon_h1": "attention and Mamba-2 side by side",
    "zamba": "a shared attention block",
    "zamba2": "a shared attention block",
    # multi-head latent attention beside what the module does not compute (test_mla serves
    # the rest), and MiMo-V2-Flash (no MLA)
    **dict.fromkeys(("axk2", "hy_v4"), "a lightning indexer"),
    **dict.fromkeys(("dots3_note", "dots3_note_text"), "(k_rope_only_layernorm)"),
    "mimo_v2_flash": "v heads of v_head_dim (128)",
}


@pytest.mark.parametrize(("model_type", "piece"), list(REFUSED_FAMILIES.items()))
def test_families_needing_a_feature_we_lack_are_refused_naming_it(tmp_path, model_type, piece):
    # (these were refused as unknown, without a word of why)
    AutoConfig.for_model(model_type).save_pretrained(tmp_path)
    with pytest.raises(ValueError) as err:
        read_hf_layer(tmp_path, 0)
    message = str(err.value)
    assert f"model_type {model_type!r}" in message and piece in message, message


def test_hy_v3_without_rms_norm_eps_norms_q_and_k_with_its_configs_default(tmp_path):
    # HYV3Config's rms_norm_eps is 1e-5 (its q_norm and k_norm take it), not the 1e-6 read
    # where config.json leaves the key out; inputs small enough that the eps shows.
    config = HYV3Config(num_key_value_heads=2, head_dim=16, **MOE, **SMALL)
    directory = checkpoint(tmp_path, HYV3Model, config, rms_norm_eps=None)
    assert read_hf_layer(directory, 0).attention.qk_norm.eps == HYV3Config().rms_norm_eps
    base = HYV3Model.from_pretrained(directory, attn_implementation="eager").eval()
    module, _ = load_hf_layer(directory, 0)
    x = 1e-3 * torch.randn(1, 12, config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, _ = reference_attention("hy_v3", base, 0, x)
        got = module(x).output
    torch.testing.assert_close(got, want, atol=1e-7, rtol=1e-5)
