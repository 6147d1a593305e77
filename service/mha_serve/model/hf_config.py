"""Which attention a Hugging Face model directory holds: its config.json read into an
AttentionConfig for one layer, with every option we cannot serve exactly refused by name.
No torch here (config files are checked before torch loads); hf.py maps the weights."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .config import AttentionConfig, MLAConfig, QKNormConfig, QueryScaleConfig, RopeConfig
from .hf_families import (
    ALIASES,
    ALL,
    BIAS,
    CODEGEN_GROUPS,
    DEFAULT_ROPE,
    DEFAULTS,
    DERIVED_SLIDING,
    FAMILIES,
    GPT2_NAMES,
    HEADS_BY_HIDDEN,
    HYBRIDS,
    LAYER_TYPES,
    LAYERNORM_QK,
    LEGACY_LAYER_TYPES,
    LLAMA4_SCALING,
    MHA_ONLY,
    MLA,
    MLA_INTERLEAVE_KEY,
    MLA_INTERLEAVED,
    MLA_NOPE,
    MLA_Q_PROJ,
    MPT_ATTN_DEFAULTS,
    MPT_ATTN_IMPLS,
    MPT_ATTN_NOT_NULL,
    MULTIMODAL,
    NO_ROPE,
    NOPE,
    NOPE_BY_NULL_THETA,
    NOT_NULL,
    O_BIAS,
    OUTPUT_GATE,
    OWN_GATE,
    OWN_GATE_SWITCH,
    PARTIAL_ROPE,
    PROPERTIES,
    QK_NORM,
    QK_NORM_AFTER_ROPE,
    QK_NORM_EPS,
    QK_NORM_SWITCH,
    RENAMED,
    REQUIRED,
    ROTARY,
    SCALE,
    SCALE_OPTIONAL,
    SCALED_CONTEXT,
    UNSERVED,
    WINDOW_EVERY_LAYER,
    WINDOW_SWITCH,
    window_on,
)
from .hf_gemma import GEMMA_V_NORM, gemma_layer
from .hf_rope import check_rope_nulls, read_rope, refuse_null, refuse_partial


@dataclass(frozen=True)
class HFLayer:
    """One layer's attention of a Hugging Face checkpoint, as we serve it."""

    directory: Path
    family: str  # config.json model_type, one of FAMILIES
    layer: int
    num_layers: int
    attention: AttentionConfig
    # The model's context (max_position_embeddings; None when config.json has none): the
    # longest sequence it was trained for, whatever its sliding window.
    max_position_embeddings: int | None = None
    # Where the layer's tensors are in a multimodal checkpoint ("language_model" for Gemma
    # 3's text model beside its vision tower); "" for any prefix.
    tensor_scope: str = ""
    # Projections whose bias the checkpoint has none of while others have ("o": Qwen2's
    # o_proj): served as a zero bias.
    zero_biases: tuple[str, ...] = ()
    # Values from the keys' projection (Gemma 4's attention_k_eq_v, global layers: no v_proj,
    # v = v_norm(k_proj(x))): k_proj's rows are served as the value rows too.
    values_from_keys: bool = False

    @property
    def sliding_window(self) -> int | None:
        return self.attention.sliding_window


def is_hf_directory(path: str | Path) -> bool:
    return Path(path).is_dir()


