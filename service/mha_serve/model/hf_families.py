"""The Hugging Face families we serve, as data: each family's defaults, required keys and
where its attention differs from Llama's (transformers 5's configuration_<family>.py and
modeling_<family>.py), read by hf_config. No torch here (config files are checked before
torch loads)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

FAMILIES = (
    "bert",
    "gpt2",
    "gpt_bigcode",  # (GPT-2's names for its keys, absolute positions; MQA by multi_query)
    "bloom",  # ALiBi (no RoPE), a fused per-head query_key_value as GPT-NeoX's
    "gptj",  # (GPT-2's names; its RoPE from its own keys: hf_config._gptj)
    "codegen",  # (GPT-J's, its qkv_proj fused in 4 groups)
    "mpt",  # ALiBi (no RoPE), one fused Wqkv ([q; k; v]), its keys under attn_config
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "olmo2",
    "phi3",
    "gemma2",
    "gemma3_text",
    "gemma3",
    # attention as one of the above, with the options the tables below give them
    "mixtral",
    "ministral",
    "starcoder2",
    "qwen2_moe",
    "qwen3_moe",
    "olmoe",
    "olmo",
    "granite",
    "granitemoe",
    "granitemoeshared",
    "smollm3",
    "cohere2",
    "exaone4",
    "gemma",
    "arcee",
    "seed_oss",
    "mistral3",
    "olmo3",
    "gpt_oss",
    # RoPE by interleaved pairs (INTERLEAVED_ROPE), GLM's over half of each head
    "cohere",
    "helium",
    "ernie4_5",
    "glm",
    "glm4",
    # RoPE by halves over part of each head (PARTIAL_ROPE)
    "gpt_neox",
    "phi",
    "stablelm",
    # one fused query_key_value laid out per KV head, RoPE (MQA: Falcon-7B; GQA: 40B, 180B)
    "falcon",
    "nemotron",
    # (newer) attention as one of the above, with the options the tables below give them
    "glm4_moe",  # GLM-4.5, 4.6, 4.7: RoPE by halves over half of each head, q/k norm optional
    "apertus",  # Qwen3's q/k norm, biases on all four, llama3 RoPE by default
    "ernie4_5_moe",  # ERNIE 4.5's (interleaved pairs, use_bias)
    "dots1",  # Qwen3's (q/k norm per head; sliding layers from max_window_layers on)
    "minimax_m2",  # OLMo-2's q/k norm over the projection, RoPE over rotary_dim of each head
    "vaultgemma",  # Gemma 2's (its scale, soft-capping, local and global layers)
    "exaone_moe",  # EXAONE 4's (q/k norm per head, NoPE global layers)
    "lfm2",  # hybrid: its attention layers (Qwen3's q/k norm, out_proj); conv layers refused
    "solar_open",  # Llama's (o_proj without a bias)
    "flex_olmo",  # OLMo-2's (q/k norm over the whole projection)
    "hyperclovax",  # Granite's scale (attention_multiplier; null: head_dim ** -0.5)
    "phimoe",  # Mixtral's (a window on every layer), biases by attention_bias
    "cwm",  # Llama's, three local layers after each global one, its own llama3 RoPE
    "jais2",  # Llama's, biases on all four by default
    "hy_v3",  # Qwen3's (q/k norm per head before RoPE), unlike Hunyuan v1's (after it, below)
    # hybrids: their attention layers (HYBRIDS says which), the others refused naming them
    "jamba",  # Llama's without RoPE nor biases; Mamba on the other layers
    "bamba",  # Llama's, RoPE by halves over half of each head; Mamba-2 on the other layers
    "nemotron_h",  # Llama's without RoPE nor biases (layers.{i}.mixer); Mamba-2, MLP, MoE
    "granitemoehybrid",  # Granite's scale, RoPE by position_embedding_type; Mamba-2 layers
    "lfm2_moe",  # LFM2's (Qwen3's q/k norm, out_proj); short convolutions on the other layers
    "olmo_hybrid",  # OLMo-2's q/k norm, NoPE where theta is null; Gated DeltaNet layers
    "minimax",  # MiniMax-01: Mixtral's on its softmax layers; lightning attention on the others
    "recurrent_gemma",  # local attention (MQA, half-head RoPE, a window) among RG-LRU blocks
    "ministral3",  # Mistral's, its queries scaled by position (LLAMA4_SCALING)
    "nanochat",  # a q/k norm without gains after RoPE (QK_NORM_AFTER_ROPE), RoPE reversed
    # Llama 4: RoPE layers (by pairs, an L2 norm after it, chunked: served up to one chunk)
    # and NoPE layers (queries scaled by position); hf_config._llama4_text
    "llama4_text",
    "llama4",
    # Hunyuan v1: a q/k norm with gains after RoPE (query_layernorm, key_layernorm)
    "hunyuan_v1_dense",
    "hunyuan_v1_moe",
    # multi-head latent attention (MLA: low-rank q and kv projections, one latent per token;
    # hf_config._mla): DeepSeek-V2/V3 (and Kimi K2), GLM-4.7-Flash, MiniCPM3
    "deepseek_v2",
    "deepseek_v3",
    "glm4_moe_lite",
    "minicpm3",
    "kimi_k25",  # (Kimi K2.5's language model: DeepSeek-V3's, MULTIMODAL)
    "youtu",  # (Youtu-LLM: YoutuAttention is DeepseekV3Attention)
    "axk1",  # (A.X-K1: DeepseekV3Attention, always with its q latent)
    "kimi_linear",  # hybrid: its full_attention layers (MLA without RoPE); KDA ones refused
    "bailing_hybrid",  # hybrid (Ling 3.0): its MLA layers, gated per head (OWN_GATE); KDA refused
    "mistral4",  # (Mistral Small 4: DeepSeek-V3's MLA, its queries scaled by position)
    # gated attention (OUTPUT_GATE: Qwen3-Next's, an output gate split from q_proj), its
    # full_attention layers (the others are linear attention, not served)
    "qwen3_next",
    "qwen3_5_text",
    "qwen3_5",
    "qwen3_5_moe_text",
    "qwen3_5_moe",
    # q/k norm per head (gain weight), values RMS-normed without a gain (v_norm), scale 1.0,
    # local and global layers (hf_gemma.py); KV-shared layers refused: Gemma 3n, Gemma 4
    # (its global layers' own head_dim and KV heads, proportional RoPE, values from k_proj)
    "gemma3n_text",
    "gemma3n",
    "gemma4_text",
    "gemma4",
    "gemma4_unified_text",
    "gemma4_unified",
    # an output gate from a projection of their own (OWN_GATE), not q_proj's rows
    "afmoe",  # AFMoE (Trinity): gate_proj per dim; q/k norm per head; NoPE global layers
    "lfm3",  # hybrid: its attention layers (g_proj per head; proportional RoPE on the full
    # ones); conv layers refused
    "beam",  # its sliding layers: gate_proj per dim, gate_bias per head; q/k norm per head
)
# The MLA families (FAMILIES' last), read by hf_config._mla, not as Llama's.
MLA = (
    *("deepseek_v2", "deepseek_v3", "glm4_moe_lite", "minicpm3", "kimi_k25", "youtu", "axk1"),
    "kimi_linear",
    "bailing_hybrid",
    "mistral4",
)
# MLA families whose q is always q_proj(x): q_lora_rank is not read (BailingHybridAttention).
MLA_Q_PROJ = ("bailing_hybrid",)
# MLA without RoPE (KimiLinearAttention: NoPE, its qk_rope_head_dim dims of q and of the
# shared key unrotated; its config has no RoPE table, and its scale no YaRN mscale).
MLA_NOPE = ("kimi_linear",)
# Their RoPE by interleaved pairs, or by halves: DeepSeek-V2's always by pairs (complex
# numbers), MiniCPM3's by halves; the families of MLA_INTERLEAVE_KEY by rope_interleave,
# pairs when config.json leaves it out (a null: halves).
MLA_INTERLEAVED = {
    **dict.fromkeys(("deepseek_v2", "deepseek_v3", "glm4_moe_lite", "youtu", "axk1"), True),
    "bailing_hybrid": True,  # (apply_rotary_pos_emb_interleave, always)
    "minicpm3": False,
    "mistral4": True,
}
MLA_INTERLEAVE_KEY = ("deepseek_v3", "glm4_moe_lite", "youtu", "axk1", "mistral4")
# Families whose attention gates its output (Qwen3NextAttention, Qwen3_5Attention): q_proj's
# rows per head [query (head_dim); gate (head_dim)], the heads' output times sigmoid(gate)
# before o_proj (hf.py splits the rows into wqkv's and wgate's); q/k RMSNorm per head with
# a gain of 1 + weight (OFFSET_NORM); partial RoPE by halves (PARTIAL_ROPE: 0.25); no window.
# Their other layers are linear attention (gated DeltaNet), not served (HYBRIDS).
OUTPUT_GATE = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
# Families whose output gate is a projection of its own, sigmoid(W x) times the heads' output
# before o_proj: {family: (its tensor beside q_proj, one value per head (else per dim), its
# bias: a tensor of one value per head, or None: none, served as a zero bias where the
# projections have one)}. AfmoeAttention's gate_proj (H*D rows, never biased);
# BailingHybridAttention's g_proj (H rows, never biased), after its MLA's W_uv.
OWN_GATE: dict[str, tuple[str, bool, str | None]] = {
    "afmoe": ("gate_proj", False, None),
    "bailing_hybrid": ("g_proj", True, None),
    # (Lfm3Attention's g_proj, with use_attention_gate: gate_proj on disk, as LFM3's
    # checkpoints and save_pretrained write it; transformers renames it when it loads)
    "lfm3": ("gate_proj", True, None),
    # (BeamAttention's gate_proj, and gate_bias (H,) broadcast over each head's dims: the
    # module's wgate bias, so its projections take zero biases without attention_bias)
    "beam": ("gate_proj", False, "gate_bias"),
}
# Families whose own gate is there only when a config.json key turns it on (default on).
OWN_GATE_SWITCH = {"lfm3": "use_attention_gate"}
FULL_ATTENTION_INTERVAL = 4
# Families with RoPE, q_proj/k_proj/v_proj/o_proj (the MLA families' projections are theirs;
# phi3: one qkv_proj; gpt_neox, falcon: one
# query_key_value, laid out per KV head, and dense; phi: dense for o_proj) and GQA, read from
# Llama's keys (GPT-J's and CodeGen's RoPE and sizes are their own keys: hf_config._gptj).
ROTARY = tuple(f for f in FAMILIES[7:] if f not in MLA)
# Families that name their keys as GPT-2 does (n_embd, n_head, n_layer, n_positions; the
# long names are aliases of them: ALIASES).
GPT2_NAMES = ("gpt2", "gpt_bigcode", "gptj", "codegen")
# CodeGenAttention's mp_num: its qkv_proj's rows are 4 groups, each [q; v; k] of a quarter
# of the heads (hf.py regroups them).
CODEGEN_GROUPS = 4
# The per-layer attention kinds of config.json's layer_types that we serve.
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class Hybrid:
    """A family with attention on some layers only: how its config gives each layer's kind,
    which kinds are the attention we serve, and what each other kind is (hf_config refuses
    those layers, naming what they are and the layers it serves)."""

    # A layer's kind where config.json has no `key`, as the family's config derives it:
    # (cfg, layer) -> kind (None: a layer of no kind). It may raise TypeError, KeyError or
    # ValueError where its config fails too.
    derive: Callable[[dict[str, Any], int], str | None]
    others: dict[str, str]  # {kind not served: what it is}
    served: tuple[str, ...] = ("full_attention",)
    # The config.json key listing each layer's kind; None where its config computes them
    # (a property: PROPERTIES refuses a config.json that sets them).
    key: str | None = "layer_types"
    # The number of layers, where its config counts them from their kinds (num_hidden_layers
    # is then not read); None: num_hidden_layers.
    count: Callable[[dict[str, Any]], int] | None = None
    # Why its config loads no such list of kinds (None: it does), where it validates them.
    check: Callable[[list[Any]], str | None] | None = None


# transformers' remap_legacy_layer_types (every config's layer_types): older names of kinds.
LEGACY_LAYER_TYPES = {"mamba": "linear_attention", "attention": "full_attention"}
_GATED_DELTANET = "linear attention (gated DeltaNet), which is no softmax attention over a KV cache"
HYBRIDS: dict[str, Hybrid] = {
    # LFM2: layer_types, else full_attn_idxs ("conv": a short convolution, LFM2's other layers)
    "lfm2": Hybrid(
        lambda c, i: (
            "full_attention"
            if c.get("full_attn_idxs") is None or i in c["full_attn_idxs"]
            else "conv"
        ),
        {"conv": "a short convolution (Lfm2ShortConv), not attention"},
    ),
    # LFM2-MoE: layer_types (required: Lfm2MoeConfig derives none, and its model builds no
    # layer without them)
    "lfm2_moe": Hybrid(
        lambda c, i: None,
        {"conv": "a short convolution (Lfm2MoeShortConv), not attention"},
    ),
    # Kimi Linear: layer_types, else linear_attn_config's full_attn_layers and kda_layers
    # (numbered from 1; a layer in neither has none), else every 4th from layer 4
    "kimi_linear": Hybrid(
        lambda c, i: kimi_linear_layer(c, i),
        {
            "linear_attention": "Kimi Delta Attention (KDA): linear attention, no softmax "
            "over a KV cache"
        },
    ),
    # Jamba: attention on every attn_layer_period-th layer from attn_layer_offset (JambaConfig's
    # layers_block_type, a property: no config.json key lists them), Mamba on the others
    "jamba": Hybrid(
        lambda c, i: jamba_layer(c, i),
        {"linear_attention": "a Mamba block (JambaMambaMixer), not attention"},
        key=None,
    ),
    # Bamba: attention on attn_layer_indices (null: none; BambaConfig's layers_block_type, a
    # property), Mamba-2 on the others
    "bamba": Hybrid(
        lambda c, i: (
            "full_attention"
            if c.get("attn_layer_indices") and i in c["attn_layer_indices"]
            else "linear_attention"
        ),
        {"linear_attention": "a Mamba-2 block (BambaMixer), not attention"},
        key=None,
    ),
    # Nemotron-H: layer_types (its alias), else layers_block_type, else hybrid_override_pattern
    # (M: Mamba-2, *: attention, -: MLP, E: MoE), else NemotronHConfig's four; one block each
    "nemotron_h": Hybrid(
        lambda c, i: nemotron_h_kinds(c)[i],
        {
            "linear_attention": "a Mamba-2 block (NemotronHMamba2Mixer), not attention",
            "moe": "a mixture-of-experts MLP block (NemotronHMoE), not attention",
            "mlp": "an MLP block (NemotronHMLP), not attention",
        },
        key=None,
        count=lambda c: len(nemotron_h_kinds(c)),
    ),
    # Granite 4.0's hybrids: layer_types (null: every layer Mamba-2; legacy "mamba" and
    # "attention" as transformers remaps them); its model masks no other kind
    "granitemoehybrid": Hybrid(
        lambda c, i: "linear_attention",
        {"linear_attention": "a Mamba-2 block (GraniteMoeHybridMambaLayer), not attention"},
    ),
    # OLMo Hybrid: layer_types, else every 4th layer from layer 3 (the last where none is);
    # OlmoHybridConfig loads no list without both kinds
    "olmo_hybrid": Hybrid(
        lambda c, i: (
            "full_attention"
            if i % 4 == 3 or (c["num_hidden_layers"] < 4 and i == c["num_hidden_layers"] - 1)
            else "linear_attention"
        ),
        {"linear_attention": "Gated DeltaNet: linear attention, no softmax over a KV cache"},
        check=lambda kinds: (
            None
            if "linear_attention" in kinds and any(k != "linear_attention" for k in kinds)
            else "OlmoHybridConfig expects at least one linear_attention and one attention layer"
        ),
    ),
    # MiniMax-01: layer_types, else softmax attention on every other layer from layer 0
    "minimax": Hybrid(
        lambda c, i: "linear_attention" if i % 2 else "full_attention",
        {
            "linear_attention": "lightning attention (MiniMaxLightningAttention): linear "
            "attention, no softmax over a KV cache"
        },
    ),
    # RecurrentGemma: block_types repeated over the layers ("recurrent": an RG-LRU block; any
    # other: local attention, its sliding_attention layers)
    "recurrent_gemma": Hybrid(
        lambda c, i: (
            "linear_attention"
            if (list(c["block_types"]) * c["num_hidden_layers"])[i] == "recurrent"
            else "sliding_attention"
        ),
        {
            "linear_attention": "an RG-LRU recurrent block (RecurrentGemmaRecurrentBlock), not "
            "attention"
        },
        served=("sliding_attention",),
        key=None,
    ),
    # The gated families (OUTPUT_GATE): layer_types, else every full_attention_interval-th
    # layer (FULL_ATTENTION_INTERVAL by default) is full attention (Qwen3NextConfig,
    # Qwen3_5TextConfig)
    **dict.fromkeys(
        OUTPUT_GATE,
        Hybrid(lambda c, i: gated_layer(c, i), {"linear_attention": _GATED_DELTANET}),
    ),
    # LFM3: layer_types, else as Lfm3Config derives them ("conv": Lfm3ShortConv); both
    # attention kinds are its attention layers
    "lfm3": Hybrid(
        lambda c, i: (
            "full_attention"
            if i % 4 == 2
            else "sliding_attention"
            if i % 4 == 0 and i > 0
            else "conv"
        ),
        {"conv": "a short convolution (Lfm3ShortConv), not attention"},
        served=LAYER_TYPES,
    ),
    # Ling 3.0: layer_types, else every layer_group_size-th layer is MLA, the others KDA
    "bailing_hybrid": Hybrid(
        lambda c, i: bailing_hybrid_layer(c, i),
        {
            "linear_attention": "BailingHybridDeltaAttention: KDA linear attention, no softmax "
            "over a KV cache"
        },
    ),
}
# transformers' defaults (its configuration_<family>.py) for the keys we read whose absence
# from config.json means something else than our fallback: a key left out is read as
# transformers reads it (a Gemma 3 text_config, for one, lists only what differs). rope_theta:
# the config class's default_theta where it is not the 10000 of RotaryEmbeddingConfigMixin
# (Gemma 3's and OLMo 3's per layer type are PER_TYPE_ROPE's).
DEFAULTS: dict[str, dict[str, Any]] = {
    "mistral": {"num_key_value_heads": 8, "sliding_window": 4096},
    "qwen2": {"num_key_value_heads": 32, "sliding_window": 4096, "max_window_layers": 28},
    "qwen3": {
        "num_key_value_heads": 32,
        "head_dim": 128,
        "sliding_window": 4096,
        "max_window_layers": 28,
    },
    "olmo2": {"rms_norm_eps": 1e-5},
    **dict.fromkeys(
        ("gemma2", "vaultgemma"),
        {
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "query_pre_attn_scalar": 256,
            "sliding_window": 4096,
            "attn_logit_softcapping": 50.0,
        },
    ),
    "gemma3_text": {
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
    },
    "mixtral": {"num_key_value_heads": 8, "rope_theta": 1_000_000.0},
    "ministral": {"num_key_value_heads": 8, "sliding_window": 4096},
    "starcoder2": {"num_key_value_heads": 2, "use_bias": True},
    "qwen2_moe": {
        "num_key_value_heads": 16,
        "sliding_window": 4096,
        "max_window_layers": 28,
        "qkv_bias": True,
    },
    "qwen3_moe": {"num_key_value_heads": 4, "sliding_window": 4096},
    "olmoe": {"rms_norm_eps": 1e-5},
    **dict.fromkeys(
        ("granite", "granitemoe", "granitemoeshared", "granitemoehybrid"),
        {"attention_multiplier": 1.0},
    ),
    "smollm3": {"num_key_value_heads": 4, "no_rope_layer_interval": 4, "rope_theta": 2_000_000.0},
    "cohere2": {"sliding_window": 4096, "sliding_window_pattern": 4},
    **dict.fromkeys(
        ("exaone4", "exaone_moe"),
        {
            "num_key_value_heads": 32,
            "sliding_window": 4096,
            "sliding_window_pattern": 4,
            "rms_norm_eps": 1e-5,
        },
    ),
    "gemma": {"num_key_value_heads": 16, "head_dim": 256},
    "olmo3": {"rms_norm_eps": 1e-5, "sliding_window": 4096},
    "seed_oss": {"num_key_value_heads": 8, "head_dim": 128, "attention_bias": True},
    "gpt_oss": {
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "sliding_window": 128,
        "attention_bias": True,
        "rope_theta": 150000.0,
    },
    "cohere": {"rope_theta": 500_000.0},
    "helium": {"num_key_value_heads": 20, "head_dim": 128, "rope_theta": 100_000.0},
    "ernie4_5": {"num_key_value_heads": 2, "head_dim": 128, "rope_theta": 500_000.0},
    **dict.fromkeys(
        ("glm", "glm4"), {"num_key_value_heads": 2, "head_dim": 128, "attention_bias": True}
    ),
    "gpt_neox": {"attention_bias": True},
    "glm4_moe": {"num_key_value_heads": 8, "rms_norm_eps": 1e-5},
    "apertus": {"rms_norm_eps": 1e-5, "rope_theta": 12_000_000.0},
    "ernie4_5_moe": {"num_key_value_heads": 4, "rope_theta": 500_000.0},
    "dots1": {"num_key_value_heads": 32, "sliding_window": 4096, "max_window_layers": 62},
    **dict.fromkeys(
        ("lfm2", "lfm2_moe"),
        {"num_key_value_heads": 8, "norm_eps": 1e-5, "rope_theta": 1_000_000.0},
    ),
    "beam": {  # (BeamConfig's)
        **{"hidden_size": 5120, "num_hidden_layers": 52, "num_attention_heads": 48},
        **{"num_key_value_heads": 8, "head_dim": 128, "sliding_window": 512},
        "max_position_embeddings": 8192,
    },
    "lfm3": {  # (Lfm3Config's)
        **{"hidden_size": 2048, "num_hidden_layers": 24, "num_attention_heads": 16},
        **{"num_key_value_heads": 4, "head_dim": 128, "sliding_window": 256, "norm_eps": 1e-5},
        "max_position_embeddings": 128_000,
    },
    "solar_open": {"num_key_value_heads": 8, "head_dim": 128, "rope_theta": 1_000_000.0},
    "flex_olmo": {"rope_theta": 500_000.0},
    "phimoe": {"num_key_value_heads": 8, "rope_theta": 1_000_000.0},
    "jais2": {"attention_bias": True},
    "hy_v3": {
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rms_norm_eps": 1e-5,  # (its q_norm and k_norm take it)
        "rope_theta": 11_158_840.0,
    },
    **dict.fromkeys(
        ("hunyuan_v1_dense", "hunyuan_v1_moe"),
        {  # (HunYuanDenseV1Config's, HunYuanMoEV1Config's; rms_norm_eps: the q/k norms')
            **{"hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 32},
            **{"max_position_embeddings": 2048, "rms_norm_eps": 1e-5},
        },
    ),
    "llama4_text": {  # (Llama4TextConfig's)
        **{"hidden_size": 5120, "num_attention_heads": 40, "num_key_value_heads": 8},
        **{"head_dim": 128, "num_hidden_layers": 48, "max_position_embeddings": 131072},
        **{"rms_norm_eps": 1e-5, "use_qk_norm": True, "no_rope_layer_interval": 4},
        **{"attention_chunk_size": 8192, "attn_temperature_tuning": True},
        **{"floor_scale": 8192, "attn_scale": 0.1},
    },
    "nanochat": {  # (NanoChatConfig's)
        **{"hidden_size": 768, "num_attention_heads": 6, "num_hidden_layers": 12},
        **{"max_position_embeddings": 2048},
    },
    "ministral3": {
        **{"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8},
        **{"head_dim": 128, "max_position_embeddings": 262144, "rms_norm_eps": 1e-5},
    },
    "cwm": {
        "num_key_value_heads": 8,
        "head_dim": 128,
        "sliding_window": 8192,
        "rope_theta": 1_000_000.0,
    },
    "minimax_m2": {"num_key_value_heads": 8, "head_dim": 128, "rope_theta": 5_000_000.0},
    "stablelm": {"num_key_value_heads": 32},
    "falcon": {"multi_query": True},
    "jamba": {"num_key_value_heads": 8, "attn_layer_period": 8, "attn_layer_offset": 4},
    "bamba": {"num_key_value_heads": 8},
    "nemotron_h": {"num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 4096},
    "recurrent_gemma": {
        "attention_window_size": 2048,
        "block_types": ["recurrent"] * 2 + ["attention"],
    },
    "minimax": {
        "num_key_value_heads": 8,
        "rope_theta": 1_000_000.0,
        "max_position_embeddings": 131072,
    },
    "gpt_bigcode": {"multi_query": True},
    **dict.fromkeys(
        ("gptj", "codegen"),
        {"n_embd": 4096, "n_head": 16, "n_layer": 28, "n_positions": 2048, "rotary_dim": 64},
    ),
    # (the MLA families' sizes: their config classes' defaults, DeepSeek-V3's, GLM-4.7-Flash's..)
    "deepseek_v2": {
        "num_attention_heads": 32,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
    },
    "deepseek_v3": {
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
    },
    "glm4_moe_lite": {
        "num_attention_heads": 20,
        "num_key_value_heads": 20,
        "kv_lora_rank": 512,
        "q_lora_rank": 768,
        "qk_nope_head_dim": 192,
        "qk_rope_head_dim": 64,
        "v_head_dim": 256,
        "rms_norm_eps": 1e-5,
    },
    # (Youtu-LLM-2B's and A.X-K1's sizes: DeepSeek-V3's latents, fewer heads)
    "youtu": {
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
    },
    "axk1": {
        "num_attention_heads": 64,
        "num_key_value_heads": 64,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
    },
    "mistral4": {  # (Mistral4Config's)
        **{"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 32},
        **{"kv_lora_rank": 256, "q_lora_rank": 1024, "qk_nope_head_dim": 64},
        **{"qk_rope_head_dim": 64, "v_head_dim": 128, "max_position_embeddings": 1048576},
    },
    "kimi_linear": {  # (KimiLinearConfig's; no q latent by default)
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "kv_lora_rank": 512,
        "q_lora_rank": None,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "rms_norm_eps": 1e-5,
    },
    "bailing_hybrid": {  # (BailingHybridConfig's: Ling 3.0's sizes, its RoPE theta)
        **{"hidden_size": 2560, "num_hidden_layers": 42, "num_attention_heads": 32},
        **{"num_key_value_heads": 32, "kv_lora_rank": 512, "qk_nope_head_dim": 128},
        **{"qk_rope_head_dim": 64, "v_head_dim": 128, "rope_theta": 6_000_000.0},
        **{"layer_group_size": 6, "max_position_embeddings": 262144},
    },
    "minicpm3": {
        "num_attention_heads": 40,
        "num_key_value_heads": 40,
        "kv_lora_rank": 256,
        "q_lora_rank": 768,
        "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 32,
        "rms_norm_eps": 1e-5,
    },
    # (Gemma 3n's and Gemma 4's: their text config classes' defaults)
    "gemma3n_text": {
        **{"hidden_size": 2048, "num_hidden_layers": 35, "max_position_embeddings": 32_768},
        **{"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256},
        **{"sliding_window": 512, "num_kv_shared_layers": 15},
    },
    "gemma4_text": {
        **{"hidden_size": 2304, "num_hidden_layers": 30, "max_position_embeddings": 131_072},
        **{"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256},
        **{"sliding_window": 512, "num_kv_shared_layers": 0},
    },
    "gemma4_unified_text": {
        **{"hidden_size": 2304, "num_hidden_layers": 30, "max_position_embeddings": 262_144},
        **{"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256},
        **{"sliding_window": 1024, "num_kv_shared_layers": 0},
        "use_bidirectional_attention": "vision",
    },
    "afmoe": {  # (AfmoeConfig's: no num_key_value_heads, the heads'; a local layer's window)
        **{"hidden_size": 2048, "num_hidden_layers": 32, "max_position_embeddings": 16384},
        **{"num_attention_heads": 16, "head_dim": 128, "rms_norm_eps": 1e-5},
        **{"sliding_window": 1024, "global_attn_every_n_layers": 4},
    },
    # (the gated families' sizes: their config classes' defaults)
    "qwen3_next": {
        **{"hidden_size": 2048, "num_hidden_layers": 48, "max_position_embeddings": 32768},
        **{"num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256},
    },
    "qwen3_5_text": {
        **{"hidden_size": 4096, "num_hidden_layers": 32, "max_position_embeddings": 32768},
        **{"num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256},
    },
    "qwen3_5_moe_text": {
        **{"hidden_size": 2048, "num_hidden_layers": 40, "max_position_embeddings": 32768},
        **{"num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256},
    },
}
# Keys a family's config.json must set (not null), and why: transformers builds no layer
# without them, so whatever we served would be a layer transformers never runs.
REQUIRED: dict[str, dict[str, str]] = {
    **dict.fromkeys(
        ("hunyuan_v1_dense", "hunyuan_v1_moe"),
        {
            "head_dim": "its config leaves it null and its attention sizes q_proj by it (no "
            "layer is built; it does not fall back to hidden_size / num_attention_heads)",
        },
    ),
    "ministral": {
        "head_dim": "MinistralConfig leaves it null and MinistralAttention reads it as is "
        "(it fails to build the layer; it does not fall back to hidden_size / "
        "num_attention_heads)",
    },
    "lfm2_moe": {
        "layer_types": "Lfm2MoeConfig leaves it null and derives none, and its model reads each "
        "layer's kind from it (it fails to build the layers)",
    },
    "nemotron": {
        "num_key_value_heads": "NemotronConfig leaves it null and NemotronAttention divides "
        "num_attention_heads by it (it fails to build the layer; it does not fall back to "
        "num_attention_heads)",
    },
}
# Keys config.json may not set to null, and the families where it may not: transformers 5
# builds no layer from the null (its config class types the key strictly, a bool or an int,
# and rejects it; or its attention computes with it, as head_dim ** -0.5 where the config
# does not fill head_dim in). A null elsewhere means what the family's config makes of it
# (num_key_value_heads: num_attention_heads; head_dim: hidden_size / num_attention_heads for
# Llama, Mistral, ...; sliding_window: none, see hf_config._null_window). ALL: every family.
# Nulls inside the RoPE tables are hf_rope.check_rope_nulls's.
ALL = ("*",)
# (their norms are LayerNorms: rms_norm_eps is not theirs)
_NORM_EPS_FREE = (
    *("bert", "gpt2", "olmo", "starcoder2", "cohere2", "cohere", "gpt_neox", "phi", "stablelm"),
    *("falcon", "gpt_bigcode", "bloom", "gptj", "codegen", "mpt"),
    *("nemotron", "lfm2", "lfm2_moe"),  # (their norm_eps)
    "jais2",  # (its layer_norm_eps)
    "nemotron_h",  # (its layer_norm_epsilon, outside the attention)
)
_HEAD_DIM_FILLED = (
    "bert",
    "gpt2",
    "gpt_bigcode",  # (not read: heads of n_embd / n_head)
    "bloom",
    "gptj",
    "codegen",
    "mpt",  # (not read: heads of d_model / n_heads)
    "llama",
    "mistral",
    "mixtral",
    "starcoder2",
    "arcee",
    "seed_oss",
    "ernie4_5",
    "gpt_neox",
    "stablelm",
    "falcon",  # (FalconConfig computes it; a head_dim in config.json is PROPERTIES')
    "nemotron",
    "hyperclovax",  # (HyperCLOVAXConfig fills it: hidden_size / num_attention_heads)
    "jais2",  # (Jais2Config too)
    "minimax",  # (MiniMaxAttention: head_dim or hidden_size / num_attention_heads)
    "llama4_text",  # (Llama4TextConfig too)
    "ministral3",  # (Ministral3Config too)
    # (not read: their configs set head_dim to qk_rope_head_dim, whatever config.json says;
    # DeepSeek-V3's rotary embedding fails on a null one first; GLM-4.7-Flash's head_dim is
    # another name of qk_rope_head_dim, ALIASES', and a null one nulls that)
    *("deepseek_v2", "minicpm3"),
    "kimi_linear",  # (the same, and no rotary embedding to fail on a null)
    "mistral4",  # (Mistral4Config sets it to qk_nope_head_dim + qk_rope_head_dim)
)
NOT_NULL: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(
        ("hidden_size", "num_attention_heads"),
        ALL,
    ),
    # (NemotronHConfig counts its layers from their kinds, whatever num_hidden_layers says)
    "num_hidden_layers": tuple(f for f in FAMILIES if f != "nemotron_h"),
    # (its alias of layers_block_type, set after it: a null one leaves no kinds to build from)
    "layer_types": ("nemotron_h",),
    # (GraniteMoeHybridConfig's alias of layer_types, set after its default is filled in)
    "layers_block_type": ("granitemoehybrid",),
    # (BLOOM has no context: ALiBi sets none, and BloomConfig keeps a null it does not read;
    # MPT's is max_seq_len)
    # (RecurrentGemmaConfig has none: its window bounds what a layer sees)
    "max_position_embeddings": tuple(
        f for f in FAMILIES if f not in ("bloom", "mpt", "recurrent_gemma")
    ),
    # (RecurrentGemmaConfig's attention_window_size, typed int; sliding_window its alias)
    **dict.fromkeys(
        ("attention_window_size", "sliding_window", "block_types"), ("recurrent_gemma",)
    ),
    # GPT-2's names (hidden_size, ... above are aliases of them; GPT-J's too) and flags
    **dict.fromkeys(("n_embd", "n_positions"), GPT2_NAMES),
    **dict.fromkeys(("n_head", "n_layer"), (*GPT2_NAMES, "bloom")),
    "scale_attn_weights": ("gpt2", "gpt_bigcode"),
    "rotary_dim": ("gptj", "codegen"),
    # BloomConfig's typed fields (a null fails its validation; n_embed it drops when null)
    **dict.fromkeys(("pretraining_tp", "slow_but_exact"), ("bloom",)),
    # MptConfig's typed fields we read (hidden_size, ... above are aliases of the first
    # three; attn_config null is MptAttentionConfig's defaults, its own nulls MPT_ATTN's)
    **dict.fromkeys(("d_model", "n_heads", "n_layers", "max_seq_len", "no_bias"), ("mpt",)),
    "scale_attn_by_inverse_layer_idx": ("gpt2",),
    "add_cross_attention": ("gpt2", "bert", "gpt_bigcode"),
    # (GPTBigCodeConfig types them strictly; its attention reads them, its dropouts too)
    **dict.fromkeys(
        ("multi_query", "attention_softmax_in_fp32", "scale_attention_softmax_in_fp32"),
        ("gpt_bigcode",),
    ),
    **dict.fromkeys(("attn_pdrop", "resid_pdrop"), ("gpt_bigcode",)),
    "is_decoder": ("bert",),
    "rms_norm_eps": tuple(f for f in FAMILIES if f not in _NORM_EPS_FREE),
    "head_dim": tuple(f for f in FAMILIES if f not in _HEAD_DIM_FILLED),
    "num_key_value_heads": (
        *("mistral", "mixtral", "ministral", "starcoder2", "qwen2_moe", "qwen3_moe"),
        *("gemma", "gemma2", "gemma3_text", "exaone4", "gpt_oss", "helium", "glm", "glm4"),
        "vaultgemma",
        *("stablelm", "glm4_moe", "ernie4_5_moe", "minimax_m2", "exaone_moe", "lfm2"),
        "lfm2_moe",
        *("solar_open", "phimoe", "cwm", "hy_v3", "lfm3", "beam"),
        *("stablelm", "glm4_moe_lite", *OUTPUT_GATE),
        *("youtu", "axk1"),  # (typed int, not int | None as DeepSeek-V3's)
        *("jamba", "nemotron_h", "minimax"),
    ),
    "attention_bias": (
        *("deepseek_v2", "deepseek_v3", "glm4_moe_lite", "minicpm3", "youtu", "axk1"),
        *("kimi_linear", "bailing_hybrid"),
        *("llama", "qwen3", "qwen3_moe", "olmo", "olmo2", "olmo3", "olmoe", "smollm3"),
        *("gemma", "gemma2", "gemma3_text", "granite", "granitemoe", "granitemoeshared"),
        *("cohere2", "gpt_oss", "arcee", "seed_oss", "cohere", "helium", "glm", "glm4"),
        *("gpt_neox", "nemotron", "glm4_moe", "apertus", "dots1", "vaultgemma", "solar_open"),
        *("flex_olmo", "hyperclovax", "phimoe", "jais2", "hy_v3", "afmoe", "lfm3", "beam"),
        *("bamba", "nemotron_h", "granitemoehybrid", "olmo_hybrid", "recurrent_gemma"),
        *("gpt_neox", "nemotron", *OUTPUT_GATE),
    ),
    "use_qk_norm": ("glm4_moe",),
    # (typed float: NemotronConfig, Lfm2Config, Lfm2MoeConfig, Lfm3Config reject it)
    "norm_eps": ("nemotron", "lfm2", "lfm2_moe", "lfm3"),
    "use_attention_gate": ("lfm3",),  # (typed bool)
    "rope_scaling": ("beam",),  # (BeamConfig takes it for its rope_parameters: a null fails)
    "use_bias": ("starcoder2", "nemotron_h"),  # (NemotronHConfig's: typed, not read here)
    "rope_interleave": ("glm4_moe_lite",),  # (DeepSeek-V3's takes a null: by halves)
    # (AXK1Config types them int: its attention always takes q through its latent)
    **dict.fromkeys(("q_lora_rank", "v_head_dim"), ("axk1",)),
    "linear_attn_config": ("kimi_linear",),  # (KimiLinearConfig calls .get on it)
    **dict.fromkeys(("attn_layer_period", "attn_layer_offset"), ("jamba",)),
    # (BailingHybridConfig types them strictly: an int, a number; it then sets head_dim to
    # qk_rope_head_dim, whatever config.json says, and reads rope_theta where rope_parameters
    # is null)
    **dict.fromkeys(("layer_group_size", "rope_theta"), ("bailing_hybrid",)),
    "qkv_bias": ("qwen2_moe",),
    "qk_layernorm": ("phi", "stablelm"),
    "use_qkv_bias": ("stablelm",),
    "attention_out_bias": ("seed_oss",),
    "use_sliding_window": ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "smollm3"),
    "max_window_layers": ("qwen2", "qwen3", "qwen2_moe"),
    "query_pre_attn_scalar": ("gemma2", "gemma3_text", "vaultgemma"),
    "attention_multiplier": ("granite", "granitemoe", "granitemoeshared", "granitemoehybrid"),
    "no_rope_layer_interval": ("smollm3",),
    "original_max_position_embeddings": ("phi3",),  # (elsewhere: where RoPE reads it)
    "attention_dropout": ("falcon",),  # (FalconAttention builds nn.Dropout(None): no layer)
}
# Model types that are another family's layer under a name of their own: Kimi K2's
# config.json says kimi_k2 (its code on the Hub is DeepSeek-V3's; Kimi_K25Config reads its
# text model so).
RENAMED = {"kimi_k2": "deepseek_v3"}
# Multimodal families: their language model (text_config, whose model_type is the first
# unless it names one) is served; its tensors are the ones under the scope (not the vision
# tower's).
MULTIMODAL = {
    "gemma3": ("gemma3_text", "language_model"),
    "mistral3": ("mistral", "language_model"),
    "kimi_k25": ("deepseek_v3", "language_model"),  # (its text_config says kimi_k2: RENAMED)
    "qwen3_5": ("qwen3_5_text", "language_model"),
    "qwen3_5_moe": ("qwen3_5_moe_text", "language_model"),
    "gemma3n": ("gemma3n_text", "language_model"),
    "gemma4": ("gemma4_text", "language_model"),
    "gemma4_unified": ("gemma4_unified_text", "language_model"),
    "llama4": ("llama4_text", "language_model"),
}
# Where each rotary family's attention differs from Llama's (transformers 5's
# modeling_<family>.py); a family a table leaves out has Llama's there.
# The q/k/v/o biases: the config.json key that turns them on, or fixed.
BIAS: dict[str, str | bool] = {
    "qwen2": True,
    "qwen2_moe": "qkv_bias",
    "starcoder2": "use_bias",
    "ernie4_5": "use_bias",
    "ernie4_5_moe": "use_bias",
    "phi": True,
    "stablelm": "use_qkv_bias",
    "falcon": "bias",
    **dict.fromkeys(
        ("mistral", "mixtral", "ministral", "phi3", "minimax_m2", "exaone_moe", "lfm2", "cwm"),
        False,
    ),
    "lfm2_moe": False,
    "minimax": False,
    # (JambaAttention and NemotronHAttention build their projections without biases, whatever
    # attention_bias says)
    **dict.fromkeys(("jamba", "nemotron_h"), False),
    **dict.fromkeys(
        ("ministral3",),
        False,
    ),
}
# o_proj's bias where it is not q/k/v's: its key, or fixed (a missing one is served as 0).
O_BIAS: dict[str, str | bool] = {
    "qwen2": False,
    "qwen2_moe": False,
    "seed_oss": "attention_out_bias",
    **dict.fromkeys(("helium", "glm", "glm4", "stablelm", "glm4_moe", "solar_open"), False),
    "recurrent_gemma": True,  # (RecurrentGemmaAttention's o_proj always; q/k/v by attention_bias)
}
# q/k RMSNorm: per head (over head_dim) or over the whole projection (all heads together).
QK_NORM = {
    **dict.fromkeys(("qwen3", "qwen3_moe", "gemma3_text", "exaone4", "glm4_moe"), "head"),
    "exaone_moe": "head",
    **dict.fromkeys(
        ("apertus", "dots1", "lfm2", "lfm2_moe", "hy_v3", "afmoe", "lfm3", "beam"), "head"
    ),
    "nanochat": "head",
    **dict.fromkeys(
        ("olmo2", "olmoe", "olmo3", "minimax_m2", "flex_olmo", "olmo_hybrid"), "projection"
    ),
    **dict.fromkeys(("hunyuan_v1_dense", "hunyuan_v1_moe"), "head"),
    **dict.fromkeys(("qwen3", "qwen3_moe", "gemma3_text", "exaone4", *OUTPUT_GATE), "head"),
    **dict.fromkeys(("olmo2", "olmoe", "olmo3"), "projection"),
}
# Families whose queries are scaled by position (Ministral3Attention's get_llama_4_attn_scale:
# 1 + beta * log(1 + floor(p / original_max_position_embeddings)), the scale rounded to q's
# dtype), beta and the context from the RoPE table (llama_4_scaling_beta).
LLAMA4_SCALING = ("ministral3", "mistral4")
# Families whose q/k norm (QK_NORM's) comes after RoPE, and whether it has gains (nanochat's
# NanoChatRMSNorm has none: x * rsqrt(mean(x^2) + eps) in float32).
QK_NORM_AFTER_ROPE = {"nanochat": False, "hunyuan_v1_dense": True, "hunyuan_v1_moe": True}
# Families whose RoPE table may be "dynamic" with a fixed alpha (Hunyuan v1's NTK alpha:
# theta * alpha ** (head_dim / (head_dim - 2)), frequencies fixed, served as default RoPE).
NTK_ALPHA = ("hunyuan_v1_dense", "hunyuan_v1_moe")
# Families whose RoPE turns the other way (nanochat's rotate_half is [x2, -x1]).
REVERSED_ROPE = ("nanochat",)
# Families whose q/k norm (QK_NORM's) is there only when a config.json key turns it on.
QK_NORM_SWITCH = {"glm4_moe": "use_qk_norm"}
# The key of the q/k norm's eps where it is not rms_norm_eps (Lfm2Config's norm_eps).
QK_NORM_EPS = {"lfm2": "norm_eps", "lfm2_moe": "norm_eps", "lfm3": "norm_eps"}
# The softmax scale: (config key, power) -> value ** power; default head_dim ** -0.5.
SCALE = {
    **dict.fromkeys(("gemma2", "gemma3_text", "vaultgemma"), ("query_pre_attn_scalar", -0.5)),
    **dict.fromkeys(
        ("granite", "granitemoe", "granitemoeshared", "granitemoehybrid", "hyperclovax"),
        ("attention_multiplier", 1),
    ),
}
# Families whose SCALE key may be null or left out: head_dim ** -0.5 then (HyperCLOVAXConfig).
SCALE_OPTIONAL = ("hyperclovax",)
# sliding_window on every layer where it is set (Qwen3-MoE: with use_sliding_window).
WINDOW_EVERY_LAYER = ("mistral", "mixtral", "phi3", "starcoder2", "qwen3_moe", "phimoe")
WINDOW_EVERY_LAYER += ("minimax",)  # (MiniMaxModel: on each of its softmax attention layers)
WINDOW_EVERY_LAYER += (
    "ministral3",
)  # (Ministral3Model: a sliding mask for every layer when the window is set)
# Families whose sliding_window counts only with use_sliding_window (their configs drop it).
WINDOW_SWITCH = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "smollm3")
# Families that read layer_types, and how their configs derive them when config.json has
# none: (cfg, layer) -> whether the layer slides.
DERIVED_SLIDING: dict[str, Callable[[dict[str, Any], int], bool]] = {
    **dict.fromkeys(
        ("qwen2", "qwen3"),
        lambda c, i: window_on(c) and i >= c["max_window_layers"],
    ),
    "qwen2_moe": lambda c, i: bool(
        c.get("use_sliding_window") and (i + 1) % 2 and i < c["max_window_layers"]
    ),
    **dict.fromkeys(
        ("gemma2", "gpt_oss", "vaultgemma"), lambda c, i: bool((i + 1) % 2)
    ),  # local first
    "gemma3_text": lambda c, i: bool((i + 1) % c.get("sliding_window_pattern", 6)),
    "cohere2": lambda c, i: bool((i + 1) % c["sliding_window_pattern"]),
    # (Exaone4Config sets the pattern to 0 without a window: no layer_types to derive)
    **dict.fromkeys(
        ("exaone4", "exaone_moe"),
        lambda c, i: bool(
            (i + 1) % (c["sliding_window_pattern"] if c.get("sliding_window") is not None else 0)
        ),
    ),
    "ministral": lambda c, i: c.get("sliding_window") is not None,
    # (AfmoeConfig: a global layer every global_attn_every_n_layers-th, the others local)
    "afmoe": lambda c, i: bool((i + 1) % c["global_attn_every_n_layers"]),
    # (BeamConfig: every sixth layer global, and the last)
    "beam": lambda c, i: bool((i + 1) % 6) and i != c["num_hidden_layers"] - 1,
    # (Lfm3Config: every fourth layer from the fourth sliding, the third full, the rest conv;
    # HYBRIDS' lfm3 derives its layers: here for _null_window, whose sliding mask fails the
    # whole model, full layers included)
    "lfm3": lambda c, i: i % 4 == 0 and i > 0,
    "olmo3": lambda c, i: bool((i + 1) % 4),  # three local layers, then a global one
    "smollm3": lambda c, i: window_on(c) and not smollm3_rope(c, i),
    "cwm": lambda c, i: i % 4 != 0,  # (CwmConfig: a global layer, then three local ones)
    # (Dots1Config: Qwen2's without use_sliding_window)
    "dots1": lambda c, i: c.get("sliding_window") is not None and i >= c["max_window_layers"],
}
# Layers that apply no RoPE (NoPE): SmolLM3's no_rope_layers, Cohere 2's global layers.
# Families whose attention applies no RoPE on any layer: their configs read no RoPE table
# (its keys are not read, null or not; JambaAttention rotates nothing).
NOPE = ("jamba", "nemotron_h")
# Families whose model builds no rotary embedding where its RoPE theta is null (the table's,
# else rope_theta beside it): NoPE then (OlmoHybridModel; its released checkpoints'), where
# the others' fail on it.
NOPE_BY_NULL_THETA = ("olmo_hybrid",)
NO_ROPE: dict[str, Callable[[dict[str, Any], int, str], bool]] = {
    "smollm3": lambda c, i, kind: not smollm3_rope(c, i),
    "cohere2": lambda c, i, kind: kind == "full_attention",
    **dict.fromkeys(
        ("exaone4", "exaone_moe"),
        lambda c, i, kind: kind == "full_attention" and c.get("sliding_window") is not None,
    ),
    "falcon": lambda c, i, kind: bool(c.get("alibi")),  # (Falcon-RW: ALiBi instead)
    # (GraniteMoeHybridModel builds its rotary embedding only for position_embedding_type
    # "rope"; Granite 4.0's hybrids say "nope")
    "granitemoehybrid": lambda c, i, kind: c.get("position_embedding_type") != "rope",
    "llama4_text": lambda c, i, kind: not llama4_rope(c, i),
    "afmoe": lambda c, i, kind: kind == "full_attention",  # (AfmoeAttention: local layers'
}  # RoPE only)
# Families whose RoPE rotates interleaved pairs (x[0::2], x[1::2]), not the two halves.
INTERLEAVED_ROPE = (
    *("cohere", "cohere2", "helium", "ernie4_5", "ernie4_5_moe", "glm", "glm4"),
    "llama4_text",  # (Llama 4's apply_rotary_emb: pairs as complex numbers)
)
# Families whose RoPE may turn only part of each head (partial_rotary_factor: rope_parameters',
# else config.json's, else this default; transformers' other families rotate every dim).
PARTIAL_ROPE = {
    **{"glm": 0.5, "glm4": 0.5, "gpt_neox": 0.25, "phi": 0.5, "stablelm": 0.25},
    "nemotron": 0.5,
    "glm4_moe": 0.5,  # (Glm4MoeConfig's default, by halves where GLM and GLM-4 interleave)
    "minimax_m2": 1.0,  # (without rotary_dim: PARTIAL_BY_ROTARY_DIM)
    "recurrent_gemma": 0.5,
    "bamba": 0.5,  # (PARTIAL_IN_TABLE_ONLY)
    **dict.fromkeys(OUTPUT_GATE, 0.25),
}
# Families whose config reads a legacy rotary_dim (the dims turned, of head_dim) as the partial
# factor rotary_dim / head_dim where neither rope_parameters nor config.json gives one
# (MiniMaxM2Config: the released MiniMax-M2 checkpoints' 64 of 128).
PARTIAL_BY_ROTARY_DIM = ("minimax_m2",)
# Families whose config reads the factor from the RoPE table only: a partial_rotary_factor
# beside the table is overwritten by their default (BambaConfig hardcodes 0.5 there).
PARTIAL_IN_TABLE_ONLY = ("bamba",)
# Families whose config reads RoPE's theta and partial factor beside the table under other
# names (GPTNeoXConfig: rotary_emb_base, rotary_pct; it ignores config.json's rope_theta and
# partial_rotary_factor there), and whose table takes a null of them as is (no layer built).
ROPE_KEYS = {"gpt_neox": ("rotary_emb_base", "rotary_pct")}
# Families whose attention computes with the factor as the config has it: a null builds no
# layer (GPT-NeoX's config keeps it, Phi's, StableLM's and Nemotron's drop it and their
# attention reads it from the table; GLM's drops it and rotates every dim).
PARTIAL_NOT_NULL = ("gpt_neox", "phi", "stablelm", "nemotron", "recurrent_gemma")
# Families whose attention sizes its heads hidden_size / num_attention_heads whatever head_dim
# says (their rotary embedding reads head_dim: one that differs builds no consistent layer),
# and the families without GQA (num_key_value_heads is not read).
HEADS_BY_HIDDEN = ("gpt_neox", "stablelm", "falcon")
# Families whose rotary embedding takes the default RoPE only (RecurrentGemma's raises on
# any other type).
ROPE_DEFAULT_ONLY = ("recurrent_gemma",)
MHA_ONLY = ("gpt_neox",)
# q/k norms that are LayerNorms (the mean subtracted, then scaled), not the RMSNorm we apply:
# the key that turns them on, refused when set.
LAYERNORM_QK = {"cohere": "use_qk_norm", "phi": "qk_layernorm", "stablelm": "qk_layernorm"}
# Keys a family's config computes (a property without a setter): transformers loads no
# config.json that sets them, null included (FalconConfig: head_dim from hidden_size /
# num_attention_heads, rotary from alibi).
PROPERTIES = {
    "falcon": ("head_dim", "rotary"),
    # (JambaConfig computes its layer kinds from attn_layer_period and attn_layer_offset)
    "jamba": ("layer_types", "layers_block_type"),
    # (RecurrentGemmaConfig computes its layer kinds from block_types)
    "recurrent_gemma": ("layer_types", "layers_block_type"),
    # (BambaConfig: layer_types is its alias of layers_block_type, computed from
    # attn_layer_indices)
    "bamba": ("layer_types", "layers_block_type"),
}
# Keys a family's config reads in place of another when set, not null: {family: {key: the
# key it replaces}} (FalconConfig: n_embed, its old name for hidden_size;
# GPT2Config's and GPTBigCodeConfig's attribute_map: hidden_size, ... beside n_embd, ... win,
# a null one fails there: NOT_NULL's).
ALIASES = {
    "falcon": {"n_embed": "hidden_size"},
    "glm4_moe_lite": {"head_dim": "qk_rope_head_dim"},  # (Glm4MoeLiteConfig's attribute_map)
    "granitemoehybrid": {"layers_block_type": "layer_types"},  # (its attribute_map)
    # (KimiLinearConfig's attribute_map: config.json says model_max_length)
    **dict.fromkeys(
        ("kimi_linear", "bailing_hybrid"), {"model_max_length": "max_position_embeddings"}
    ),
    # (RecurrentGemmaConfig's attribute_map: sliding_window is its name of the window)
    "recurrent_gemma": {"attention_window_size": "sliding_window"},
    "lfm3": {"rms_norm_eps": "norm_eps"},  # (Lfm3Config's attribute_map)
    "mpt": {
        "hidden_size": "d_model",
        "num_attention_heads": "n_heads",
        "num_hidden_layers": "n_layers",
    },
    **dict.fromkeys(
        GPT2_NAMES,
        {
            "hidden_size": "n_embd",
            "num_attention_heads": "n_head",
            "num_hidden_layers": "n_layer",
            "max_position_embeddings": "n_positions",
        },
    ),
}
# MPT's attn_config (a table; null or left out: MptAttentionConfig's defaults, which fill
# the keys it leaves out): the keys whose null MptAttentionConfig rejects (it types them
# strictly), and the values under which transformers' MptAttention and MosaicML's own code
# (trust_remote_code, which trained the checkpoints) compute the same layer; any other value
# is refused (hf_config._mpt says why, per key). attn_impl: MosaicML's three kernels, the
# same math. llm-foundry's keys transformers does not know (rope, qk_gn, fused_qkv,
# sliding_window_size) are refused where they change the layer.
MPT_ATTN_NOT_NULL = (
    *("attn_type", "attn_pdrop", "attn_impl", "prefix_lm", "qk_ln"),
    *("attn_uses_sequence_id", "alibi", "alibi_bias_max"),
)
MPT_ATTN_DEFAULTS: dict[str, Any] = {
    "attn_type": "multihead_attention",
    "attn_impl": "torch",
    "clip_qkv": None,
    "softmax_scale": None,
    "prefix_lm": False,
    "qk_ln": False,
    "alibi": True,
    "alibi_bias_max": 8,
}
MPT_ATTN_IMPLS = ("torch", "flash", "triton")
# Families refused whole, and why (the attention differs from every family above).
UNSERVED = {
    "deepseek_v32": "sparse attention: a lightning indexer picks each query's top-k keys",
    "glm_moe_dsa": "sparse attention: a lightning indexer picks each query's top-k keys",
    "deepseek_v4": "one shared K/V head whose output is rotated back, compressed caches per "
    "layer type",
    "longcat_flash": "two attention modules per decoder layer (self_attn.0 and .1), which a "
    "layer index does not name",
    # MLA beside something the module does not compute (transformers 5.23's classes)
    "axk2": "sparse attention: a lightning indexer picks each query's top-k keys (as "
    "DeepSeek-V3.2's), and its q_gate_proj reads [q_a_layernorm(q_a); q_a] for the queries "
    "and an output gate",
    "hy_v4": "sparse attention: a lightning indexer picks each query's top-k keys, with an "
    "output gate (gate_proj), attention sinks and hyper-connections around the layer",
    **dict.fromkeys(
        ("dots3_note", "dots3_note_text"),
        "an RMSNorm on the shared RoPE key (k_rope_only_layernorm), a per-head output gate "
        "(g_proj) and a lightning indexer on its indexed_attention layers",
    ),
    "mimo_v2_flash": "no MLA: v heads of v_head_dim (128) beside q/k heads of head_dim (192), "
    "which the module's one head_dim does not hold, values scaled by attention_value_scale, "
    "and sliding layers with twice the KV heads and attention sinks",
    "persimmon": "its q/k norm is a LayerNorm (qk_layernorm, on by default and in Persimmon-8B)",
    # output gates the module's (sigmoid(W x) before o_proj: OUTPUT_GATE, OWN_GATE) is not
    **dict.fromkeys(
        ("qwen4_exp", "qwen4_exp_text"),
        "sparse attention: its QSA indexer picks each query's key blocks (indexer_budget "
        "tokens), beside an output gate from q_proj's rows as Qwen3.5's and hyper-connections "
        "around the layer",
    ),
    "laguna": "its output gate is softplus(g_proj(x)), not a sigmoid (unbounded, where the "
    "module's gate is in (0, 1)), and its head count varies by layer "
    "(num_attention_heads_per_layer)",
    "hrm_text": "its layers are two stacks run recurrently (L_module and H_module, each "
    "num_layers_per_stack layers), which a layer index does not name, and with prefix_lm "
    "(the default) its prompt tokens attend bidirectionally; its gate (sigmoid(gate_proj(x)) "
    "per dim) would be the module's",
    "diffllama": "differential attention (two softmax maps subtracted, weighted by lambda)",
    "bitnet": "an RMSNorm on the attention output before o_proj (attn_sub_norm), and "
    "ternary-quantized projections",
    "doge": "a dynamic mask computed from its values (dt_proj, A) is added to the scores",
    "jetmoe": "a mixture of attention heads (per-token expert query and output projections)",
    # hybrids whose attention is no layer of its own (the others are HYBRIDS': served)
    "falcon_h1": "hybrid: every layer runs attention and Mamba-2 side by side, with its own "
    "multipliers (key_multiplier, attention_in_multiplier, attention_out_multiplier)",
    **dict.fromkeys(
        ("zamba", "zamba2"),
        "a shared attention block over the hidden states and the original embeddings "
        "concatenated (2 x hidden_size), between Mamba layers",
    ),
}
# Families with a RoPE table per layer type, and how their configs fill the tables of a
# transformers 4 config.json (rope_theta + rope_scaling, the global layers' only): (global
# theta default, the local layers' theta key (None: the default only), its default).
PER_TYPE_ROPE = {
    "gemma3_text": (1_000_000.0, "rope_local_base_freq", 10_000.0),
    "gemma3n_text": (1_000_000.0, "rope_local_base_freq", 10_000.0),  # (Gemma 4's: hf_gemma)
    "olmo3": (500_000.0, None, 500_000.0),
    **dict.fromkeys(("lfm3", "beam"), (1_000_000.0, None, 1_000_000.0)),  # (OWN_ROPE_TABLES')
}
# Families whose tables per layer type are their config class's alone (Lfm3Config,
# BeamConfig): where config.json has none (rope_parameters null or left out), these; a table
# without rope_theta takes the theta here (its default_theta; None: no layer is built);
# rope_theta and rope_scaling beside them are not read (a partial_rotary_factor beside them
# is, moved into a table without one). A null table: NOPE_TABLE's.
OWN_ROPE_TABLES: dict[str, tuple[dict[str, dict[str, Any] | None], float | None]] = {
    "lfm3": (
        {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {
                "rope_type": "proportional",
                "rope_theta": 1_000_000.0,
                "partial_rotary_factor": 0.5,
            },
        },
        1_000_000.0,
    ),
    "beam": (
        {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": None,
        },
        None,
    ),
}
# What a layer type whose RoPE table is null computes, refused (BeamModel: no RoPE, and its
# queries scaled by position).
NOPE_TABLE = {
    "beam": "no RoPE, and its queries scaled by position, (1 + (position + 1) / 2048) ** 0.1 "
    "(BeamModel's scalable softmax), which the module does not compute",
}
# A family's RoPE table when config.json sets neither rope_parameters nor rope_scaling (its
# config class fills it in; a rope_theta beside it counts only where the table has none).
DEFAULT_ROPE: dict[str, dict[str, Any]] = {
    "gpt_oss": {  # (GptOssConfig's; theta: rope_theta, 150000 by default)
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    },
    "mistral4": {  # (Mistral4Config's; its partial_rotary_factor: the rope dims' share)
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 128.0,
        "original_max_position_embeddings": 8192,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale_all_dim": 1.0,
        "mscale": 1.0,
        "llama_4_scaling_beta": 0.1,
    },
    "ministral3": {  # (Ministral3Config's, its query scale's beta and context included)
        "rope_type": "yarn",
        "rope_theta": 1_000_000.0,
        "factor": 16.0,
        "original_max_position_embeddings": 16384,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale_all_dim": 1.0,
        "mscale": 1.0,
        "llama_4_scaling_beta": 0.1,
    },
    "cwm": {  # (CwmConfig's, theta included: a rope_theta beside it is ignored)
        "rope_type": "llama3",
        "rope_theta": 1_000_000.0,
        "factor": 16.0,
        "original_max_position_embeddings": 8192,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
    },
    "apertus": {  # (ApertusConfig's, theta included: a rope_theta beside it is ignored)
        "rope_type": "llama3",
        "rope_theta": 12_000_000.0,
        "factor": 8.0,
        "original_max_position_embeddings": 8192,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
    },
}
# RoPE types with a pretraining context (original_max_position_embeddings).
SCALED_CONTEXT = ("llama3", "yarn")


def window_on(cfg: dict[str, Any]) -> bool:
    return bool(cfg.get("use_sliding_window")) and cfg.get("sliding_window") is not None


def gated_layer(cfg: dict[str, Any], layer: int) -> str:
    """A gated family's layer kind without layer_types, as Qwen3NextConfig derives it."""
    interval = cfg.get("full_attention_interval", FULL_ATTENTION_INTERVAL)
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
        raise ValueError(
            f"full_attention_interval must be a positive int (every full_attention_interval-th "
            f"layer is full attention), got {interval!r}"
        )
    return "linear_attention" if (layer + 1) % interval else "full_attention"


