"""RoPE as a Hugging Face config.json gives it, read as transformers 5 reads it: the table
(rope_parameters, 4.x's rope_theta + rope_scaling, per layer type for Gemma 3 and OLMo 3),
the family's pairs and partial rotation (hf_families), proportional tables (LFM3's full
layers'), and the nulls transformers builds no layer from. Part of hf_config's reader; no
torch here."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from .config import ROPE_TYPES, RopeConfig
from .hf_families import (
    DEFAULT_ROPE,
    INTERLEAVED_ROPE,
    LAYER_TYPES,
    MLA,
    NOPE_TABLE,
    NTK_ALPHA,
    OWN_ROPE_TABLES,
    PARTIAL_BY_ROTARY_DIM,
    PARTIAL_IN_TABLE_ONLY,
    PARTIAL_NOT_NULL,
    PARTIAL_ROPE,
    PER_TYPE_ROPE,
    REVERSED_ROPE,
    ROPE_DEFAULT_ONLY,
    ROPE_KEYS,
    SCALED_CONTEXT,
)


def rope_keys(family: str) -> tuple[str, str]:
    """The config.json keys beside the RoPE table that hold its theta and partial factor."""
    return ROPE_KEYS.get(family, ("rope_theta", "partial_rotary_factor"))


def refuse_partial(where: Path, family: str, key: str, value: Any) -> None:
    """A partial rotation in a family whose transformers code rotates every dim."""
    raise ValueError(
        f"{where}: {key} {value!r} is not supported for {family} (transformers' {family} "
        f"rotates every dim of each head; only {', '.join(PARTIAL_ROPE)} rotate part of it)"
    )


def refuse_null(where: Path, family: str, key: str, why: str = "") -> None:
    raise ValueError(
        f"{where}: {family} config.json sets {key} to null, from which transformers 5 builds "
        f"no layer ({why or 'its config rejects the null, or its attention computes with it'})"
        f"; set {key} to the checkpoint's, or leave it out for {family}'s default"
    )


def check_rope_nulls(cfg: dict[str, Any], family: str, where: Path) -> None:
    """A null theta, type or factor where transformers 5 reads its RoPE table from (as read_rope
    and _per_type_table resolve it): the model's rotary embedding fails on it, so no layer
    is built, NoPE ones included."""
    why = "its rotary embedding computes with it"
    if family in OWN_ROPE_TABLES:  # (its layer's own table only: _own_table)
        return
    if family in PER_TYPE_ROPE:
        tables = cfg.get("rope_parameters") or {}
        _, local_key, _ = PER_TYPE_ROPE[family]
        for kind, beside in (("full_attention", "rope_theta"), ("sliding_attention", local_key)):
            table = tables.get(kind) if isinstance(tables, dict) else None
            table = table if isinstance(table, dict) else {}
            if "rope_theta" in table and table["rope_theta"] is None:
                refuse_null(where, family, f"rope_parameters.{kind}.rope_theta", why)
            if "rope_theta" not in table and beside and beside in cfg and cfg[beside] is None:
                refuse_null(where, family, beside, why)
        return
    name = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    table = cfg.get(name) or DEFAULT_ROPE.get(family, {})
    if not isinstance(table, dict):
        return
    kind = table.get("rope_type", table.get("type"))
    for key in ("rope_theta", "rope_type", "type", "factor"):
        if key in table and table[key] is None and (key != "factor" or kind != "yarn"):
            refuse_null(where, family, f"{name}.{key}", why)  # (yarn's factor: the context ratio)
    theta = rope_keys(family)[0]
    if "rope_theta" not in table and theta in cfg and cfg[theta] is None:
        refuse_null(where, family, theta, why)
    # (standardize_rope_params: the pretraining context beside the table wins, a null too)
    beside = "original_max_position_embeddings"
    if kind in SCALED_CONTEXT and beside in cfg and cfg[beside] is None:
        refuse_null(where, family, beside, why)


def read_rope(cfg: dict[str, Any], layer_type: str, where: Path) -> RopeConfig:
    """RoPE parameters as transformers 5 reads config.json (PreTrainedConfig's
    convert_rope_params_to_dict): 4's rope_scaling over 5's rope_parameters, rope_theta
    beside them where the table has none; Gemma 3 and OLMo 3 have a table per layer type
    (_per_type_table)."""
    family = cfg["model_type"]
    if family in PER_TYPE_ROPE:
        params = _per_type_table(cfg, family, layer_type, where)
    else:
        params = cfg.get("rope_parameters")
        if family in DEFAULT_ROPE and not params and not cfg.get("rope_scaling"):
            params = DEFAULT_ROPE[family]  # (GptOssConfig's, ApertusConfig's, CwmConfig's)
        tables = sorted(k for k, v in (params or {}).items() if isinstance(v, dict))
        if tables and not cfg.get("rope_scaling"):
            # transformers 5 reads such tables only where the config class does (PER_TYPE_ROPE):
            # Llama's ignores them (default RoPE), GPT-OSS's fails on them
            raise ValueError(
                f"{where}: rope_parameters holds tables per layer type ({', '.join(tables)}), "
                f"but {family} reads one table for all its layers (transformers 5 ignores "
                "per-type tables or fails on them); give one table (rope_type, rope_theta, ...)"
            )
        params = dict(cfg.get("rope_scaling") or params or {})
        # as standardize_rope_params: llama3's and yarn's pretraining context beside the
        # table wins over the table's own (Phi-3 keeps it there)
        beside = cfg.get("original_max_position_embeddings")
        kind = params.get("rope_type", params.get("type"))
        if beside is not None and kind in SCALED_CONTEXT:
            params["original_max_position_embeddings"] = beside
    params.setdefault("rope_theta", cfg.get(rope_keys(family)[0], 10_000.0))
    params = dict(params)
    kind = params.pop("rope_type", params.pop("type", "default"))
    if family in NTK_ALPHA and kind == "dynamic" and params.get("alpha"):
        # (Hunyuan v1's rotary embedding: "dynamic" with a fixed alpha is its ntk_alpha, whose
        # frequencies are fixed: theta * alpha ** (head_dim / (head_dim - 2)), then default)
        D = cfg["head_dim"]
        params["rope_theta"] = params["rope_theta"] * params["alpha"] ** (D / (D - 2))
        kind = "default"
    if kind not in ROPE_TYPES:
        raise ValueError(
            f"{where}: rope type {kind!r} is not supported; supported: {', '.join(ROPE_TYPES)} "
            "(dynamic and longrope change frequencies with the sequence length, which keys "
            "rotated once and cached cannot follow)"
        )
    if family in ROPE_DEFAULT_ONLY and kind != "default":
        raise ValueError(
            f"{where}: {family} rope type {kind!r} is not supported: transformers' {family} "
            "rotary embedding takes the default type only (it raises on any other)"
        )
    if cfg["model_type"] in ("phi3", "phimoe") and kind != "default":
        raise ValueError(
            f"{where}: {family} rope type {kind!r} is not supported: transformers' Phi-3 reads "
            "'su' and 'yarn' as 'longrope' (not served) and accepts no other scaling (PhiMoE "
            "validates a non-default table as longrope's, short_mscale and long_mscale)"
        )
    rope: dict[str, Any] = {"theta": float(params.get("rope_theta") or 10000.0), "type": kind}
    if family in INTERLEAVED_ROPE:
        rope["interleaved"] = True
    if family in REVERSED_ROPE:  # (nanochat: rotate_half [x2, -x1], sin's sign flipped)
        rope["reverse"] = True
    if kind == "proportional":
        name = f"rope_parameters.{layer_type}" if family in PER_TYPE_ROPE else _table_name(cfg)
        rope.update(_proportional(cfg, params, family, name, where))
    elif (partial := _partial(cfg, params, family, where)) != 1:
        rope["partial"] = partial
    try:
        if kind not in ("default", "proportional"):
            factor = params.get("factor")
            if factor is None and kind == "yarn":  # as transformers: the context ratio
                factor = cfg["max_position_embeddings"] / params["original_max_position_embeddings"]
            if factor is None:
                raise KeyError("factor")
            rope["factor"] = float(factor)
        if kind in ("llama3", "yarn"):
            rope["original_max_position_embeddings"] = int(
                params.get("original_max_position_embeddings") or cfg["max_position_embeddings"]
            )
        if kind == "llama3":
            rope["low_freq_factor"] = float(params["low_freq_factor"])
            rope["high_freq_factor"] = float(params["high_freq_factor"])
    except KeyError as e:  # (a bare KeyError said nothing of where)
        raise ValueError(
            f"{where}: rope type {kind!r} needs {e.args[0]} (its rope_scaling or "
            "rope_parameters table; max_position_embeddings beside it)"
        ) from None
    if kind == "yarn":
        for key in ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim"):
            if params.get(key):
                rope[key] = float(params[key])
        rope["truncate"] = bool(params.get("truncate", True))
    try:
        return RopeConfig(**rope)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def _table_name(cfg: dict[str, Any]) -> str:
    """The key of a family's one RoPE table, as read_rope reads it: 4.x's rope_scaling over
    5's rope_parameters."""
    return "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"