def read_hf_layer(directory: str | Path, layer: int | None) -> HFLayer:
    """Parses DIR/config.json for layer `layer`; ValueError naming what is not served."""
    directory = Path(directory)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ValueError(
            f"checkpoint directory {directory} has no config.json: a Hugging Face model "
            "directory (config.json and *.safetensors) is expected"
        )
    try:
        cfg = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{config_path} is not valid JSON: {e}") from None
    family = cfg.get("model_type")
    if family in RENAMED:  # (Kimi K2: DeepSeek-V3's layer under a name of its own)
        cfg["model_type"] = family = RENAMED[family]
    scope = ""
    if family in MULTIMODAL:  # the multimodal model: its text model's config, tensors
        text = cfg.get("text_config")
        if not isinstance(text, dict):
            raise ValueError(f"{config_path}: {family} has no text_config table")
        arch = cfg.get("architectures")
        cfg, scope = {"model_type": MULTIMODAL[family][0], **text}, MULTIMODAL[family][1]
        cfg["model_type"] = RENAMED.get(cfg["model_type"], cfg["model_type"])
        cfg.setdefault("architectures", arch)
    kind = cfg.get("model_type")  # the family whose attention is served
    for name in dict.fromkeys((family, kind)):
        if name not in FAMILIES or (name != family and name in MULTIMODAL):
            arch = ", ".join(cfg.get("architectures") or []) or "?"
            why = f" ({UNSERVED[name]})" if name in UNSERVED else ""
            raise ValueError(
                f"{config_path}: model_type {name!r} (architectures {arch}) is not supported"
                f"{why}; supported: {', '.join(FAMILIES)}"
            )
    cfg = {**DEFAULTS.get(kind, {}), **cfg}  # a null stays null
    for key, why in REQUIRED.get(kind, {}).items():
        if cfg.get(key) is None:
            raise ValueError(
                f"{config_path}: {kind} config.json has no {key} (or it is null): {why}; "
                f"set {key} to the checkpoint's"
            )
    for key in PROPERTIES.get(kind, ()):
        if key in cfg:
            raise ValueError(
                f"{config_path}: {kind} config.json sets {key} ({cfg[key]!r}), which "
                f"transformers' {kind} config computes and refuses to load; leave {key} out"
            )
    for key, families in NOT_NULL.items():
        if key in cfg and cfg[key] is None and (families == ALL or kind in families):
            refuse_null(where=config_path, family=kind, key=key)
    for alias, key in ALIASES.get(kind, {}).items():
        if cfg.get(alias) is not None:
            cfg[key] = cfg[alias]
    if kind in HYBRIDS and HYBRIDS[kind].count is not None:  # (Nemotron-H's, from its kinds)
        cfg["num_hidden_layers"] = _hybrid_call(HYBRIDS[kind].count, cfg, kind, config_path)
    gpt2_names = family in GPT2_NAMES
    layers_key = "num_hidden_layers"
    if gpt2_names or (family == "bloom" and layers_key not in cfg):  # (BloomConfig:
        layers_key = "n_layer"  # num_hidden_layers is its alias of n_layer, and wins)
    elif family == "mpt":  # (ALIASES: num_hidden_layers, where set, is copied in)
        layers_key = "n_layers"
    num_layers = _int(cfg, layers_key, config_path)
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < num_layers:
        raise ValueError(
            f"{config_path}: layer must be an int in 0..{num_layers - 1} ({family} with "
            f"{num_layers} layers), got {layer!r}; set layer = N in the [[models]] table "
            "(--layer N for the convert command)"
        )
    values_from_keys = False
    if family == "bert":
        attention = _bert(cfg, config_path)
    elif family in ("gptj", "codegen"):
        attention = _gptj(cfg, family, config_path)
    elif gpt2_names:
        attention = _gpt2(cfg, family, layer, config_path)
    elif family == "bloom":
        attention = _bloom(cfg, config_path)
    elif family == "mpt":
        attention = _mpt(cfg, config_path)
    elif kind in MLA:
        attention = _mla(cfg, kind, layer, config_path)
    elif kind in GEMMA_V_NORM:
        attention, values_from_keys = gemma_layer(cfg, kind, layer, config_path)
    else:
        attention = _rotary(cfg, kind, layer, config_path)
    context_key = "max_position_embeddings"
    if gpt2_names:
        context_key = "n_positions"
    elif family == "mpt":  # (MptModel's ALiBi tensor covers max_seq_len keys, no more)
        context_key = "max_seq_len"
    context = cfg.get(context_key)
    context = context if isinstance(context, int) and not isinstance(context, bool) else None
    zero = ()  # the projections whose bias the checkpoint has none of
    if family in ROTARY and attention.bias:
        qkv, o = _biases(cfg, kind)
        zero = (() if qkv else ("q", "k", "v")) + (() if o else ("o",))
    return HFLayer(
        directory,
        family,
        layer,
        num_layers,
        attention,
        context,
        scope,
        zero,
        values_from_keys=kind in GEMMA_V_NORM and values_from_keys,
    )


def _bert(cfg: dict[str, Any], where: Path) -> AttentionConfig:
    # (null: transformers adds no relative-position scores for it either)
    kind = cfg.get("position_embedding_type") or "absolute"
    if kind != "absolute":
        raise ValueError(
            f"{where}: BERT position_embedding_type {kind!r} is not supported (its attention "
            "adds relative-position scores); only 'absolute' is served"
        )
    if cfg.get("add_cross_attention"):
        raise ValueError(
            f"{where}: BERT add_cross_attention is not supported (self-attention only)"
        )
    E, H = _int(cfg, "hidden_size", where), _int(cfg, "num_attention_heads", where)
    return AttentionConfig(E, H, bias=True, causal=bool(cfg.get("is_decoder", False)))