def jamba_layer(cfg: dict[str, Any], layer: int) -> str:
    """Jamba's layer kind, as JambaConfig derives it (it validates offset < period)."""
    period, offset = cfg["attn_layer_period"], cfg["attn_layer_offset"]
    for key, value in (("attn_layer_period", period), ("attn_layer_offset", offset)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise TypeError(f"{key} must be an int, got {value!r}")
    if offset >= period:
        raise ValueError(
            f"attn_layer_offset {offset} must be smaller than attn_layer_period {period} "
            "(JambaConfig loads no config otherwise)"
        )
    return "full_attention" if layer % period == offset else "linear_attention"


# NemotronHConfig's hybrid_override_pattern letters, and the kinds it validates.
NEMOTRON_H_PATTERN = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}


def nemotron_h_kinds(cfg: dict[str, Any]) -> list[str]:
    """Nemotron-H's layer kinds as NemotronHConfig reads them (legacy names remapped); it
    loads no config whose kinds are not all of NEMOTRON_H_PATTERN's."""
    kinds = cfg.get("layer_types") or cfg.get("layers_block_type")
    if kinds is None and "hybrid_override_pattern" in cfg:
        pattern = cfg["hybrid_override_pattern"]
        if not isinstance(pattern, str) or not set(pattern) <= set(NEMOTRON_H_PATTERN):
            raise ValueError(
                f"hybrid_override_pattern must be a string of {''.join(NEMOTRON_H_PATTERN)}, "
                f"got {pattern!r}"
            )
        kinds = [NEMOTRON_H_PATTERN[c] for c in pattern]
    if kinds is None:
        kinds = ["linear_attention", "moe", "full_attention", "mlp"]
    if not isinstance(kinds, list):
        raise TypeError(f"layers_block_type must be a list, got {kinds!r}")
    kinds = [LEGACY_LAYER_TYPES.get(k, k) if isinstance(k, str) else k for k in kinds]
    wrong = [k for k in kinds if k not in NEMOTRON_H_PATTERN.values()]
    if wrong:
        raise ValueError(
            f"layers_block_type has {wrong[0]!r}, not one of "
            f"{', '.join(NEMOTRON_H_PATTERN.values())} (NemotronHConfig loads no such config)"
        )
    return kinds


