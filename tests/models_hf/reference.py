"""Checkpoints written by transformers itself (random init, save_pretrained) and its own
attention modules as the reference: the parity tests' ground truth.

transformers is a test-only dependency (the dev extra); the server never imports it."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AfmoeConfig,
    AfmoeModel,
    ApertusConfig,
    ApertusModel,
    ArceeConfig,
    ArceeModel,
    AXK1Config,
    AXK1Model,
    BailingHybridConfig,
    BailingHybridModel,
    BambaConfig,
    BambaModel,
    BeamConfig,
    BeamModel,
    BertModel,
    BloomConfig,
    BloomModel,
    CodeGenConfig,
    CodeGenForCausalLM,
    CodeGenModel,
    Cohere2Config,
    Cohere2Model,
    CohereConfig,
    CohereModel,
    CwmConfig,
    CwmModel,
    DeepseekV2Config,
    DeepseekV2Model,
    DeepseekV3Config,
    DeepseekV3Model,
    Dots1Config,
    Dots1Model,
    DynamicCache,
    Ernie4_5_MoeConfig,
    Ernie4_5_MoeModel,
    Ernie4_5Config,
    Ernie4_5Model,
    Exaone4Config,
    Exaone4Model,
    ExaoneMoeConfig,
    ExaoneMoeModel,
    FalconConfig,
    FalconForCausalLM,
    FalconModel,
    FlexOlmoConfig,
    FlexOlmoModel,
    Gemma2Config,
    Gemma2Model,
    Gemma3nTextConfig,
    Gemma3nTextModel,
    Gemma3TextConfig,
    Gemma3TextModel,
    Gemma4TextConfig,
    Gemma4TextModel,
    GemmaConfig,
    GemmaModel,
    Glm4Config,
    Glm4Model,
    Glm4MoeConfig,
    Glm4MoeLiteConfig,
    Glm4MoeLiteModel,
    Glm4MoeModel,
    GlmConfig,
    GlmModel,
    GPT2Config,
    GPT2LMHeadModel,
    GPTBigCodeConfig,
    GPTBigCodeForCausalLM,
    GPTJConfig,
    GPTJForCausalLM,
    GPTJModel,
    GPTNeoXConfig,
    GPTNeoXModel,
    GptOssConfig,
    GptOssModel,
    GraniteConfig,
    GraniteModel,
    GraniteMoeConfig,
    GraniteMoeHybridConfig,
    GraniteMoeHybridModel,
    GraniteMoeModel,
    GraniteMoeSharedConfig,
    GraniteMoeSharedModel,
    HeliumConfig,
    HeliumModel,
    HyperCLOVAXConfig,
    HyperCLOVAXModel,
    HYV3Config,
    HYV3Model,
    Jais2Config,
    Jais2Model,
    JambaConfig,
    JambaModel,
    KimiLinearConfig,
    KimiLinearModel,
    Lfm2Config,
    Lfm2Model,
    Lfm2MoeConfig,
    Lfm2MoeModel,
    Lfm3Config,
    Lfm3Model,
    LlamaConfig,
    LlamaForCausalLM,
    MiniCPM3Config,
    MiniCPM3Model,
    MiniMaxConfig,
    MiniMaxM2Config,
    MiniMaxM2Model,
    MiniMaxModel,
    MinistralConfig,
    MinistralModel,
    MistralConfig,
    MistralModel,
    MixtralConfig,
    MixtralForCausalLM,
    MptConfig,
    MptForCausalLM,
    MptModel,
    NemotronConfig,
    NemotronForCausalLM,
    NemotronHConfig,
    NemotronHModel,
    Olmo2Config,
    Olmo2Model,
    Olmo3Config,
    Olmo3Model,
    OlmoConfig,
    OlmoeConfig,
    OlmoeModel,
    OlmoHybridConfig,
    OlmoHybridModel,
    OlmoModel,
    Phi3Config,
    Phi3Model,
    PhiConfig,
    PhiModel,
    PhimoeConfig,
    PhimoeModel,
    Qwen2Config,
    Qwen2Model,
    Qwen2MoeConfig,
    Qwen2MoeModel,
    Qwen3_5MoeTextConfig,
    Qwen3_5MoeTextModel,
    Qwen3_5TextConfig,
    Qwen3_5TextModel,
    Qwen3Config,
    Qwen3Model,
    Qwen3MoeConfig,
    Qwen3MoeModel,
    Qwen3NextConfig,
    Qwen3NextModel,
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
    YoutuConfig,
    YoutuModel,
)
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.models.bloom.modeling_bloom import build_alibi_tensor
from transformers.models.falcon.modeling_falcon import (
    build_alibi_tensor as build_falcon_alibi_tensor,
)
from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

# Small, but every feature on: GQA and MQA, biases, RoPE scaling of each supported kind,
# GPT-2's per-layer scaling, head_dim != hidden_size / heads, sliding windows (shorter than
# the tests' sequences), q/k norms (per head and over the projection), Gemma's scale and
# soft-capping, GPT-OSS's attention sinks. initializer_range well above the default 0.02, so
# that heads attend sharply and a wrong position or head would show far above the tolerances.
INIT = 0.2
COMMON = {"vocab_size": 64, "initializer_range": INIT}
ROTARY = {
    "hidden_size": 64,
    "num_attention_heads": 8,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "max_position_embeddings": 256,
    **COMMON,
}
FALCON = {k: v for k, v in ROTARY.items() if k != "intermediate_size"}  # (ffn_hidden_size)
MOE = {"num_local_experts": 2, "num_experts_per_tok": 1}
# Multi-head latent attention, small: 4 heads (as many KV heads: their defaults, 128 and 20,
# leave eager attention no layer), a latent of 16, q/k heads of 8 + 4 rotary dims
# (v heads of other sizes), a q latent of 24; one dense layer, then an MoE one (2 experts)
MLA = {**ROTARY, "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 16}
MLA.update({"qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "first_k_dense_replace": 1})
MLA_MOE = {"moe_intermediate_size": 32, "n_routed_experts": 2, "num_experts_per_tok": 1}
# OLMo Hybrid's Gated DeltaNet layers, small
OLMO_HYBRID = {"linear_num_key_heads": 2, "linear_num_value_heads": 2, "pad_token_id": None}
OLMO_HYBRID.update({"linear_key_head_dim": 8, "linear_value_head_dim": 8})
# Nemotron-H's Mamba-2 and MoE blocks, small (they are run, never served)
NEMOTRON_H = {"mamba_num_heads": 8, "mamba_head_dim": 16, "ssm_state_size": 8, "n_groups": 1}
NEMOTRON_H.update({"chunk_size": 16, "n_routed_experts": 2, "num_experts_per_tok": 1})
NEMOTRON_H.update({"moe_intermediate_size": 32, "moe_shared_expert_intermediate_size": 32})
# Gated attention (Qwen3-Next, Qwen3.5): a linear-attention layer (gated DeltaNet, small),
# then the full-attention layer served; MoE: two tiny experts and a shared one
GATED = {**ROTARY, "layer_types": ["linear_attention", "full_attention"]}
GATED.update({"linear_num_key_heads": 2, "linear_num_value_heads": 2})
GATED.update({"linear_key_head_dim": 8, "linear_value_head_dim": 8})
GATED_MOE = {"num_experts": 2, "num_experts_per_tok": 1, "moe_intermediate_size": 32}
GATED_MOE["shared_expert_intermediate_size"] = 32
# Checkpoints whose q/k norm gains are drawn at random too (zero-centred gains, 1 + w: at
# their init of 0 a norm read as w, not 1 + w, would go unseen).
RANDOM_NORMS = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
# Checkpoints whose q/k norm gains (weight itself, initialised to 1) are drawn around 1, so
# that a gain read wrongly (as 1 + w, or as none) would show.
RANDOM_GAINS = ("gemma4", "gemma3n", "afmoe", "lfm3", "beam")
# Gemma 3n and Gemma 4, small: a local layer (served by the test of its name), then a global
# one (SERVED's *_global); no per-layer inputs (PLE) nor KV sharing (refused: test_gemma)
GEMMA_V_NORM = {**ROTARY, "layer_types": ["sliding_attention", "full_attention"]}
GEMMA_V_NORM.update({"num_kv_shared_layers": 0, "sliding_window": 6})
# A gate of its own projection: drawn large, so that its sigmoid is far from 1/2 and a gate
# on the wrong heads or dims shows.
OWN_GATES = {
    "afmoe": "gate_proj",
    "bailing_hybrid": "g_proj",
    "lfm3": "g_proj",
    "beam": "gate_proj",
}
WINDOW = 8  # Mistral's; the other windowed layers use other sizes (6, 10, 12)
CHECKPOINTS = {
    # name: (model class, config, layer served by the test of that name; SERVED adds more)
    "gpt2": (
        GPT2LMHeadModel,
        GPT2Config(
            n_embd=64,
            n_head=4,
            n_layer=2,
            n_positions=256,
            scale_attn_by_inverse_layer_idx=True,
            **COMMON,
        ),
        1,
    ),
    "gpt_bigcode": (  # StarCoder 1, SantaCoder: multi_query (c_attn: [q; k; v], one KV head)
        GPTBigCodeForCausalLM,
        GPTBigCodeConfig(n_embd=64, n_head=8, n_layer=2, n_positions=256, **COMMON),
        1,
    ),
    "bloom": (  # ALiBi over 12 heads (not a power of 2); query_key_value's rows per head
        BloomModel,
        BloomConfig(hidden_size=96, n_head=12, n_layer=2, **COMMON),
        1,
    ),
    "mpt": (  # ALiBi over 12 heads; Wqkv's rows [q; k; v]; no biases; softmax_scale set
        MptForCausalLM,
        MptConfig(
            d_model=96,
            n_heads=12,
            n_layers=2,
            max_seq_len=256,
            attn_config={"softmax_scale": 0.2},
            **COMMON,
        ),
        1,
    ),
    "llama": (
        LlamaForCausalLM,
        LlamaConfig(
            num_key_value_heads=2,
            attention_bias=True,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            **ROTARY,
        ),
        1,
    ),
    "qwen2": (
        Qwen2Model,
        Qwen2Config(
            num_key_value_heads=4,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 1000000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            **ROTARY,
        ),
        0,
    ),
    "mistral": (
        MistralModel,
        MistralConfig(
            num_key_value_heads=1,
            sliding_window=WINDOW,
            rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
            **ROTARY,
        ),
        1,
    ),
    "qwen2win": (  # Qwen2 with use_sliding_window: layers from max_window_layers on slide
        Qwen2Model,
        Qwen2Config(
            num_key_value_heads=2,
            use_sliding_window=True,
            sliding_window=12,
            max_window_layers=1,
            **ROTARY,
        ),
        1,
    ),
    "qwen3": (  # q/k norm per head before RoPE, head_dim 16 != 64 / 8, a sliding layer
        Qwen3Model,
        Qwen3Config(
            num_key_value_heads=2,
            head_dim=16,
            use_sliding_window=True,
            sliding_window=10,
            max_window_layers=1,
            rms_norm_eps=1e-5,
            **ROTARY,
        ),
        1,
    ),
    "olmo2": (  # q/k norm over the whole projection, biases
        Olmo2Model,
        Olmo2Config(num_key_value_heads=4, attention_bias=True, pad_token_id=1, **ROTARY),
        0,
    ),
    "gemma2": (  # local (sliding) layer 0, global layer 1; soft-capping; its own scale
        Gemma2Model,
        Gemma2Config(
            num_key_value_heads=2,
            head_dim=16,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=5.0,
            sliding_window=6,
            **ROTARY,
        ),
        0,
    ),
    "gemma3": (  # q/k norm (1 + w), MQA, per-layer-type RoPE, local then global
        Gemma3TextModel,
        Gemma3TextConfig(
            num_key_value_heads=1,
            head_dim=16,
            query_pre_attn_scalar=32,
            sliding_window=6,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 4.0},
            },
            **ROTARY,
        ),
        0,
    ),
    "phi3": (  # one fused qkv_proj, GQA, a window
        Phi3Model,
        Phi3Config(num_key_value_heads=4, sliding_window=10, pad_token_id=0, **ROTARY),
        1,
    ),
    # Families whose attention is one of the above with other keys; MoE: two tiny experts
    # (only the attention tensors are read, beside the experts' in the same files).
    "mixtral": (  # Mistral's: a window on every layer
        MixtralForCausalLM,
        MixtralConfig(num_key_value_heads=2, sliding_window=11, **MOE, **ROTARY),
        1,
    ),
    "ministral": (  # Mistral's, the window on the layers layer_types names
        MinistralModel,
        MinistralConfig(
            num_key_value_heads=4,
            head_dim=8,  # (MinistralAttention needs it set)
            sliding_window=6,
            layer_types=["sliding_attention", "full_attention"],
            **ROTARY,
        ),
        0,
    ),
    "starcoder2": (  # use_bias on all four projections, a window on every layer
        Starcoder2Model,
        Starcoder2Config(num_key_value_heads=2, use_bias=True, sliding_window=9, **ROTARY),
        0,
    ),
    "qwen2_moe": (  # Qwen2's q/k/v biases; its own derivation of the sliding layers
        Qwen2MoeModel,
        Qwen2MoeConfig(
            num_key_value_heads=4,
            use_sliding_window=True,
            sliding_window=6,
            max_window_layers=2,
            num_experts=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            **ROTARY,
        ),
        0,
    ),
    "qwen3_moe": (  # Qwen3's per-head q/k norm; use_sliding_window: every layer slides
        Qwen3MoeModel,
        Qwen3MoeConfig(
            num_key_value_heads=2,
            head_dim=16,
            use_sliding_window=True,
            sliding_window=10,
            num_experts=2,
            num_experts_per_tok=1,
            moe_intermediate_size=32,
            **ROTARY,
        ),
        1,
    ),
    "olmoe": (  # OLMo-2's q/k norm over the projection
        OlmoeModel,
        OlmoeConfig(num_key_value_heads=4, num_experts=2, num_experts_per_tok=1, **ROTARY),
        1,
    ),
    "olmo": (  # Llama's (clip_qkv off), biases
        OlmoModel,
        OlmoConfig(num_key_value_heads=2, attention_bias=True, pad_token_id=1, **ROTARY),
        0,
    ),
    "granite": (  # scale attention_multiplier
        GraniteModel,
        GraniteConfig(
            num_key_value_heads=2, attention_bias=True, attention_multiplier=0.03, **ROTARY
        ),
        0,
    ),
    "granitemoe": (
        GraniteMoeModel,
        GraniteMoeConfig(num_key_value_heads=4, attention_multiplier=0.05, **MOE, **ROTARY),
        1,
    ),
    "granitemoeshared": (
        GraniteMoeSharedModel,
        GraniteMoeSharedConfig(
            num_key_value_heads=1,
            attention_multiplier=0.2,
            shared_intermediate_size=32,
            **MOE,
            **ROTARY,
        ),
        0,
    ),
    "smollm3": (  # NoPE on every 2nd layer (a windowed one here); RoPE on the others
        SmolLM3Model,
        SmolLM3Config(
            num_key_value_heads=2,
            no_rope_layer_interval=2,
            use_sliding_window=True,
            sliding_window=6,
            pad_token_id=None,
            bos_token_id=None,
            eos_token_id=None,
            **ROTARY,
        ),
        0,
    ),
    "cohere2": (  # global layers: no RoPE; local ones: RoPE by interleaved pairs
        Cohere2Model,
        Cohere2Config(
            num_key_value_heads=2,
            attention_bias=True,
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=6,
            pad_token_id=0,
            **ROTARY,
        ),
        1,
    ),
    "exaone4": (  # Qwen3's per-head q/k norm; its global layers have no RoPE (NoPE)
        Exaone4Model,
        Exaone4Config(
            num_key_value_heads=2,
            sliding_window=6,
            layer_types=["sliding_attention", "full_attention"],
            **ROTARY,
        ),
        0,
    ),
    "olmo3": (  # OLMo-2's q/k norm; local and global layers, RoPE per layer type
        Olmo3Model,
        Olmo3Config(
            num_key_value_heads=4,
            sliding_window=6,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 500000.0, "factor": 2.0},
            },
            pad_token_id=1,
            **ROTARY,
        ),
        0,
    ),
    "gpt_oss": (  # attention sinks, biases, GQA, yarn RoPE (GPT-OSS's truncate false),
        # sliding layer 0, full layer 1; MoE MLP (never read) as small as it goes
        GptOssModel,
        GptOssConfig(
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=6,
            num_local_experts=2,
            num_experts_per_tok=1,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 64,
            },
            **ROTARY,
        ),
        0,
    ),
    "gemma": (  # Gemma 1: Llama's attention, head_dim 16 != 64 / 8
        GemmaModel,
        GemmaConfig(num_key_value_heads=2, head_dim=16, **ROTARY),
        1,
    ),
    "arcee": (ArceeModel, ArceeConfig(num_key_value_heads=4, **ROTARY), 0),
    "seed_oss": (  # q/k/v biases (attention_bias), o_proj's off (attention_out_bias)
        SeedOssModel,
        SeedOssConfig(num_key_value_heads=2, head_dim=16, **ROTARY),
        1,
    ),
    # RoPE by interleaved pairs (x[0::2], x[1::2]); GLM's over the first half of each head
    "cohere": (  # q/k/v/o biases; its RoPE in float32 (the same in a float32 model)
        CohereModel,
        CohereConfig(num_key_value_heads=2, attention_bias=True, pad_token_id=0, **ROTARY),
        0,
    ),
    "helium": (  # o_proj without a bias where q/k/v have them
        HeliumModel,
        HeliumConfig(num_key_value_heads=4, head_dim=8, attention_bias=True, **ROTARY),
        1,
    ),
    "ernie4_5": (  # q/k/v/o biases by use_bias
        Ernie4_5Model,
        Ernie4_5Config(num_key_value_heads=2, head_dim=16, use_bias=True, **ROTARY),
        0,
    ),
    "glm": (  # partial_rotary_factor 0.5 (GlmConfig's default); q/k/v biases, o_proj's off
        GlmModel,
        GlmConfig(num_key_value_heads=2, head_dim=16, pad_token_id=0, **ROTARY),
        1,
    ),
    "glm4": (  # a partial_rotary_factor of its own in rope_parameters
        Glm4Model,
        Glm4Config(
            num_key_value_heads=4,
            head_dim=16,
            pad_token_id=0,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 500.0,
                "partial_rotary_factor": 0.25,
            },
            **ROTARY,
        ),
        0,
    ),
    # RoPE by halves over the first part of each head (the rest passes through)
    "gpt_neox": (  # Pythia's layout: one query_key_value, rows per head; a quarter rotated
        GPTNeoXModel,
        GPTNeoXConfig(
            rotary_pct=0.25, rotary_emb_base=500.0, **{**ROTARY, "num_attention_heads": 4}
        ),
        1,
    ),
    "phi": (  # Phi-1/1.5/2: q/k/v and dense with biases, half of each head rotated (GQA here)
        PhiModel,
        PhiConfig(num_key_value_heads=4, partial_rotary_factor=0.5, **ROTARY),
        0,
    ),
    "stablelm": (  # a quarter of each head rotated (StableLmConfig's 0.25); q/k/v biases only
        StableLmModel,
        StableLmConfig(
            num_key_value_heads=2, use_qkv_bias=True, **{**ROTARY, "num_attention_heads": 4}
        ),
        1,
    ),
    # One fused query_key_value laid out per KV head (its query heads, k, v), RoPE
    "falcon": (  # Falcon-40B/180B's new decoder architecture: GQA 8:2; biases (by bias)
        FalconForCausalLM,
        FalconConfig(
            new_decoder_architecture=True,
            num_kv_heads=2,
            bias=True,
            rope_parameters={"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0},
            **FALCON,
        ),
        1,
    ),
    "falcon_mqa": (  # Falcon-7B's: multi_query (8 query heads, then one k, one v), no biases
        FalconForCausalLM,
        FalconConfig(multi_query=True, **FALCON),
        0,
    ),
    "nemotron": (  # half of each head rotated (NemotronConfig's 0.5), head_dim 16 != 64 / 8
        # (Minitron's own head_dim), GQA 8:2, biases on q/k/v/o
        NemotronForCausalLM,
        NemotronConfig(num_key_value_heads=2, head_dim=16, attention_bias=True, **ROTARY),
        0,
    ),
    # RoPE by interleaved pairs over the first rotary_dim dims of each head: GPT-J's 6 of 16
    # (three pairs: by halves they would be other dims), theta 10000, no biases
    "gptj": (
        GPTJForCausalLM,
        GPTJConfig(n_embd=64, n_head=4, n_layer=2, n_positions=256, rotary_dim=6, **COMMON),
        1,
    ),
    # GPT-J's attention with one qkv_proj in 4 groups of [q; v; k]: 8 heads (2 a group),
    # rotary_dim 6 of 8
    "codegen": (
        CodeGenForCausalLM,
        CodeGenConfig(n_embd=64, n_head=8, n_layer=2, n_positions=256, rotary_dim=6, **COMMON),
        0,
    ),
    # Falcon-RW: ALiBi (bfloat16 slope * position, added to q . k before 1 / sqrt(head_dim)),
    # no RoPE; MHA over 12 heads of 8 (slopes not a power of 2's), rows per head, biases
    "falcon_rw": (
        FalconForCausalLM,
        FalconConfig(
            alibi=True,
            multi_query=False,
            bias=True,
            parallel_attn=False,
            **{**FALCON, "hidden_size": 96, "num_attention_heads": 12},
        ),
        1,
    ),
    # GLM-4.5/4.6/4.7: RoPE by halves over half of each head (Glm4MoeConfig's 0.5; GLM and
    # GLM-4 interleave), q/k RMSNorm per head (use_qk_norm), q/k/v biases, o_proj none;
    # its MoE MLP (never read) from layer 1 on, as small as it goes
    "glm4_moe": (
        Glm4MoeModel,
        Glm4MoeConfig(
            num_key_value_heads=2,
            head_dim=16,
            use_qk_norm=True,
            attention_bias=True,
            n_routed_experts=2,
            n_shared_experts=1,
            num_experts_per_tok=1,
            moe_intermediate_size=32,
            pad_token_id=0,
            **ROTARY,
        ),
        1,
    ),
    # Apertus: Qwen3's per-head q/k norm, q/k/v/o biases (attention_bias), GQA 8:2, and
    # ApertusConfig's own RoPE table (llama3, theta 12e6, its 8192-token pretraining context)
    "apertus": (
        ApertusModel,
        ApertusConfig(num_key_value_heads=2, attention_bias=True, **ROTARY),
        0,
    ),
    # ERNIE 4.5 MoE (21B-A3B, 300B-A47B): ERNIE 4.5's attention (interleaved pairs, q/k/v/o
    # biases by use_bias), GQA 8:2; its experts (never read) from layer 1 on
    "ernie4_5_moe": (
        Ernie4_5_MoeModel,
        Ernie4_5_MoeConfig(
            num_key_value_heads=2,
            use_bias=True,
            moe_num_experts=2,
            moe_k=1,
            moe_num_shared_experts=1,
            moe_intermediate_size=32,
            **ROTARY,
        ),
        1,
    ),
    # dots.llm1: Qwen3's per-head q/k norm; layers from max_window_layers on slide (no
    # use_sliding_window): layer 1 here, layer 0 full; its experts (never read) from layer 1
    "dots1": (
        Dots1Model,
        Dots1Config(
            num_key_value_heads=2,
            sliding_window=6,
            max_window_layers=1,
            n_routed_experts=2,
            n_shared_experts=1,
            num_experts_per_tok=1,
            moe_intermediate_size=32,
            first_k_dense_replace=1,
            **ROTARY,
        ),
        1,
    ),
    # MiniMax-M2: OLMo-2's q/k RMSNorm over the whole projection, no biases, RoPE by halves
    # over the first rotary_dim dims of each head (its legacy key: 8 of 16 here, as the
    # released 64 of 128), GQA 8:2; its experts (never read) as few as they go
    "minimax_m2": (
        MiniMaxM2Model,
        MiniMaxM2Config(
            num_key_value_heads=2,
            head_dim=16,
            rotary_dim=8,
            num_local_experts=2,
            num_experts_per_tok=1,
            **ROTARY,
        ),
        0,
    ),
    # VaultGemma: Gemma 2's attention (query_pre_attn_scalar, soft-capping, local then global
    # layers), GQA 8:2, head_dim 16 != 64 / 8
    "vaultgemma": (
        VaultGemmaModel,
        VaultGemmaConfig(
            num_key_value_heads=2,
            head_dim=16,
            query_pre_attn_scalar=20,
            attn_logit_softcapping=4.0,
            sliding_window=6,
            **ROTARY,
        ),
        0,
    ),
    # EXAONE 4 MoE (K-EXAONE): EXAONE 4's attention (per-head q/k norm; its global layers
    # without RoPE where a window is set), no biases; its experts (never read) from layer 1
    "exaone_moe": (
        ExaoneMoeModel,
        ExaoneMoeConfig(
            num_key_value_heads=2,
            sliding_window=6,
            layer_types=["sliding_attention", "full_attention"],
            num_experts=2,
            num_experts_per_tok=1,
            moe_intermediate_size=32,
            **ROTARY,
        ),
        0,
    ),
    # LFM2 (a hybrid): layer 0 a short convolution (refused), layer 1 attention: Qwen3's
    # per-head q/k RMSNorm (q_layernorm, k_layernorm, eps norm_eps) before RoPE, out_proj, no
    # biases, GQA 8:2
    "lfm2": (
        Lfm2Model,
        Lfm2Config(
            num_key_value_heads=2,
            norm_eps=1e-4,
            layer_types=["conv", "full_attention"],
            **ROTARY,
        ),
        1,
    ),
    # LFM2-MoE (a hybrid): LFM2's attention on layer 1 (its experts there too), a short
    # convolution on layer 0 (refused); GQA 8:2, q/k norm eps norm_eps
    "lfm2_moe": (
        Lfm2MoeModel,
        Lfm2MoeConfig(
            num_key_value_heads=2,
            norm_eps=1e-4,
            layer_types=["conv", "full_attention"],
            num_dense_layers=1,
            num_experts=2,
            num_experts_per_tok=1,
            moe_intermediate_size=32,
            **ROTARY,
        ),
        1,
    ),
    # Solar Open: Llama's with q/k/v biases (attention_bias) and none on o_proj (a zero
    # bias), GQA 8:2, head_dim 16 != 64 / 8; its experts (never read) as few as they go
    "solar_open": (
        SolarOpenModel,
        SolarOpenConfig(
            num_key_value_heads=2,
            head_dim=16,
            attention_bias=True,
            n_routed_experts=2,
            num_experts_per_tok=1,
            moe_intermediate_size=32,
            **ROTARY,
        ),
        1,
    ),
    # FlexOlmo: OLMo-2's q/k RMSNorm over the whole projection, q/k/v/o biases here
    # (attention_bias), GQA 8:4; its experts (never read) as few as they go
    "flex_olmo": (
        FlexOlmoModel,
        FlexOlmoConfig(
            num_key_value_heads=4,
            attention_bias=True,
            num_experts=2,
            num_experts_per_tok=1,
            pad_token_id=1,
            eos_token_id=2,
            **ROTARY,
        ),
        0,
    ),
    # HyperCLOVA X: Granite's scale (attention_multiplier), q/k/v/o biases here, GQA 8:2
    # (its peri-layer norms are outside the attention)
    "hyperclovax": (
        HyperCLOVAXModel,
        HyperCLOVAXConfig(
            num_key_value_heads=2, attention_bias=True, attention_multiplier=0.07, **ROTARY
        ),
        1,
    ),
    # PhiMoE (Phi-3.5-MoE): Mixtral's attention (a window on every layer: 6, which a session
    # truncated back to 21 tokens still holds), q/k/v/o biases here (attention_bias), GQA
    # 8:2; its experts (never read) as few as they go
    "phimoe": (
        PhimoeModel,
        PhimoeConfig(
            num_key_value_heads=2,
            attention_bias=True,
            sliding_window=6,
            num_local_experts=2,
            num_experts_per_tok=1,
            **ROTARY,
        ),
        0,
    ),
    # Meta CWM: Llama's attention without biases, a global layer then local ones (layer 1
    # here), CwmConfig's own llama3 RoPE table, GQA 8:2, head_dim 16 != 64 / 8
    "cwm": (
        CwmModel,
        CwmConfig(
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=6,
            layer_types=["full_attention", "sliding_attention"],
            **ROTARY,
        ),
        1,
    ),
    # Jais 2: Llama's attention with q/k/v/o biases (Jais2Config's attention_bias true), GQA
    # 8:2, head_dim 16 != 64 / 8
    "jais2": (
        Jais2Model,
        Jais2Config(num_key_value_heads=2, head_dim=16, **ROTARY),
        0,
    ),
    # Tencent HY v3: Qwen3's per-head q/k RMSNorm before RoPE (Hunyuan v1's comes after it,
    # test_position_families), q/k/v/o biases here (attention_bias), GQA 8:2; its experts (never read) from
    # layer 1, as few as they go
    "hy_v3": (
        HYV3Model,
        HYV3Config(
            num_key_value_heads=2,
            head_dim=16,
            attention_bias=True,
            num_experts=2,
            num_experts_per_tok=1,
            num_shared_experts=1,
            moe_intermediate_size=32,
            **ROTARY,
        ),
        1,
    ),
    # Jamba (a hybrid): a Mamba layer (refused), then the attention layer served
    # (attn_layer_period 2, offset 1): Llama's without RoPE nor biases, GQA 8:2, head_dim 16
    # != 64 / 8 (JambaAttention reads a head_dim config.json sets); experts on layer 1
    "jamba": (
        JambaModel,
        JambaConfig(
            num_key_value_heads=2,
            head_dim=16,
            attn_layer_period=2,
            attn_layer_offset=1,
            num_experts=2,
            num_experts_per_tok=1,
            mamba_d_state=4,
            **ROTARY,
        ),
        1,
    ),
    # Bamba (a hybrid): a Mamba-2 layer (refused), then the attention layer served
    # (attn_layer_indices): Llama's with q/k/v/o biases here (attention_bias), RoPE by halves
    # over half of each head (BambaConfig's fixed partial_rotary_factor), GQA 8:2
    "bamba": (
        BambaModel,
        BambaConfig(
            num_key_value_heads=2,
            attention_bias=True,
            attn_layer_indices=[1],
            rope_parameters={"rope_type": "default", "rope_theta": 500.0},
            mamba_n_heads=8,
            mamba_d_head=16,
            mamba_d_state=8,
            mamba_chunk_size=16,
            **ROTARY,
        ),
        1,
    ),
    # Nemotron-H (a hybrid): a Mamba-2 block (refused), then the attention block served
    # (layers_block_type; its layers.{i}.mixer): Llama's without RoPE nor biases, GQA 8:2,
    # head_dim 16 != 64 / 8
    "nemotron_h": (
        NemotronHModel,
        NemotronHConfig(
            num_key_value_heads=2,
            head_dim=16,
            layers_block_type=["linear_attention", "full_attention"],
            **NEMOTRON_H,
            **{k: v for k, v in ROTARY.items() if k != "num_hidden_layers"},
        ),
        1,
    ),
    # Granite 4.0's hybrid (granitemoehybrid): a Mamba-2 layer (refused), then the attention
    # layer served: Granite's scale (attention_multiplier), RoPE (position_embedding_type
    # "rope"; Granite 4.0 H's "nope" is test_families'), q/k/v/o biases here, GQA 8:2
    "granitemoehybrid": (
        GraniteMoeHybridModel,
        GraniteMoeHybridConfig(
            num_key_value_heads=2,
            attention_bias=True,
            attention_multiplier=0.07,
            position_embedding_type="rope",
            layer_types=["mamba", "attention"],
            mamba_n_heads=8,
            mamba_d_state=8,
            mamba_chunk_size=16,
            num_local_experts=2,
            num_experts_per_tok=1,
            shared_intermediate_size=32,
            **ROTARY,
        ),
        1,
    ),
    # OLMo Hybrid: a Gated DeltaNet layer (refused), then the attention layer served: OLMo-2's
    # q/k RMSNorm over the whole projection, RoPE here (theta 500; null: NoPE, test_families'),
    # q/k/v/o biases (attention_bias), GQA 8:2
    "olmo_hybrid": (
        OlmoHybridModel,
        OlmoHybridConfig(
            num_key_value_heads=2,
            attention_bias=True,
            layer_types=["linear_attention", "full_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 500.0},
            **OLMO_HYBRID,
            **ROTARY,
        ),
        1,
    ),
    # MiniMax-01: a lightning attention layer (refused), then the softmax attention layer
    # served: Mixtral's (no biases), a window of 6 (MiniMaxModel masks its attention layers by
    # sliding_window), GQA 8:2, head_dim 16; experts as few as they go
    "minimax": (
        MiniMaxModel,
        MiniMaxConfig(
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=6,
            layer_types=["linear_attention", "full_attention"],
            block_size=16,
            num_local_experts=2,
            num_experts_per_tok=1,
            **ROTARY,
        ),
        1,
    ),
    # RecurrentGemma: an RG-LRU block (refused), then its local attention served: MQA, RoPE by
    # halves over half of each head, a window of 6 (attention_window_size), o_proj's bias
    # always and q/k/v's by attention_bias (here)
    "recurrent_gemma": (
        RecurrentGemmaModel,
        RecurrentGemmaConfig(
            num_key_value_heads=1,
            attention_bias=True,
            attention_window_size=6,
            block_types=["recurrent", "attention"],
            lru_width=32,
            **{k: v for k, v in ROTARY.items() if k != "max_position_embeddings"},
        ),
        1,
    ),
    # Multi-head latent attention. DeepSeek-V3 (Kimi K2): q through its latent, RoPE by
    # pairs (rope_interleave), yarn with mscale_all_dim (its softmax scale times mscale^2),
    # biases on q_a_proj, kv_a_proj_with_mqa and o_proj
    "deepseek_v3": (
        DeepseekV3Model,
        DeepseekV3Config(
            q_lora_rank=24,
            v_head_dim=12,
            attention_bias=True,
            n_group=1,
            topk_group=1,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 500.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
            **MLA_MOE,
            **MLA,
        ),
        1,
    ),
    # DeepSeek-V2-Lite's: q_proj straight from the hidden states (q_lora_rank null), RoPE
    # by pairs through complex numbers
    "deepseek_v2": (
        DeepseekV2Model,
        DeepseekV2Config(q_lora_rank=None, v_head_dim=8, **MLA_MOE, **MLA),
        0,
    ),
    # GLM-4.7-Flash: nope heads of 12, v heads of 16
    "glm4_moe_lite": (
        Glm4MoeLiteModel,
        Glm4MoeLiteConfig(
            q_lora_rank=24,
            v_head_dim=16,
            n_group=1,
            topk_group=1,
            **MLA_MOE,
            **{**MLA, "qk_nope_head_dim": 12},
        ),
        1,
    ),
    # MiniCPM3: RoPE by halves; v heads of hidden_size / heads (v_head_dim null)
    "minicpm3": (
        MiniCPM3Model,
        MiniCPM3Config(q_lora_rank=24, **{k: v for k, v in MLA.items() if "first_k" not in k}),
        0,
    ),
    # Youtu-LLM: DeepSeek-V3's attention in a dense Llama decoder; RoPE by pairs, biases
    "youtu": (
        YoutuModel,
        YoutuConfig(
            q_lora_rank=24,
            v_head_dim=10,
            attention_bias=True,
            **{k: v for k, v in MLA.items() if "first_k" not in k},
        ),
        0,
    ),
    # A.X-K1: DeepSeek-V3's, always through its q latent; RoPE by halves (rope_interleave
    # false) here
    "axk1": (
        AXK1Model,
        AXK1Config(
            q_lora_rank=24,
            v_head_dim=12,
            rope_interleave=False,
            n_group=1,
            topk_group=1,
            **MLA_MOE,
            **MLA,
        ),
        1,
    ),
    # Kimi Linear: a KDA (linear attention) layer, then the MLA one served, without RoPE
    # (its rope dims unrotated) and without a q latent (its default); MoE experts of 2
    "kimi_linear": (
        KimiLinearModel,
        KimiLinearConfig(
            q_lora_rank=None,
            v_head_dim=12,
            pad_token_id=None,  # (its default, 163839, is past a vocabulary of 64)
            layer_types=["linear_attention", "full_attention"],
            linear_head_dim=8,
            linear_num_heads=2,
            moe_intermediate_size=32,
            num_experts=2,
            num_experts_per_token=1,
            **MLA,
        ),
        1,
    ),
    # Ling 3.0: a KDA (linear attention) layer, then the MLA one served: q_proj (no q
    # latent), RoPE by pairs (theta short enough that a wrong rotation shows), biases on
    # kv_a and o (dense), and a per-head output gate (g_proj) after each head's W_uv
    "bailing_hybrid": (
        BailingHybridModel,
        BailingHybridConfig(
            v_head_dim=12,
            attention_bias=True,
            layer_types=["linear_attention", "full_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 100.0},
            head_dim=8,  # (its KDA layers' heads)
            moe_intermediate_size=32,
            num_experts=2,
            num_experts_per_tok=1,
            n_group=1,
            topk_group=1,
            pad_token_id=None,
            eos_token_id=None,
            **MLA,
        ),
        1,
    ),
    # Beam: a sliding layer, then a full one with a RoPE table of its own (a null table:
    # NoPE with position-scaled queries, refused); q/k norm per head; its gate per dim with a
    # bias per head (gate_bias) beside unbiased projections (zero biases)
    "beam": (
        BeamModel,
        BeamConfig(
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=10,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1000.0},
            },
            num_experts=2,
            num_experts_per_tok=1,
            moe_intermediate_size=32,
            n_group=1,
            topk_group=1,
            pad_token_id=None,
            bos_token_id=None,
            eos_token_id=None,
            **ROTARY,
        ),
        0,
    ),
    # LFM3: a sliding attention layer (RoPE of its layer type, a window), then a full one
    # (SERVED's lfm3_full: proportional RoPE, half of its frequencies non-zero, divided by
    # factor); q/k norm per head, biases, an output gate of one value per head (g_proj,
    # gate_proj on disk). (Its short-convolution layers: test_own_gates.)
    "lfm3": (
        Lfm3Model,
        Lfm3Config(
            num_key_value_heads=2,
            head_dim=16,
            attention_bias=True,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                "full_attention": {
                    "rope_type": "proportional",
                    "rope_theta": 1000.0,
                    "partial_rotary_factor": 0.5,
                    "factor": 2.0,
                },
            },
            pad_token_id=None,
            bos_token_id=None,
            eos_token_id=None,
            **ROTARY,
        ),
        0,
    ),
    # Gated attention: q_proj's rows per head [query; gate], sigmoid(gate) on the heads'
    # output; q/k norm per head (1 + w); RoPE by halves over part of each head
    "qwen3_next": (  # GQA 8:2, head_dim 16, biases (attention_bias), a quarter rotated
        Qwen3NextModel,
        Qwen3NextConfig(
            num_key_value_heads=2, head_dim=16, attention_bias=True, **GATED_MOE, **GATED
        ),
        1,
    ),
    "qwen3_5_text": (  # multimodal RoPE's sections, text positions; half of each head
        Qwen3_5TextModel,
        Qwen3_5TextConfig(
            num_key_value_heads=4,
            head_dim=16,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 1_000_000.0,
                "partial_rotary_factor": 0.5,
                "mrope_section": [2, 1, 1],
                "mrope_interleaved": True,
            },
            **GATED,
        ),
        1,
    ),
    "qwen3_5_moe_text": (  # MQA, head_dim 8, no biases
        Qwen3_5MoeTextModel,
        Qwen3_5MoeTextConfig(num_key_value_heads=1, head_dim=8, **GATED_MOE, **GATED),
        1,
    ),
    # Values RMS-normed per head without a gain (v_norm), q/k norm per head (gain weight),
    # scale 1.0. Gemma 4: GQA 8:2 over heads of 16 on the local layer; the global one with
    # heads of 32, one KV head, values from k_proj (attention_k_eq_v) and proportional RoPE
    # (a quarter of its frequencies non-zero); biases on all four (attention_bias)
    "gemma4": (
        Gemma4TextModel,
        Gemma4TextConfig(
            num_key_value_heads=2,
            head_dim=16,
            global_head_dim=32,
            num_global_key_value_heads=1,
            attention_k_eq_v=True,
            attention_bias=True,
            hidden_size_per_layer_input=0,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                "full_attention": {
                    "rope_type": "proportional",
                    "partial_rotary_factor": 0.25,
                    "rope_theta": 10_000.0,
                },
            },
            **GEMMA_V_NORM,
        ),
        0,
    ),
    # Gemma 3n: MQA over heads of 16, RoPE per layer type (4.x's rope_local_base_freq)
    "gemma3n": (
        Gemma3nTextModel,
        Gemma3nTextConfig(
            num_key_value_heads=1,
            head_dim=16,
            hidden_size_per_layer_input=8,
            laurel_rank=4,
            altup_num_inputs=2,
            rope_local_base_freq=100.0,
            **GEMMA_V_NORM,
        ),
        0,
    ),
    # AFMoE (Trinity): an output gate of its own (gate_proj, per dim; no bias beside biased
    # projections), q/k norm per head; a local layer (RoPE, a window), then a global one
    # (NoPE)
    "afmoe": (
        AfmoeModel,
        AfmoeConfig(
            num_key_value_heads=2,
            head_dim=16,
            attention_bias=True,
            sliding_window=6,
            global_attn_every_n_layers=2,
            num_experts=2,
            num_experts_per_tok=1,
            num_shared_experts=1,
            moe_intermediate_size=32,
            **ROTARY,
        ),
        0,
    ),
}
# Served model name: (checkpoint, layer). Gemma's and GPT-OSS's both kinds of layer,
# SmolLM3's NoPE one.
SERVED = {name: (name, entry[2]) for name, entry in CHECKPOINTS.items()}
SERVED.update(
    {
        "gemma2_global": ("gemma2", 1),
        "gemma3_global": ("gemma3", 1),
        "smollm3_nope": ("smollm3", 1),
        "exaone4_global": ("exaone4", 1),
        "olmo3_global": ("olmo3", 1),
        "gpt_oss_full": ("gpt_oss", 1),
        "cohere2_local": ("cohere2", 0),
        "dots1_full": ("dots1", 0),
        "vaultgemma_global": ("vaultgemma", 1),
        "exaone_moe_global": ("exaone_moe", 1),
        "cwm_global": ("cwm", 0),
        "gemma4_global": ("gemma4", 1),
        "gemma3n_global": ("gemma3n", 1),
        "afmoe_global": ("afmoe", 1),
        "beam_full": ("beam", 1),
        "lfm3_full": ("lfm3", 1),
    }
)


def write_checkpoints(root: Path) -> dict[str, Path]:  # keyed by checkpoint name
    """Each model of CHECKPOINTS, seeded, saved by save_pretrained (safetensors); its biases
    random too (transformers initialises them to 0, where a bias mapped to the wrong rows
    would go unseen)."""
    dirs = {}
    for i, (name, (cls, config, _)) in enumerate(CHECKPOINTS.items()):
        torch.manual_seed(100 + i)
        model = cls(config)
        with torch.no_grad():
            for key, parameter in model.named_parameters():
                if key.endswith((".bias", "gate_bias")):  # (Beam's gate bias per head)
                    parameter.normal_(0.0, INIT)
                if name in RANDOM_NORMS and key.endswith(("q_norm.weight", "k_norm.weight")):
                    parameter.normal_(0.0, INIT)
                if name in RANDOM_GAINS and key.endswith(("q_norm.weight", "k_norm.weight")):
                    parameter.normal_(1.0, INIT)
                if name in OWN_GATES and key.endswith(f"{OWN_GATES[name]}.weight"):
                    parameter.mul_(4.0)
        dirs[name] = root / name
        model.save_pretrained(dirs[name], safe_serialization=True)
    return dirs


def load_reference(name: str, directory: Path):
    """transformers' model from the directory, eager attention (so weights come back)."""
    cls = BertModel if name == "minilm" else CHECKPOINTS[name][0]
    model = cls.from_pretrained(directory, attn_implementation="eager").eval()
    return getattr(model, "transformer", None) or getattr(model, "model", None) or model