def _gpt2(cfg: dict[str, Any], family: str, layer: int, where: Path) -> AttentionConfig:
    """GPT-2 and GPT-BigCode (StarCoder 1, SantaCoder): positions are added before the layer,
    none inside it; GPT-BigCode has one KV head with multi_query (default true). Its
    attention_softmax_in_fp32 and scale_attention_softmax_in_fp32 change no math (transformers
    5 softmaxes in float32 whatever they say): not read."""
    if cfg.get("add_cross_attention"):
        raise ValueError(
            f"{where}: {family} add_cross_attention is not supported (self-attention only)"
        )
    E, H = _int(cfg, "n_embd", where), _int(cfg, "n_head", where)
    KVH = 1 if family == "gpt_bigcode" and cfg["multi_query"] else H
    scale = (E // H) ** -0.5 if cfg.get("scale_attn_weights", True) else 1.0
    if family == "gpt2" and cfg.get("scale_attn_by_inverse_layer_idx", False):
        scale /= float(layer + 1)  # as GPT2Attention: scaling /= layer_idx + 1
    try:
        return AttentionConfig(E, H, KVH, bias=True, causal=True, softmax_scale=scale)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def _whole_heads(E: int, H: int, keys: tuple[str, str], attention: str, where: Path) -> None:
    """ValueError unless E splits into H whole heads: `attention` (transformers') sizes its
    heads E / H (keys: the config's names of E and H) and builds no layer otherwise."""
    if E % H:
        raise ValueError(
            f"{where}: {keys[0]} {E} is not divisible by {keys[1]} {H} (transformers' "
            f"{attention} sizes its heads {keys[0]} / {keys[1]} and builds no layer otherwise)"
        )


def _bloom(cfg: dict[str, Any], where: Path) -> AttentionConfig:
    """BloomAttention: MHA over heads of hidden_size / n_head, causal, biases always, scores
    1 / sqrt(head_dim) q . k plus ALiBi (build_alibi_tensor's slopes), no RoPE. BloomConfig's
    names: n_embed wins over hidden_size unless null; num_attention_heads is its alias of
    n_head and wins where present."""
    E = _int(cfg, "n_embed" if cfg.get("n_embed") is not None else "hidden_size", where)
    H = _int(cfg, "num_attention_heads" if "num_attention_heads" in cfg else "n_head", where)
    _whole_heads(E, H, ("hidden_size", "n_head"), "BloomAttention", where)
    tp = cfg.get("pretraining_tp", 1)
    if cfg.get("slow_but_exact", False) and not (isinstance(tp, int) and tp <= 1):
        raise ValueError(
            f"{where}: bloom slow_but_exact with pretraining_tp {tp} is not supported: "
            "transformers' BloomAttention then sums dense's slices without dense's bias; set "
            "slow_but_exact false (the same layer, with its bias)"
        )
    return AttentionConfig(E, H, bias=True, causal=True, alibi=True)


def _gptj(cfg: dict[str, Any], family: str, where: Path) -> AttentionConfig:
    """GPTJAttention (CodeGenAttention: the same with one qkv_proj): q/k/v/out_proj without
    biases, MHA, heads of n_embd / n_head; RoPE by interleaved pairs (rotate_every_two) over
    the first rotary_dim dims of each head, theta 10000 (fixed: their configs read no
    rope_theta nor RoPE table), frequencies over those dims; scores divided by sqrt(head_dim)."""
    E, H = _int(cfg, "n_embd", where), _int(cfg, "n_head", where)
    _whole_heads(E, H, ("n_embd", "n_head"), family, where)
    if family == "codegen" and H % CODEGEN_GROUPS:
        raise ValueError(
            f"{where}: codegen n_head {H} is not a multiple of {CODEGEN_GROUPS}: "
            f"CodeGenAttention splits qkv_proj into {CODEGEN_GROUPS} groups of whole heads "
            "(its mp_num) and fails otherwise"
        )
    D, turned = E // H, cfg["rotary_dim"]
    if isinstance(turned, bool) or not isinstance(turned, int) or not 2 <= turned <= D:
        raise ValueError(
            f"{where}: {family} rotary_dim must be an int from 2 to head_dim {D}, got "
            f"{turned!r} (its attention rotates the first rotary_dim dims of each head)"
        )
    if turned % 2:
        raise ValueError(
            f"{where}: {family} rotary_dim {turned} is odd: its attention rotates dims by "
            "pairs (its sin and cos cover rotary_dim + 1 dims and no layer runs)"
        )
    partial = turned / D
    while int(D * partial) < turned:  # (AttentionConfig turns int(head_dim * partial) dims)
        partial = math.nextafter(partial, 2.0)
    rope = RopeConfig(theta=10_000.0, interleaved=True, partial=partial)
    return AttentionConfig(E, H, bias=False, causal=True, rope=rope)


def _mpt(cfg: dict[str, Any], where: Path) -> AttentionConfig:
    """MptAttention (MPT-7B, 30B): MHA over heads of d_model / n_heads, causal, no biases,
    scores softmax_scale (null: 1 / sqrt(head_dim)) q . k plus ALiBi (build_mpt_alibi_tensor,
    bias_max 8), no RoPE. What transformers' MptAttention and MosaicML's own code would
    compute differently from one config.json is refused, naming the key (MPT_ATTN_*)."""
    E, H = _int(cfg, "d_model", where), _int(cfg, "n_heads", where)
    _whole_heads(E, H, ("d_model", "n_heads"), "MptAttention", where)
    attn = cfg.get("attn_config")
    attn = {} if attn is None else attn
    if not isinstance(attn, dict):
        raise ValueError(f"{where}: mpt attn_config must be a table, got {attn!r}")
    for key in MPT_ATTN_NOT_NULL:
        if key in attn and attn[key] is None:
            refuse_null(where, "mpt", f"attn_config.{key}")
    attn = {**MPT_ATTN_DEFAULTS, **attn}

    def refuse(key: str, why: str) -> None:
        raise ValueError(f"{where}: mpt attn_config.{key} {attn[key]!r} is not supported: {why}")

    if not cfg.get("no_bias", True):
        raise ValueError(
            f"{where}: mpt no_bias false is not supported: transformers' MptAttention builds "
            "Wqkv and out_proj without biases whatever no_bias says (it drops a checkpoint's "
            "biases) where MosaicML's code adds them"
        )
    if attn["attn_type"] != "multihead_attention":
        refuse("attn_type", "transformers' MptAttention is multi-head whatever it says")
    if attn["alibi"] is not True:
        refuse(
            "alibi",
            "transformers' MptModel applies ALiBi whatever it says, MosaicML's code "
            "learned positions instead",
        )
    if attn["alibi_bias_max"] != 8:
        refuse(
            "alibi_bias_max",
            "transformers' MptModel builds its ALiBi with bias_max 8 whatever it says, "
            "MosaicML's code with this one",
        )
    if attn["qk_ln"]:
        refuse(
            "qk_ln",
            "MosaicML's code applies a LayerNorm to q and k, transformers' MptAttention none",
        )
    if attn["prefix_lm"]:
        refuse("prefix_lm", "its prefix attends bidirectionally; mha-serve serves causal only")
    if attn["clip_qkv"] is not None:
        refuse("clip_qkv", "the projections clamped to +-clip_qkv, which mha-serve does not")
    if attn["attn_impl"] not in MPT_ATTN_IMPLS:
        refuse("attn_impl", f"MosaicML's code knows {', '.join(MPT_ATTN_IMPLS)} (the same math)")
    for key, default in (("rope", False), ("qk_gn", False), ("fused_qkv", True)):
        if attn.get(key, default) != default:
            refuse(key, "an llm-foundry option transformers' MptAttention does not apply")
    if attn.get("sliding_window_size", -1) not in (-1, None):
        refuse("sliding_window_size", "transformers' MptAttention has no sliding window")
    scale = attn["softmax_scale"]
    if scale is not None:
        scale = _number({"attn_config.softmax_scale": scale}, "attn_config.softmax_scale", where)
    return AttentionConfig(E, H, bias=False, causal=True, softmax_scale=scale, alibi=True)


def _rotary(cfg: dict[str, Any], family: str, layer: int, where: Path) -> AttentionConfig:
    """Llama and its descendants: each family's options read into the one AttentionConfig
    (transformers 5's modeling_<family>.py says where each applies)."""
    E, H = _int(cfg, "hidden_size", where), _int(cfg, "num_attention_heads", where)
    KVH = H if family in MHA_ONLY else cfg.get("num_key_value_heads") or H
    if family == "falcon":
        KVH = _falcon_kv_heads(cfg, H, where)
    D = cfg.get("head_dim") or E // H
    if family in HEADS_BY_HIDDEN:
        _whole_heads(E, H, ("hidden_size", "num_attention_heads"), family, where)
    if family in HEADS_BY_HIDDEN and D != E // H:
        raise ValueError(
            f"{where}: {family} head_dim {D} is not supported: transformers' {family} sizes its "
            f"heads hidden_size / num_attention_heads ({E // H}) but its rotary embedding reads "
            "head_dim; leave head_dim out"
        )
    bias = any(_biases(cfg, family))
    if _own_gate(cfg, family) and OWN_GATE[family][2] is not None:  # (Beam's gate_bias: its
        bias = True  # projections take zero biases where they have none)
    rotates = family not in NOPE  # (NOPE: no RoPE key is read)
    if family in NOPE_BY_NULL_THETA and _null_theta(cfg):
        rotates = False
    partial = cfg.get("partial_rotary_factor")
    # (refused below, once the layer's table is known: a proportional one takes it in)
    partial_beside = rotates and family not in PARTIAL_ROPE and partial not in (None, 1, 1.0)
    if family in LAYERNORM_QK and cfg.get(LAYERNORM_QK[family]):
        raise ValueError(
            f"{where}: {family} {LAYERNORM_QK[family]} true is not supported: its q/k norm is a "
            "LayerNorm (the mean subtracted, then scaled), not the RMSNorm mha-serve applies"
        )
    for key in ("use_bidirectional_attention", "attention_chunk_size", "clip_qkv"):
        if cfg.get(key) and not (family == "llama4_text" and key == "attention_chunk_size"):
            raise ValueError(f"{where}: {family} {key} {cfg[key]!r} is not supported")
    if family == "llama4_text":
        _llama4_flags(cfg, where)
    if family == "smollm3":
        _int(cfg, "no_rope_layer_interval", where)
        flags = cfg.get("no_rope_layers")
        if flags is not None and (
            not isinstance(flags, list) or len(flags) != cfg["num_hidden_layers"]
        ):
            raise ValueError(f"{where}: no_rope_layers must list one 0 or 1 per layer")
    if rotates:
        check_rope_nulls(cfg, family, where)
    _null_window(cfg, family, where)
    layer_type = _layer_type(cfg, family, layer, where)
    sliding = None
    if layer_type == "sliding_attention":
        sliding = cfg.get("sliding_window")
        if family in WINDOW_SWITCH and not cfg.get("use_sliding_window"):
            sliding = None  # as the family's config: no window without the switch
        if not sliding:  # (Qwen2-MoE's config reads a window off as 0)
            raise ValueError(
                f"{where}: layer {layer} is a sliding_attention layer but sliding_window is not "
                f"set{' (or use_sliding_window is off)' if family in WINDOW_SWITCH else ''}"
            )
    rope = None
    nope = NO_ROPE.get(family)
    if rotates and (nope is None or not nope(cfg, layer, layer_type)):
        rope = read_rope(cfg, layer_type, where)
    if partial_beside and (rope is None or rope.type != "proportional"):
        refuse_partial(where, family, "partial_rotary_factor", partial)
    qk_norm = None
    switch = QK_NORM_SWITCH.get(family)  # (GLM-4-MoE's use_qk_norm: off by default)
    if family in QK_NORM and (switch is None or cfg.get(switch)):
        # before RoPE; per head, or over the whole projection
        eps = cfg.get(QK_NORM_EPS.get(family, "rms_norm_eps"), 1e-6)
        after = family in QK_NORM_AFTER_ROPE  # (nanochat's, Hunyuan v1's: after RoPE)
        qk_norm = QKNormConfig(
            QK_NORM[family], eps, after_rope=after, gain=QK_NORM_AFTER_ROPE.get(family, True)
        )
    scale = softcap = None
    if family in SCALE and not (family in SCALE_OPTIONAL and cfg.get(SCALE[family][0]) is None):
        key, power = SCALE[family]
        scale = float(_number(cfg, key, where)) ** power
    if family in ("gemma2", "gemma3_text", "vaultgemma"):
        softcap = cfg.get("attn_logit_softcapping")
        if family == "gemma3_text" and softcap is not None:
            raise ValueError(
                f"{where}: gemma3 attn_logit_softcapping {softcap!r} is not supported: "
                "transformers' Gemma3Attention does not apply it (set it to null to serve "
                "the layer as transformers runs it)"
            )
    # Falcon-RW (alibi, no RoPE: NO_ROPE): FalconAttention adds build_alibi_tensor's bias,
    # bfloat16(slope) * position in bfloat16, to q . k and scales both by 1 / sqrt(head_dim)
    alibi = family == "falcon" and bool(cfg.get("alibi"))
    alibi_form = {"alibi_scale": D**-0.5, "alibi_bfloat16": True} if alibi else {}
    query_scale = chunk = None
    if family in LLAMA4_SCALING:
        query_scale = _llama4_scaling(cfg, family, rope, where)
    if family == "llama4_text":
        qk_norm, query_scale, chunk = _llama4_text(cfg, layer, rope, where)
    try:
        return AttentionConfig(
            E,
            H,
            KVH,
            D,
            bias=bias,
            causal=True,
            rope=rope,
            softmax_scale=scale,
            sliding_window=sliding,
            qk_norm=qk_norm,
            softcap=softcap,
            sinks=family == "gpt_oss",  # GptOssAttention's sinks: a logit per query head
            alibi=alibi,
            **alibi_form,
            # Qwen3-Next's: sigmoid(gate) * the heads' output; AFMoE's from a gate_proj
            output_gate=family in OUTPUT_GATE or _own_gate(cfg, family),
            output_gate_per_head=_own_gate(cfg, family) and OWN_GATE[family][1],
            query_scale=query_scale,
            chunk_size=chunk,
        )
    except ValueError as e:
        raise ValueError(f"{where}: layer {layer}: {e}") from None


def _mla(cfg: dict[str, Any], family: str, layer: int, where: Path) -> AttentionConfig:
    """Multi-head latent attention as DeepseekV2Attention, DeepseekV3Attention,
    Glm4MoeLiteAttention and MiniCPM3Attention compute it (transformers 5.23; YoutuAttention
    and AXK1Attention are DeepseekV3Attention's, A.X-K1's always with q_lora_rank;
    KimiLinearAttention's rotates nothing, MLA_NOPE, on its full_attention layers): q from
    q_b_proj(RMSNorm(q_a_proj(x))) (q_proj(x) with q_lora_rank null), K and V from one
    latent per token, kv_a_proj_with_mqa's first kv_lora_rank values, RMS-normed and
    expanded per head by kv_b_proj; qk_rope_head_dim more values of it, rotated, shared by
    every head's key. Served as the module's MLA (config.MLAConfig): an MQA layer over that
    latent, the same dot products."""
    E, H = _int(cfg, "hidden_size", where), _int(cfg, "num_attention_heads", where)
    # (its attention expands the latent to H heads of K and V, then repeats them H // KVH
    # times as GQA's: any repeat but one leaves H * (H // KVH) heads, no layer; H // KVH = 0,
    # its config's default KVH 128 beside fewer heads, SDPA skips and its eager path fails on)
    kvh = cfg.get("num_key_value_heads")
    if kvh is not None and (
        isinstance(kvh, bool) or not isinstance(kvh, int) or kvh < 1 or H // kvh > 1
    ):
        raise ValueError(
            f"{where}: {family} num_key_value_heads {kvh!r} is not supported: transformers' "
            f"{family} expands its latent to num_attention_heads ({H}) heads of K and V and "
            "repeats them num_attention_heads // num_key_value_heads times, which fails unless "
            f"that is 1; set it to num_attention_heads ({H}) or leave it out"
        )
    sizes = {
        key: _int(cfg, key, where)
        for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim")
    }
    v_head_dim = cfg.get("v_head_dim")
    if v_head_dim is None and family == "minicpm3":  # (MiniCPM3Config's fallback)
        v_head_dim = E // H
    else:
        v_head_dim = _int(cfg, "v_head_dim", where)
    q_lora_rank = cfg.get("q_lora_rank")  # (null: q_proj from the hidden states)
    if family in MLA_Q_PROJ:  # (Ling 3.0's q_proj, always: its config has no q latent)
        q_lora_rank = None
    if q_lora_rank is not None:
        q_lora_rank = _int(cfg, "q_lora_rank", where)
    for key in ("use_bidirectional_attention", "attention_chunk_size", "clip_qkv"):
        if cfg.get(key):
            raise ValueError(f"{where}: {family} {key} {cfg[key]!r} is not supported")
    if family in HYBRIDS:  # (refuses a linear-attention layer, naming the MLA ones)
        _hybrid_layer(cfg, family, layer, where)
    rope = scale = query_scale = None  # (NoPE: its config reads no RoPE table, null or
    if family not in MLA_NOPE:  # not; scale (N + R) ** -0.5, the module's, no YaRN mscale)
        rope, scale = _mla_rope(cfg, family, sizes, where)
    if family in LLAMA4_SCALING:  # (Mistral 4: its q = [q_nope; rope(q_rope)] scaled whole)
        query_scale = _llama4_scaling(cfg, family, rope, where)
    try:
        return AttentionConfig(
            E,
            H,
            bias=bool(cfg.get("attention_bias")),
            causal=True,
            rope=rope,
            softmax_scale=scale,
            # (Ling 3.0's: each head's output after W_uv times sigmoid(g_proj(x)))
            output_gate=_own_gate(cfg, family),
            output_gate_per_head=_own_gate(cfg, family) and OWN_GATE[family][1],
            mla=MLAConfig(
                kv_lora_rank=sizes["kv_lora_rank"],
                rope_dim=sizes["qk_rope_head_dim"],
                nope_dim=sizes["qk_nope_head_dim"],
                v_head_dim=v_head_dim,
                q_lora_rank=q_lora_rank,
                # (their q_a_layernorm and kv_a_layernorm are built without an eps: the
                # RMSNorm's default, whatever rms_norm_eps says)
                eps=1e-6,
            ),
            query_scale=query_scale,
        )
    except ValueError as e:
        raise ValueError(f"{where}: layer {layer}: {e}") from None


def _own_gate(cfg: dict[str, Any], family: str) -> bool:
    """Whether the layer has an output gate of its own projection (OWN_GATE), and its switch
    (OWN_GATE_SWITCH: LFM3's use_attention_gate, on by default) on."""
    switch = OWN_GATE_SWITCH.get(family)
    return family in OWN_GATE and (switch is None or bool(cfg.get(switch, True)))


def _mla_rope(
    cfg: dict[str, Any], family: str, sizes: dict[str, int], where: Path
) -> tuple[RopeConfig, float]:
    """An MLA family's RoPE over its qk_rope_head_dim dims, and its softmax scale."""
    check_rope_nulls(cfg, family, where)
    if family == "mistral4":  # its RoPE table's partial_rotary_factor: the rope dims' share
        cfg = _mla_partial(cfg, sizes, where)
    interleave = MLA_INTERLEAVED[family]  # (a null rope_interleave: by halves)
    if family in MLA_INTERLEAVE_KEY and "rope_interleave" in cfg:
        interleave = bool(cfg["rope_interleave"])
    rope = replace(read_rope(cfg, "full_attention", where), interleaved=interleave)
    # DeepseekV3Attention's scaling: qk_head_dim ** -0.5, times mscale squared where the RoPE
    # table has mscale_all_dim and a type but default (yarn_apply_mscale, yarn_get_mscale)
    scale = (sizes["qk_nope_head_dim"] + sizes["qk_rope_head_dim"]) ** -0.5
    name = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    table = cfg.get(name) or {}
    all_dim = table.get("mscale_all_dim") if isinstance(table, dict) else None
    if rope.type != "default" and all_dim and "factor" in table and table["factor"] is None:
        refuse_null(where, family, f"{name}.factor", "its softmax scale takes yarn's mscale of it")
    if rope.type != "default" and all_dim and rope.factor > 1:
        mscale = 0.1 * float(all_dim) * math.log(rope.factor) + 1.0
        scale *= mscale * mscale
    return rope, scale


def _llama4_flags(cfg: dict[str, Any], where: Path) -> None:
    """Llama 4's no_rope_layers (one 0 or 1 per layer, at least; empty or left out: derived
    from no_rope_layer_interval) and layer_types, refused where its config would fail."""
    flags = cfg.get("no_rope_layers")
    n = cfg["num_hidden_layers"]
    if flags and (not isinstance(flags, list) or len(flags) < n):
        raise ValueError(f"{where}: no_rope_layers must list a 0 or 1 for each of {n} layers")
    if not flags:
        _int(cfg, "no_rope_layer_interval", where)
    types = cfg.get("layer_types")
    if types is not None and (not isinstance(types, list) or len(types) != n):
        raise ValueError(f"{where}: layer_types must list {n} entries, one per layer")


def _llama4_text(
    cfg: dict[str, Any], layer: int, rope: RopeConfig | None, where: Path
) -> tuple[QKNormConfig | None, QueryScaleConfig | None, int | None]:
    """Llama4TextAttention's per-layer options: on a RoPE layer (no_rope_layers' 1) its
    L2Norm of q and k after RoPE (use_qk_norm: x * rsqrt(mean(x^2) + rms_norm_eps) in
    float32, no gain); on a NoPE layer its attention temperature tuning (attn_temperature_
    tuning: q times log1p(floor((p + 1) / floor_scale)) * attn_scale + 1 in float32); a
    chunked_attention layer (layer_types', else every RoPE layer, as its config derives them)
    attends in chunks of attention_chunk_size: served up to one chunk (chunk_size)."""
    qk_norm = query_scale = chunk = None
    if rope is not None and cfg.get("use_qk_norm"):
        eps = cfg.get("rms_norm_eps")
        qk_norm = QKNormConfig("head", eps, after_rope=True, gain=False)
    if rope is None and cfg.get("attn_temperature_tuning"):
        floor_scale, attn_scale = cfg.get("floor_scale"), cfg.get("attn_scale")
        if isinstance(floor_scale, bool) or not isinstance(floor_scale, int | float):
            raise ValueError(f"{where}: llama4 floor_scale must be a number, got {floor_scale!r}")
        try:
            query_scale = QueryScaleConfig(attn_scale, floor_scale, offset=1, float32=True)
        except ValueError as e:
            raise ValueError(
                f"{where}: llama4 attn_scale {attn_scale!r}, floor_scale {floor_scale!r}: {e}"
            ) from None
    types = cfg.get("layer_types")
    kind = types[layer] if types else ("chunked_attention" if rope else "full_attention")
    if kind == "chunked_attention":
        chunk = cfg.get("attention_chunk_size")
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(
                f"{where}: layer {layer} is a chunked_attention layer but attention_chunk_size "
                f"is {chunk!r}: set it to the checkpoint's (a positive int)"
            )
    elif kind != "full_attention":
        raise ValueError(
            f"{where}: layer {layer} has layer type {kind!r}, which is not supported for "
            "llama4; supported: chunked_attention, full_attention"
        )
    return qk_norm, query_scale, chunk


def _llama4_scaling(
    cfg: dict[str, Any], family: str, rope: RopeConfig | None, where: Path
) -> QueryScaleConfig | None:
    """Ministral 3's and Mistral 4's query scale (get_llama_4_attn_scale): 1 + beta *
    log(1 + floor(p / original_max_position_embeddings)), both from the RoPE table as their
    config standardises it (the pretraining context beside the table wins for yarn and
    llama3, as read_rope reads it), the scale rounded to q's dtype. None for a beta of 0 (a
    scale of 1). A beta or context the table lacks or sets null is refused: transformers'
    attention computes with it and fails."""
    name = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    table = cfg.get(name) or DEFAULT_ROPE.get(family, {})
    table = table if isinstance(table, dict) else {}
    beta = table.get("llama_4_scaling_beta")
    context = table.get("original_max_position_embeddings")
    if rope is not None and rope.type in SCALED_CONTEXT:
        context = rope.original_max_position_embeddings
    for key, value in (
        ("llama_4_scaling_beta", beta),
        ("original_max_position_embeddings", context),
    ):
        if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
            raise ValueError(
                f"{where}: {family} {name}.{key} must be a number >= 0, got {value!r}: its "
                "attention scales each query by 1 + llama_4_scaling_beta * log(1 + "
                "floor(position / original_max_position_embeddings)) and fails without it"
            )
    if not context > 0:
        raise ValueError(
            f"{where}: {family} {name}.original_max_position_embeddings must be > 0 (its "
            f"query scale divides the position by it), got {context!r}"
        )
    if beta == 0:
        return None
    return QueryScaleConfig(beta=float(beta), floor_div=float(context))


def _mla_partial(cfg: dict[str, Any], sizes: dict[str, int], where: Path) -> dict[str, Any]:
    """Mistral 4's config with its RoPE table's partial_rotary_factor dropped where it turns
    the qk_rope_head_dim dims (Mistral4Config sets it to rope / (nope + rope), and its rotary
    embedding turns int((nope + rope) * factor) dims): the MLA module's RoPE over those dims.
    Any other factor is refused naming it (another rotation than the module's)."""
    name = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    table = cfg.get(name)
    if not isinstance(table, dict) or "partial_rotary_factor" not in table:
        return cfg
    factor = table["partial_rotary_factor"]
    R, N = sizes["qk_rope_head_dim"], sizes["qk_nope_head_dim"]
    if (
        isinstance(factor, bool)
        or not isinstance(factor, int | float)
        or int((N + R) * factor) != R
    ):
        raise ValueError(
            f"{where}: mistral4 {name}.partial_rotary_factor {factor!r} is not supported: its "
            f"rotary embedding turns int(head_dim * factor) dims, which must be the "
            f"qk_rope_head_dim ({R}) of a head of {N + R} (leave it out: {R} / {N + R})"
        )
    return {**cfg, name: {k: v for k, v in table.items() if k != "partial_rotary_factor"}}


def _falcon_kv_heads(cfg: dict[str, Any], H: int, where: Path) -> int:
    """FalconAttention's KV heads: num_kv_heads (null: num_attention_heads) in the new decoder
    architecture (Falcon-40B, 180B: grouped query heads), one with multi_query (Falcon-7B),
    else num_attention_heads (MHA); its ALiBi (Falcon-RW) beside any of them."""
    kv = cfg.get("num_kv_heads")
    kv = H if kv is None else kv
    new = cfg.get("new_decoder_architecture")
    if new and (isinstance(kv, bool) or not isinstance(kv, int) or kv < 1 or H % kv):
        raise ValueError(
            f"{where}: falcon num_kv_heads must be a positive int dividing num_attention_heads "
            f"({H}) with new_decoder_architecture (its query heads are grouped per KV "
            f"head), got {kv!r}"
        )
    if new:
        return kv
    if cfg.get("multi_query"):  # (num_kv_heads is not read)
        return 1
    if kv != H:  # (FalconAttention views its keys as num_kv_heads heads of H: it fails)
        raise ValueError(
            f"{where}: falcon num_kv_heads {kv!r} without multi_query or "
            f"new_decoder_architecture is not supported: transformers' FalconAttention "
            f"computes num_attention_heads ({H}) KV heads then and fails on any other; leave "
            "num_kv_heads out"
        )
    return H


def _layer_type(cfg: dict[str, Any], family: str, layer: int, where: Path) -> str:
    """full_attention or sliding_attention, as transformers decides it for the family: from
    layer_types where it reads them (its configuration_<family>.py derives them when
    config.json has none); Mistral, Phi-3 and others apply sliding_window to every layer."""
    if family in HYBRIDS:
        kind = _hybrid_layer(cfg, family, layer, where)
        if family not in WINDOW_EVERY_LAYER:  # (MiniMax's: a window on its attention layers)
            return kind
    if family in WINDOW_EVERY_LAYER:
        on = window_on(cfg) if family in WINDOW_SWITCH else cfg.get("sliding_window") is not None
        return "sliding_attention" if on else "full_attention"
    if family not in DERIVED_SLIDING:
        return "full_attention"
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != n:
            raise ValueError(f"{where}: layer_types must list {n} entries, one per layer")
        if types[layer] not in LAYER_TYPES:
            raise ValueError(
                f"{where}: layer {layer} has layer type {types[layer]!r}, which is not "
                f"supported; supported: {', '.join(LAYER_TYPES)}"
            )
        return types[layer]
    try:
        sliding = DERIVED_SLIDING[family](cfg, layer)
    except (KeyError, TypeError, ZeroDivisionError) as e:  # as the family's config fails
        raise ValueError(
            f"{where}: {family} without layer_types derives them from keys this config.json "
            f"lacks or sets otherwise ({type(e).__name__}: {e}); give layer_types"
        ) from None
    return "sliding_attention" if sliding else "full_attention"


def hybrid_kinds(cfg: dict[str, Any], family: str, where: Path) -> list[str | None]:
    """A hybrid's layer kinds (HYBRIDS): its key's list (legacy names read as transformers
    reads them), else derived as its config derives them."""
    hybrid, n = HYBRIDS[family], cfg["num_hidden_layers"]
    kinds = cfg.get(hybrid.key) if hybrid.key else None
    if kinds is None:
        kinds = _hybrid_call(lambda c: [hybrid.derive(c, i) for i in range(n)], cfg, family, where)
    if not isinstance(kinds, list) or len(kinds) != n:
        raise ValueError(f"{where}: {hybrid.key} must list {n} entries, one per layer")
    kinds = [
        LEGACY_LAYER_TYPES.get(kind, kind) if isinstance(kind, str) else kind for kind in kinds
    ]
    wrong = hybrid.check(kinds) if hybrid.check else None
    if wrong:
        raise ValueError(f"{where}: {family} layer kinds {kinds} are not supported: {wrong}")
    return kinds


def _hybrid_call(
    derive: Callable[[dict[str, Any]], Any], cfg: dict[str, Any], family: str, where: Path
) -> Any:
    """derive(cfg), a hybrid's layer kinds or count as its config derives them; its failure
    (as its config's) a ValueError saying so."""
    key = HYBRIDS[family].key
    try:
        return derive(cfg)
    except (TypeError, KeyError, ValueError, ZeroDivisionError) as e:
        if key is None:
            raise ValueError(
                f"{where}: {family} derives its layer kinds from keys this config.json sets "
                f"otherwise ({type(e).__name__}: {e})"
            ) from None
        raise ValueError(
            f"{where}: {family} without {key} derives them from keys this config.json sets "
            f"otherwise ({type(e).__name__}: {e}); give {key}"
        ) from None


def _hybrid_layer(cfg: dict[str, Any], family: str, layer: int, where: Path) -> str:
    """A hybrid's layer (HYBRIDS): one of its served kinds, or refused saying what it is and
    which layers are served."""
    hybrid = HYBRIDS[family]
    kinds = hybrid_kinds(cfg, family, where)
    kind = kinds[layer]
    if kind in hybrid.served:
        return kind
    served = [i for i, k in enumerate(kinds) if k in hybrid.served]
    what = hybrid.others.get(kind, "not supported")
    named = "/".join(hybrid.served)
    if family in OUTPUT_GATE:  # (their refusal as it was worded before the tables merged)
        what = hybrid.others.get(kind, f"not one of {', '.join((*hybrid.served, *hybrid.others))}")
        raise ValueError(
            f"{where}: layer {layer} of {family} is a {kind!r} layer: {what}, and is not "
            f"served; its {named} layers are: {', '.join(map(str, served)) or 'none'}"
        )
    raise ValueError(
        f"{where}: layer {layer} of {family} is a {kind!r} layer ({what}); its {named} layers "
        f"are {served or 'none'}: set layer to one of them"
    )


def _null_theta(cfg: dict[str, Any]) -> bool:
    """Whether config.json's RoPE theta is null, where transformers reads it: the table's
    (rope_scaling over rope_parameters), else rope_theta beside it."""
    table = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if isinstance(table, dict) and "rope_theta" in table:
        return table["rope_theta"] is None
    return "rope_theta" in cfg and cfg["rope_theta"] is None


def _null_window(cfg: dict[str, Any], family: str, where: Path) -> None:
    """sliding_window null is no window (Mistral's, Qwen2's without use_sliding_window), but
    transformers 5 builds no model whose layer types name a sliding layer then (its sliding
    mask needs the window): every layer is refused, not only the sliding ones."""
    if family not in DERIVED_SLIDING or "sliding_window" not in cfg:
        return
    if cfg["sliding_window"] is not None:
        return
    for i in range(cfg["num_hidden_layers"]):
        try:
            sliding = _layer_type(cfg, family, i, where) == "sliding_attention"
        except ValueError:  # (another layer's type: that layer's own refusal)
            continue
        if sliding:
            refuse_null(where, family, "sliding_window", f"layer {i} is a sliding_attention layer")


def _biases(cfg: dict[str, Any], family: str) -> tuple[bool, bool]:
    """Whether q/k/v and whether o_proj carry biases (BIAS, O_BIAS)."""
    flags = []
    for where, fallback in ((BIAS, "attention_bias"), (O_BIAS, None)):
        flag = where.get(family, fallback)
        flags.append(
            flags[0] if flag is None else cfg.get(flag, False) if isinstance(flag, str) else flag
        )
    return bool(flags[0]), bool(flags[1])


def _number(cfg: dict[str, Any], key: str, where: Path) -> float:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"{where}: {key} must be a positive number, got {value!r}")
    return value


def _int(cfg: dict[str, Any], key: str, where: Path) -> int:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: {key} must be a positive int, got {value!r}")
    return value