def kimi_linear_layer(cfg: dict[str, Any], layer: int) -> str | None:
    """Kimi Linear's layer kind without layer_types, as KimiLinearConfig derives it."""
    table = cfg.get("linear_attn_config", {})
    if not isinstance(table, dict):  # (hf_config._hybrid_layer refuses it, as its config)
        raise TypeError(f"linear_attn_config must be a table, got {table!r}")
    if "full_attn_layers" in table and "kda_layers" in table:
        if layer + 1 in table["kda_layers"]:  # (assigned after full_attn_layers: it wins)
            return "linear_attention"
        return "full_attention" if layer + 1 in table["full_attn_layers"] else None
    return "full_attention" if layer and layer % 4 == 0 else "linear_attention"


def bailing_hybrid_layer(cfg: dict[str, Any], layer: int) -> str:
    """Ling 3.0's layer kind without layer_types, as BailingHybridConfig derives it: every
    layer_group_size-th layer is MLA (full_attention), the others KDA (linear_attention)."""
    size = cfg.get("layer_group_size")
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:  # (its config fails)
        raise TypeError(f"layer_group_size must be a positive int, got {size!r}")
    return "full_attention" if (layer + 1) % size == 0 else "linear_attention"


def smollm3_rope(cfg: dict[str, Any], layer: int) -> bool:
    """Whether SmolLM3's layer applies RoPE: no_rope_layers (1: RoPE), else every
    no_rope_layer_interval-th layer has none (SmolLM3Config; both checked in hf_config._rotary)."""
    flags = cfg.get("no_rope_layers")
    if flags is None:
        return (layer + 1) % cfg["no_rope_layer_interval"] != 0
    return bool(flags[layer])


def llama4_rope(cfg: dict[str, Any], layer: int) -> bool:
    """Whether Llama 4's layer applies RoPE: no_rope_layers (1: RoPE; empty or left out: every
    no_rope_layer_interval-th layer has none), as Llama4TextConfig derives it (hf_config
    checks both)."""
    flags = cfg.get("no_rope_layers")
    if not flags:
        return (layer + 1) % cfg["no_rope_layer_interval"] != 0
    return bool(flags[layer])