def attention_module(base, layer: int):
    """The layer's attention module (GPT-NeoX: .attention; Falcon, BLOOM: h[i].self_attention;
    GPT-J, CodeGen: h[i].attn; MPT: blocks[i].attn; Nemotron-H: .mixer; the others:
    .self_attn)."""
    if isinstance(base, (FalconModel, BloomModel)):
        return base.h[layer].self_attention
    if isinstance(base, GPTJModel | CodeGenModel):
        return base.h[layer].attn
    if isinstance(base, MptModel):
        return base.blocks[layer].attn
    block = base.layers[layer]
    if isinstance(base, NemotronHModel):
        return block.mixer
    if isinstance(base, RecurrentGemmaModel):
        return block.temporal_block
    return block.attention if isinstance(base, GPTNeoXModel) else block.self_attn


def rotation_kwargs(base, layer: int, x: torch.Tensor, positions: torch.Tensor) -> dict:
    """How the layer's attention module takes its positions (positions (1, L)): GPT-J's and
    CodeGen's as position_ids (they rotate by their own table), the others' as cos, sin;
    Kimi Linear's (MLA without RoPE, no rotary embedding) none; the other models without a
    rotary embedding (Jamba's, NoPE OLMo Hybrid's) None."""
    if isinstance(base, GPTJModel | CodeGenModel | RecurrentGemmaModel):
        return {"position_ids": positions}
    if isinstance(base, KimiLinearModel):
        return {}
    if rotary_embedding(base) is None:
        return {"position_embeddings": None}
    return {"position_embeddings": rotary(base, layer, x, positions)}


