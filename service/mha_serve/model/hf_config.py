"""Which attention a Hugging Face model directory holds: its config.json read into an
AttentionConfig for one layer, with every option we cannot serve exactly refused by name.
No torch here (config files are checked before torch loads); hf.py maps the weights."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import ROPE_TYPES, AttentionConfig, RopeConfig

FAMILIES = ("bert", "gpt2", "llama", "mistral", "qwen2")
ROTARY = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class HFLayer:
    """One layer's attention of a Hugging Face checkpoint, as we serve it."""

    directory: Path
    family: str  # config.json model_type, one of FAMILIES
    layer: int
    num_layers: int
    attention: AttentionConfig
    # Keys further than this many positions back are not attended (Mistral, Qwen2's sliding
    # layers); None: full attention. The engine caps the model's length at it, so that
    # full causal attention is exact.
    sliding_window: int | None = None


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
    if family not in FAMILIES:
        arch = ", ".join(cfg.get("architectures") or []) or "?"
        raise ValueError(
            f"{config_path}: model_type {family!r} (architectures {arch}) is not supported; "
            f"supported: {', '.join(FAMILIES)}"
        )
    num_layers = _int(cfg, "n_layer" if family == "gpt2" else "num_hidden_layers", config_path)
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < num_layers:
        raise ValueError(
            f"{config_path}: layer must be an int in 0..{num_layers - 1} ({family} with "
            f"{num_layers} layers), got {layer!r}; set layer = N in the [[models]] table"
        )
    sliding = None
    if family == "bert":
        attention = _bert(cfg, config_path)
    elif family == "gpt2":
        attention = _gpt2(cfg, layer, config_path)
    else:
        attention, sliding = _rotary(cfg, family, layer, config_path)
    return HFLayer(directory, family, layer, num_layers, attention, sliding)


def _bert(cfg: dict[str, Any], where: Path) -> AttentionConfig:
    kind = cfg.get("position_embedding_type", "absolute")
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


def _gpt2(cfg: dict[str, Any], layer: int, where: Path) -> AttentionConfig:
    if cfg.get("add_cross_attention"):
        raise ValueError(
            f"{where}: GPT-2 add_cross_attention is not supported (self-attention only)"
        )
    E, H = _int(cfg, "n_embd", where), _int(cfg, "n_head", where)
    scale = (E // H) ** -0.5 if cfg.get("scale_attn_weights", True) else 1.0
    if cfg.get("scale_attn_by_inverse_layer_idx", False):
        scale /= float(layer + 1)  # as GPT2Attention: scaling /= layer_idx + 1
    return AttentionConfig(E, H, bias=True, causal=True, softmax_scale=scale)


def _rotary(
    cfg: dict[str, Any], family: str, layer: int, where: Path
) -> tuple[AttentionConfig, int | None]:
    E, H = _int(cfg, "hidden_size", where), _int(cfg, "num_attention_heads", where)
    KVH = cfg.get("num_key_value_heads") or H
    D = cfg.get("head_dim") or E // H
    if family == "qwen2":
        bias = True  # q/k/v carry biases, o_proj none (served as a zero bias)
    elif family == "llama":
        bias = bool(cfg.get("attention_bias", False))
    else:
        bias = False
    for key in ("partial_rotary_factor",):
        if cfg.get(key) not in (None, 1, 1.0):
            raise ValueError(f"{where}: {key} {cfg[key]} is not supported (full rotary only)")
    sliding = None
    if family == "mistral":
        sliding = cfg.get("sliding_window")
    elif family == "qwen2":
        types = cfg.get("layer_types")
        if types and len(types) != cfg["num_hidden_layers"]:
            raise ValueError(
                f"{where}: layer_types has {len(types)} entries for "
                f"{cfg['num_hidden_layers']} layers"
            )
        if types:
            sliding = cfg.get("sliding_window") if types[layer] == "sliding_attention" else None
        elif cfg.get("use_sliding_window") and layer >= cfg.get("max_window_layers", 0):
            sliding = cfg.get("sliding_window")
    attention = AttentionConfig(
        E, H, KVH, D, bias=bias, causal=True, rope=_rope(cfg, where), softmax_scale=None
    )
    return attention, sliding


def _rope(cfg: dict[str, Any], where: Path) -> RopeConfig:
    """RoPE parameters from transformers 5's rope_parameters, or 4's rope_theta + rope_scaling."""
    params = cfg.get("rope_parameters")
    if params is None:
        params = dict(cfg.get("rope_scaling") or {})
        params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"{where}: per-layer-type rope_parameters are not supported")
    params = dict(params)
    kind = params.pop("rope_type", params.pop("type", "default"))
    if kind not in ROPE_TYPES:
        raise ValueError(
            f"{where}: rope type {kind!r} is not supported; supported: {', '.join(ROPE_TYPES)} "
            "(dynamic and longrope change frequencies with the sequence length, which keys "
            "rotated once and cached cannot follow)"
        )
    if params.get("partial_rotary_factor") not in (None, 1, 1.0):
        raise ValueError(f"{where}: partial_rotary_factor is not supported (full rotary only)")
    rope: dict[str, Any] = {"theta": float(params.get("rope_theta") or 10000.0), "type": kind}
    if kind != "default":
        factor = params.get("factor")
        if factor is None and kind == "yarn":  # as transformers: the context ratio
            factor = cfg["max_position_embeddings"] / params["original_max_position_embeddings"]
        rope["factor"] = float(factor)
    if kind in ("llama3", "yarn"):
        rope["original_max_position_embeddings"] = int(
            params.get("original_max_position_embeddings") or cfg["max_position_embeddings"]
        )
    if kind == "llama3":
        rope["low_freq_factor"] = float(params["low_freq_factor"])
        rope["high_freq_factor"] = float(params["high_freq_factor"])
    if kind == "yarn":
        for key in ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim"):
            if params.get(key):
                rope[key] = float(params[key])
        rope["truncate"] = bool(params.get("truncate", True))
    try:
        return RopeConfig(**rope)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def _int(cfg: dict[str, Any], key: str, where: Path) -> int:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: {key} must be a positive int, got {value!r}")
    return value
