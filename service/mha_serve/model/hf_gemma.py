"""Gemma 3n's and Gemma 4's attention layers (Gemma3nTextAttention, Gemma4TextAttention,
Gemma4UnifiedTextAttention) from config.json: q/k RMSNorm per head (gain `weight`), values
RMS-normed per head without a gain (v_norm), scale 1.0, local and global layers, RoPE per
layer type; Gemma 4's global layers with a head_dim and KV heads of their own
(per_layer_config), proportional RoPE and, with attention_k_eq_v, values from k_proj. Layers
that reuse another layer's K/V (KV sharing) are refused, naming the layers that own theirs.
Part of hf_config's reader; no torch here."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from .config import AttentionConfig, QKNormConfig, RopeConfig
from .hf_families import LAYER_TYPES
from .hf_rope import check_rope_nulls, read_rope, refuse_null

# The families read here (their multimodal wrappers' text models: hf_families.MULTIMODAL).
GEMMA_V_NORM = ("gemma3n_text", "gemma4_text", "gemma4_unified_text")
_GEMMA4 = ("gemma4_text", "gemma4_unified_text")
# Gemma 4's RoPE table per layer type when config.json has none (Gemma4TextConfig's).
GEMMA4_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {
        "rope_type": "proportional",
        "partial_rotary_factor": 0.25,
        "rope_theta": 1_000_000.0,
    },
}
# What a layer of per_layer_config may override that Gemma4TextAttention reads per layer.
_PER_LAYER_KEYS = ("head_dim", "num_key_value_heads")
# Keys whose null their configs reject (typed int, bool or str) or whose attention computes
# with it: no layer is built.
_NOT_NULL = (
    *("num_key_value_heads", "head_dim", "attention_bias", "sliding_window"),
    *("num_kv_shared_layers", "attention_k_eq_v"),
)


def gemma_layer(
    cfg: dict[str, Any], family: str, layer: int, where: Path
) -> tuple[AttentionConfig, bool]:
    """The layer's AttentionConfig, and whether its values are its keys' projection
    (Gemma 4's attention_k_eq_v on a global layer: no v_proj, v = v_norm(k_proj(x)), served
    with k_proj's rows as the value rows)."""
    for key in _NOT_NULL:
        if key in cfg and cfg[key] is None:
            refuse_null(where, family, key)
    E, H = _int(cfg, "hidden_size", where), _int(cfg, "num_attention_heads", where)
    n = cfg["num_hidden_layers"]
    if family == "gemma3n_text" and E % H:  # (Gemma3nTextConfig.validate_architecture)
        raise ValueError(
            f"{where}: gemma3n_text hidden_size {E} is not divisible by num_attention_heads {H} "
            "(its config refuses it)"
        )
    types = _layer_types(cfg, family, n, where)
    kind = types[layer]
    _kv_sharing(cfg, family, types, layer, where)
    bidirectional = cfg.get("use_bidirectional_attention")
    if bidirectional not in (None, "vision"):
        # ("vision": image tokens see each other both ways, text tokens causally; a request
        # carries no token types, so its tokens are served as text: causal)
        raise ValueError(
            f"{where}: {family} use_bidirectional_attention {bidirectional!r} is not supported "
            "(every token attends both ways, within a window halved plus one on sliding "
            "layers); mha-serve serves these layers causal"
        )
    head_dim, kv_heads = _layer_sizes(cfg, family, types, layer, where)
    k_eq_v = family in _GEMMA4 and bool(cfg.get("attention_k_eq_v")) and kind == "full_attention"
    sliding = None
    if kind == "sliding_attention":
        sliding = _int(cfg, "sliding_window", where)
    eps = cfg.get("rms_norm_eps", 1e-6)
    rope = _rope(cfg, family, types, kind, where)
    try:
        attention = AttentionConfig(
            E,
            H,
            kv_heads,
            head_dim,
            bias=bool(cfg.get("attention_bias", False)),
            causal=True,
            rope=rope,
            softmax_scale=1.0,  # (self.scaling = 1.0: the q/k norms set the scores' scale)
            sliding_window=sliding,
            qk_norm=QKNormConfig("head", eps),
            v_norm=True,
        )
    except ValueError as e:
        raise ValueError(f"{where}: layer {layer}: {e}") from None
    return attention, k_eq_v


def _layer_types(cfg: dict[str, Any], family: str, n: int, where: Path) -> list[str]:
    """layer_types, else as their configs derive them: Gemma 3n's every fifth layer global,
    Gemma 4's every sixth; Gemma 4's last layer is always global (its config forces it)."""
    types = cfg.get("layer_types")
    if types is None:
        every = 5 if family == "gemma3n_text" else 6
        types = [
            "full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n)
        ]
    if not isinstance(types, list) or len(types) != n:
        raise ValueError(f"{where}: layer_types must list {n} entries, one per layer")
    types = list(types)
    if family in _GEMMA4 and types:
        types[-1] = "full_attention"
    for i, kind in enumerate(types):
        if kind not in LAYER_TYPES:
            raise ValueError(
                f"{where}: layer {i} has layer type {kind!r}, which is not supported; "
                f"supported: {', '.join(LAYER_TYPES)}"
            )
    return types


def _kv_sharing(
    cfg: dict[str, Any], family: str, types: list[str], layer: int, where: Path
) -> None:
    """Refuses a layer that reuses another's K/V (the last num_kv_shared_layers layers read
    those of the last earlier layer of their type, as their configs' kv_sharing_modes say):
    it has no k_proj or v_proj, and one served layer holds no other layer's cache."""
    shared = cfg["num_kv_shared_layers"]  # (hf_families.DEFAULTS: 15 for Gemma 3n, else 0)
    n = len(types)
    if isinstance(shared, bool) or not isinstance(shared, int) or not 0 <= shared <= n:
        raise ValueError(
            f"{where}: {family} num_kv_shared_layers must be an int from 0 to "
            f"num_hidden_layers ({n}), got {shared!r}"
        )
    first = n - shared
    if not shared:
        return
    if set(types[:first]) != set(types):  # (their configs refuse this: no model)
        raise ValueError(
            f"{where}: {family} num_kv_shared_layers {shared} leaves a layer type among the "
            f"last {shared} layers that no earlier layer produces K/V for (transformers builds "
            "no model from it)"
        )
    if layer < first:
        return
    kind = types[layer]
    owner = max(i for i in range(first) if types[i] == kind)
    raise ValueError(
        f"{where}: layer {layer} of {family} reuses the keys and values of layer {owner} (KV "
        f"sharing: num_kv_shared_layers {shared}): it has no k_proj or v_proj of its own, and "
        f"a served layer holds no other layer's cache; the layers with their own K/V are "
        f"0..{first - 1}: set layer to one of them"
    )


def _layer_sizes(
    cfg: dict[str, Any], family: str, types: list[str], layer: int, where: Path
) -> tuple[int, int]:
    """The layer's head_dim and KV heads: the config's, with Gemma 4's per_layer_config
    overrides (or, from a config.json without it, global_head_dim on global layers and
    num_global_key_value_heads there with attention_k_eq_v, as Gemma4TextConfig builds it)."""
    head_dim = _int(cfg, "head_dim", where)
    kv_heads = _int(cfg, "num_key_value_heads", where)
    if family not in _GEMMA4:
        return head_dim, kv_heads
    if "per_layer_config" in cfg:
        table = cfg["per_layer_config"] or {}
        if not isinstance(table, dict):
            raise ValueError(f"{where}: per_layer_config must be a table, got {table!r}")
        overrides: dict[int, dict[str, Any]] = {}
        for key, value in table.items():
            try:
                index = int(key)
            except ValueError:
                raise ValueError(
                    f"{where}: per_layer_config key {key!r} is not a layer index"
                ) from None
            if not isinstance(value, dict):
                raise ValueError(f"{where}: per_layer_config[{key!r}] must be a table")
            overrides[index] = value
    else:
        global_head_dim = cfg.get("global_head_dim", 512)
        layer_overrides: dict[str, Any] = {"head_dim": global_head_dim}
        global_kv = cfg.get("num_global_key_value_heads")
        if cfg.get("attention_k_eq_v") and global_kv is not None:
            layer_overrides["num_key_value_heads"] = global_kv
        overrides = {i: layer_overrides for i, kind in enumerate(types) if kind == "full_attention"}
    mine = overrides.get(layer, {})
    for key in mine:
        if key not in _PER_LAYER_KEYS:
            raise ValueError(
                f"{where}: per_layer_config[{layer}] sets {key}, which is not supported "
                f"(only {', '.join(_PER_LAYER_KEYS)} are read per layer)"
            )
    # (its rotary embedding reads one config per layer type: layers of a type that differ
    # build no model)
    kind = types[layer]
    for i, other in enumerate(types):
        if other == kind and overrides.get(i, {}) != mine:
            raise ValueError(
                f"{where}: per_layer_config gives layers {layer} and {i}, both {kind}, other "
                "sizes: transformers' rotary embedding reads one config per layer type and "
                "builds no model from it"
            )
    sizes = {"head_dim": head_dim, "num_key_value_heads": kv_heads, **mine}
    for key, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            name = f"per_layer_config[{layer}].{key}" if key in mine else key
            if key == "head_dim" and "per_layer_config" not in cfg and kind == "full_attention":
                name = "global_head_dim"
            raise ValueError(f"{where}: {name} must be a positive int, got {value!r}")
    return sizes["head_dim"], sizes["num_key_value_heads"]


def _rope(cfg: dict[str, Any], family: str, types: list[str], kind: str, where: Path) -> RopeConfig:
    """The layer type's RoPE: Gemma 3n's tables as Gemma 3's (hf_rope.read_rope, 4.x's
    rope_theta and rope_local_base_freq beside them); Gemma 4's rope_parameters per layer type
    as they are (its config fills nothing in: a table without rope_theta builds no model),
    default or proportional (its global layers': frequencies over the whole head, the first
    partial_rotary_factor of them non-zero). Gemma 4's rotary embedding computes every layer
    type's frequencies: a table it fails on, for any type the model has, refuses every layer."""
    if family == "gemma3n_text":
        check_rope_nulls(cfg, family, where)
        return read_rope(cfg, kind, where)
    if "rope_scaling" in cfg:  # (its config reads it in place of the tables: no model)
        raise ValueError(
            f"{where}: {family} config.json sets rope_scaling ({cfg['rope_scaling']!r}), which "
            "transformers 5 reads in place of rope_parameters' tables per layer type (its "
            "rotary embedding then fails); give rope_parameters per layer type, leave "
            "rope_scaling out"
        )
    tables = cfg.get("rope_parameters")
    tables = GEMMA4_ROPE if tables is None else tables
    for other in sorted(set(types)):
        table = tables.get(other) if isinstance(tables, dict) else None
        if not isinstance(table, dict):
            raise ValueError(
                f"{where}: {family} rope_parameters must hold a table per layer type, with "
                f"{other!r} among them, got {tables!r}"
            )
        theta = table.get("rope_theta")
        if isinstance(theta, bool) or not isinstance(theta, int | float) or not theta > 0:
            raise ValueError(
                f"{where}: rope_parameters.{other}.rope_theta must be a number > 0, got "
                f"{theta!r} (transformers' rotary embedding computes every layer type's)"
            )
    table = tables[kind]
    name = f"rope_parameters.{kind}"
    rope_type, theta = table.get("rope_type"), table["rope_theta"]
    if rope_type not in ("default", "proportional"):
        raise ValueError(
            f"{where}: {name}.rope_type {rope_type!r} is not supported for {family}; "
            "supported: default, proportional"
        )
    if rope_type == "default":
        return RopeConfig(theta=float(theta))
    factor = table.get("factor", 1.0)
    partial = table.get("partial_rotary_factor", 1.0)
    for key, value, top in (("factor", factor, math.inf), ("partial_rotary_factor", partial, 1)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= top:
            raise ValueError(f"{where}: {name}.{key} must be a number in (0, {top}], got {value!r}")
    return RopeConfig(theta=float(theta), type="proportional", factor=factor, partial=partial)


def _int(cfg: dict[str, Any], key: str, where: Path) -> int:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: {key} must be a positive int, got {value!r}")
    return value