def _proportional(
    cfg: dict[str, Any], table: dict[str, Any], family: str, name: str, where: Path
) -> dict[str, float]:
    """A proportional table's factor and partial (RopeConfig's), as transformers 5's
    _compute_proportional_rope_parameters reads them: the table's factor and
    partial_rotary_factor, 1.0 where left out; a partial_rotary_factor beside the table
    moved into it where it has none (convert_rope_params_to_dict; a null there: none). The
    frequencies run over the whole head, the first int(partial * head_dim // 2) non-zero,
    all divided by factor. A null, or a value from which transformers computes no rotation
    we serve, is refused naming its key; so is the type in a family whose attention turns
    part of each head (PARTIAL_ROPE, MLA: the factor or the rope dims mean other dims)."""
    if family in PARTIAL_ROPE or family in PARTIAL_BY_ROTARY_DIM or family in MLA:
        raise ValueError(
            f"{where}: {name}.rope_type 'proportional' is not supported for {family}: its "
            "attention turns part of each head (the first partial_rotary_factor of it, or an "
            "MLA's qk_rope_head_dim dims) by frequencies over those dims, where proportional "
            "RoPE's run over the whole head_dim (transformers' then turns other dims or fails, "
            "family by family); give a table of another type"
        )
    beside = rope_keys(family)[1]
    values = {}
    for key in ("factor", "partial_rotary_factor"):
        if key in table:
            value, source = table[key], f"{name}.{key}"
        elif key == beside and cfg.get(beside) is not None:
            value, source = cfg[beside], beside
        else:
            value, source = 1.0, key
        top = 1 if key == "partial_rotary_factor" else math.inf
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not 0 < value <= top
            or not math.isfinite(value)
        ):
            bounds = "in (0, 1]" if top == 1 else "> 0, finite"
            raise ValueError(
                f"{where}: {source} must be a number {bounds}, got {value!r} (rope type "
                "'proportional': transformers divides its frequencies by factor and turns the "
                "first partial_rotary_factor of them; from any other value it builds no layer "
                "or turns none)"
            )
        values[key] = float(value)
    return {"factor": values["factor"], "partial": values["partial_rotary_factor"]}