def layer_window(base, layer: int) -> int | None:
    """The layer's sliding window as transformers applies it (None: full attention): Qwen
    and Gemma keep it on the attention module of sliding layers only; Mistral, Phi-3,
    Mixtral and Starcoder2 read the config's for every layer."""
    types = getattr(base.config, "layer_types", None)  # what the models mask by, where
    if isinstance(base, MiniMaxModel):  # (its softmax layers, all masked by sliding_window)
        return base.config.sliding_window if types[layer] == "full_attention" else None
    if types is not None:  # they have them (EXAONE 4's global layers keep the attribute)
        return base.config.sliding_window if types[layer] == "sliding_attention" else None
    attention = attention_module(base, layer)
    if hasattr(attention, "sliding_window"):
        return attention.sliding_window
    return getattr(base.config, "sliding_window", None)


def rotary(base, layer: int, x: torch.Tensor, positions: torch.Tensor):
    """cos, sin of the layer (Gemma 3, OLMo 3, LFM3: of its layer type) at positions (1, L)."""
    types = getattr(base.config, "layer_types", None)
    if isinstance(
        base,
        Gemma3TextModel | Olmo3Model | Gemma4TextModel | Gemma3nTextModel | Lfm3Model | BeamModel,
    ):
        return base.rotary_emb(x, positions, types[layer])
    return rotary_embedding(base)(x, positions)