def _partial(cfg: dict[str, Any], params: dict[str, Any], family: str, where: Path) -> float:
    """The fraction of each head that RoPE turns, as transformers 5 reads it
    (convert_rope_params_to_dict): rope_parameters' partial_rotary_factor, else config.json's
    (GPT-NeoX's rotary_pct; a null there: none, every dim, or no layer built where the
    attention computes with it), else the family's default (PARTIAL_ROPE). It must turn an
    even number of dims, 2 or more: refused otherwise, naming the key it came from."""
    key = rope_keys(family)[1]
    if "partial_rotary_factor" in params:
        value, name = params["partial_rotary_factor"], "rope_parameters.partial_rotary_factor"
    elif key in cfg and family not in PARTIAL_IN_TABLE_ONLY:
        value, name = cfg[key], key
        if value is None and family in PARTIAL_NOT_NULL:
            refuse_null(where, family, key, "its attention computes with the factor")
        value = 1.0 if value is None else value
    elif family in PARTIAL_BY_ROTARY_DIM and cfg.get("rotary_dim") is not None:
        return _rotary_dim_factor(cfg, family, where)
    else:
        value = PARTIAL_ROPE.get(family, 1.0)
        name = f"{key} (left out: {family}'s default)"
    if value in (1, 1.0):
        return 1.0
    if family not in PARTIAL_ROPE:
        refuse_partial(where, family, "partial_rotary_factor", value)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
        raise ValueError(f"{where}: {name} must be in (0, 1], got {value!r}")
    D = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    turned = int(D * value) if isinstance(D, int) else 2  # (a bad head_dim: its own refusal)
    if turned < 2 or turned % 2:
        raise ValueError(
            f"{where}: {name} {value} of head_dim {D} turns {turned} dims (int(head_dim * "
            f"{key})), which is not supported: RoPE turns dims by pairs, and from an odd count "
            f"or none transformers' {family} computes a rotation mha-serve does not serve; set "
            f"{key} so that head_dim * {key} is an even number >= 2"
        )
    return float(value)


def _rotary_dim_factor(cfg: dict[str, Any], family: str, where: Path) -> float:
    """rotary_dim / head_dim, as MiniMaxM2Config computes the factor (its rotary embedding then
    turns int(head_dim * factor) dims: rotary_dim); rotary_dim an even int from 2 to head_dim,
    else refused (past head_dim no layer runs; an odd one turns rotary_dim + 1 dims at
    frequencies over rotary_dim, which RopeConfig's partial does not express)."""
    turned, D = cfg["rotary_dim"], cfg["head_dim"]
    if (
        isinstance(turned, bool)
        or not isinstance(turned, int)
        or not 2 <= turned <= D
        or turned % 2
    ):
        raise ValueError(
            f"{where}: {family} rotary_dim must be an even int from 2 to head_dim {D}, got "
            f"{turned!r} (its attention rotates the first rotary_dim dims of each head by halves; "
            "an odd one turns one dim more at frequencies over rotary_dim, not served)"
        )
    return turned / D