def rotary_embedding(base):
    """The model's rotary embedding (LFM2-MoE's is pos_emb), or None (Jamba has none)."""
    return getattr(base, "rotary_emb", None) or getattr(base, "pos_emb", None)


def layer_mask(base, layer: int, x: torch.Tensor, positions: torch.Tensor, cache=None):
    """transformers' own mask for the layer (sliding or causal, masking_utils), for the
    tokens x (1, n, E) at positions (1, n) after the cache's tokens: eager's additive form."""
    make = create_sliding_window_causal_mask if layer_window(base, layer) else create_causal_mask
    return make(
        config=base.config,
        inputs_embeds=x,
        attention_mask=None,
        past_key_values=cache,
        position_ids=positions,
        layer_idx=layer,
        allow_is_causal_skip=False,
    )


def causal_mask(L: int, dtype=torch.float32) -> torch.Tensor:
    """(1, 1, L, L) additive mask as transformers builds it: 0 or the dtype's minimum."""
    blocked = torch.ones(L, L, dtype=torch.bool).triu(1)
    return torch.zeros(1, 1, L, L, dtype=dtype).masked_fill(blocked, torch.finfo(dtype).min)


# Families whose positions are added before the attention (none inside it).
ABSOLUTE = ("gpt2", "gpt_bigcode")