def _per_type_table(
    cfg: dict[str, Any], family: str, layer_type: str, where: Path
) -> dict[str, Any]:
    """The RoPE table of a layer type of Gemma 3 or OLMo 3, as Gemma3TextConfig's and
    Olmo3Config's convert_rope_params_to_dict fill it: rope_parameters holds a table per
    layer type (a missing one is {"rope_type": "default"}); 4.x's rope_scaling updates the
    global layers' table only; a table without rope_theta takes rope_theta (global layers)
    or Gemma 3's rope_local_base_freq (local ones), else PER_TYPE_ROPE's defaults."""
    if family in OWN_ROPE_TABLES:
        return _own_table(cfg, family, layer_type, where)
    theta, local_key, local_theta = PER_TYPE_ROPE[family]
    tables = cfg.get("rope_parameters") or {}
    stray = sorted(k for k in tables if k not in LAYER_TYPES) if isinstance(tables, dict) else []
    if not isinstance(tables, dict) or stray:
        # transformers reads only the layer types' tables and ignores the rest (a flat table
        # among them): what it runs is not what the file says
        raise ValueError(
            f"{where}: {family} rope_parameters must hold a table per layer type "
            f'({{"full_attention": {{...}}, "sliding_attention": {{...}}}}), got '
            f"{'keys ' + ', '.join(stray) if stray else repr(tables)}: transformers 5 reads "
            "only the per-type tables and ignores the rest (a flat table's rope_type and "
            "rope_theta among them); give rope_parameters per layer type"
        )
    table = tables.get(layer_type)
    if table is not None and not isinstance(table, dict):
        raise ValueError(f"{where}: rope_parameters[{layer_type!r}] must be a table, got {table!r}")
    table = dict(table or {"rope_type": "default"})
    if layer_type == "full_attention":
        table.update(cfg.get("rope_scaling") or {})
        table.setdefault("rope_theta", cfg.get("rope_theta", theta))
    elif "rope_theta" not in table:
        if local_key is None and cfg.get("rope_theta", theta) != theta:
            # transformers 5's Olmo3Config gives the local layers 500000 whatever
            # rope_theta says (4.x: rope_theta everywhere): no one answer to serve
            raise ValueError(
                f"{where}: rope_theta {cfg['rope_theta']} without a rope_theta in "
                f"rope_parameters['sliding_attention']: transformers 5 reads it for the global "
                f"layers only ({theta} for the local ones); give rope_parameters per layer type, "
                "each with its rope_theta"
            )
        table["rope_theta"] = cfg.get(local_key, local_theta) if local_key else local_theta
    return table


def _own_table(cfg: dict[str, Any], family: str, layer_type: str, where: Path) -> dict[str, Any]:
    """The RoPE table of a layer type as an OWN_ROPE_TABLES family's config fills it
    (Lfm3Config, BeamConfig): its own tables where config.json has none; a table without
    rope_theta takes its default theta (Beam's: none, no layer); a layer type without a
    table builds no layer, a null one is NOPE_TABLE's. Its rotary embedding computes every
    layer type's frequencies at once: a bad table of any type refuses every layer."""
    defaults, theta = OWN_ROPE_TABLES[family]
    tables = cfg.get("rope_parameters") or defaults
    table = tables.get(layer_type) if isinstance(tables, dict) else None
    if table is None and layer_type in tables and family in NOPE_TABLE:
        raise ValueError(
            f"{where}: {family} {layer_type} layers (rope_parameters[{layer_type!r}] null) "
            f"are not supported: {NOPE_TABLE[family]}"
        )
    if not isinstance(table, dict):
        raise ValueError(
            f"{where}: {family} rope_parameters has no table for {layer_type!r} layers (got "
            f"{table!r}): its rotary embedding reads one per layer type and builds no layer "
            "without it"
        )
    # (its rotary embedding computes the table of every layer type the model has, at once)
    types = cfg.get("layer_types")
    for kind in sorted(set(types) if isinstance(types, list) else tables):
        other = tables.get(kind) if isinstance(tables, dict) else None
        if not isinstance(other, dict):
            continue
        if "rope_theta" in other and other["rope_theta"] is None:
            why = "its rotary embedding computes with it"
            refuse_null(where, family, f"rope_parameters.{kind}.rope_theta", why)
        if theta is None and "rope_theta" not in other:  # (BeamConfig fills none in)
            raise ValueError(
                f"{where}: {family} rope_parameters[{kind!r}] has no rope_theta: its rotary "
                "embedding reads it and builds no layer without it"
            )
        if other.get("rope_type", other.get("type")) == "proportional":
            _proportional(cfg, other, family, f"rope_parameters.{kind}", where)
    return {"rope_theta": theta, **table}