def _own_arguments(base) -> dict:
    """FalconAttention's alibi argument (no default): None, its rotary layers; Gemma 4's
    shared_kv_states (no default; no layer of these checkpoints reads or stores one)."""
    if isinstance(base, Gemma4TextModel):
        return {"shared_kv_states": {}}
    return {"alibi": None} if isinstance(base, FalconModel) else {}


@torch.no_grad()
def reference_attention(
    family: str, base, layer: int, x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' own attention of `layer` over hidden states x (B, L, E) at positions
    0..L-1: (output (B, L, E), weights (B, H, L, L)). BERT: BertSelfAttention and
    BertSelfOutput.dense (not its dropout, residual or LayerNorm), bidirectional."""
    L = x.shape[1]
    if family == "bert":
        attention = base.encoder.layer[layer].attention
        context, weights = attention.self(x, attention_mask=None)[:2]
        return attention.output.dense(context), weights
    if family in ABSOLUTE:
        out, weights = base.h[layer].attn(x, attention_mask=causal_mask(L))[:2]
        return out, weights
    if family == "bloom":
        return bloom_attention(base, layer, x, 0)
    if family == "mpt":
        return mpt_attention(base, layer, x, 0)
    if family == "falcon_rw":
        return falcon_rw_attention(base, layer, x, 0)
    positions = torch.arange(L)[None]
    assert x.shape[0] == 1, "one sequence at a time (the masks are built for one)"
    out, weights = attention_module(base, layer)(
        x,
        attention_mask=layer_mask(base, layer, x, positions),
        **_own_arguments(base),
        **rotation_kwargs(base, layer, x, positions),
    )[:2]
    return out, weights


@torch.no_grad()
def reference_decode(
    family: str, base, layer: int, x: torch.Tensor, cuts: list[int]
) -> tuple[list[torch.Tensor], DynamicCache]:
    """transformers' own incremental path: x (1, L, E) fed in chunks [cuts[i], cuts[i+1])
    through the attention module with a DynamicCache (rotary models: RoPE at the absolute
    positions cache_position). Returns each chunk's output and the cache (keys rotated)."""
    cache = DynamicCache(config=base.config)
    outs = []
    for a, b in zip(cuts, cuts[1:], strict=False):
        pos = torch.arange(a, b)
        chunk = x[:, a:b]
        if family == "bloom":
            out = bloom_attention(base, layer, chunk, a, cache)[0]
        elif family == "mpt":
            out = mpt_attention(base, layer, chunk, a, cache)[0]
        elif family == "falcon_rw":
            out = falcon_rw_attention(base, layer, chunk, a, cache)[0]
        elif family in ABSOLUTE:
            allowed = torch.arange(b)[None, :] <= pos[:, None]  # (b - a, b)
            mask = torch.zeros(1, 1, b - a, b)
            mask = mask.masked_fill(~allowed, torch.finfo(torch.float32).min)
            # (GPTBigCodeAttention takes its cache as layer_past)
            cached = {"layer_past" if family == "gpt_bigcode" else "past_key_values": cache}
            out = base.h[layer].attn(chunk, attention_mask=mask, cache_position=pos, **cached)[0]
        else:  # the mask first, from the cache as it is before this chunk (as the models do)
            mask = layer_mask(base, layer, chunk, pos[None], cache)
            # (GPTNeoXAttention, FalconAttention, GPTJAttention and CodeGenAttention take
            # their cache as layer_past; past_key_values they ignore; CodeGen's takes no
            # cache_position)
            past = (
                "layer_past"
                if isinstance(base, GPTNeoXModel | FalconModel | GPTJModel | CodeGenModel)
                else "past_key_values"
            )
            at = {} if family == "codegen" else {"cache_position": pos}
            out = attention_module(base, layer)(
                chunk,
                attention_mask=mask,
                **at,
                **{past: cache},
                **_own_arguments(base),
                **rotation_kwargs(base, layer, chunk, pos[None]),
            )[0]
        outs.append(out)
    return outs, cache


def bloom_attention(base, layer: int, x: torch.Tensor, past: int, cache=None):
    """BloomAttention of `layer` over x (1, n, E) at positions past..past+n-1 (after the
    cache's tokens), its residual 0 (the module adds it; it is not attention), ALiBi and
    the causal mask as BloomModel builds them for one unpadded sequence: (output, weights)."""
    n = x.shape[1]
    S = past + n
    alibi = build_alibi_tensor(torch.ones(1, S), base.config.n_head, x.dtype)  # (H, 1, S)
    allowed = torch.arange(S)[None, :] <= torch.arange(past, S)[:, None]  # (n, S)
    mask = torch.zeros(1, 1, n, S).masked_fill(~allowed, torch.finfo(x.dtype).min)
    out, weights = base.h[layer].self_attention(
        x, torch.zeros_like(x), alibi, mask, layer_past=cache, use_cache=cache is not None
    )[:2]
    return out, weights


def mpt_attention(base, layer: int, x: torch.Tensor, past: int, cache=None):
    """MptAttention of `layer` over x (1, n, E) at positions past..past+n-1 (after the cache's
    tokens), ALiBi as MptModel builds it (bias_max 8 over max_seq_len keys, whatever
    attn_config says) and the causal mask as MptModel passes it (True: masked): (output,
    weights)."""
    n = x.shape[1]
    S = past + n
    alibi = build_mpt_alibi_tensor(base.config.n_heads, base.config.max_seq_len)  # (H, 1, M)
    blocked = torch.arange(S)[None, :] > torch.arange(past, S)[:, None]  # (n, S)
    out, weights = base.blocks[layer].attn(
        x, position_bias=alibi, past_key_values=cache, attention_mask=blocked[None, None]
    )[:2]
    return out, weights


def falcon_rw_attention(base, layer: int, x: torch.Tensor, past: int, cache=None):
    """FalconAttention of `layer` (Falcon-RW: alibi) over x (1, n, E) at positions
    past..past+n-1 (after the cache's tokens): the ALiBi of Falcon's build_alibi_tensor and
    the causal mask alone, as tiiuae's own code and FalconModel's SDPA path give them (its
    eager path puts the bias into the mask too, so FalconAttention adds it twice): (output,
    weights)."""
    n = x.shape[1]
    S = past + n
    alibi = build_falcon_alibi_tensor(
        torch.ones(1, S, dtype=torch.long), base.config.num_attention_heads, x.dtype
    )
    allowed = torch.arange(S)[None, :] <= torch.arange(past, S)[:, None]  # (n, S)
    mask = torch.zeros(1, 1, n, S, dtype=x.dtype).masked_fill(~allowed, torch.finfo(x.dtype).min)
    out, weights = base.h[layer].self_attention(
        x, alibi, mask, layer_past=cache, use_cache=cache is not None, output_attentions=True
    )[:2]
    return out, weights
