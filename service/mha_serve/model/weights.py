"""Weights for MultiHeadAttention: seeded init, safetensors save and load (our layout
or torch.nn.MultiheadAttention's), and import from a live nn.MultiheadAttention."""

from __future__ import annotations

import math
import os
from dataclasses import fields
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from .attention import MultiHeadAttention
from .checks import check_sinks
from .config import AttentionConfig
from .metadata import config_from_metadata, to_metadata
from .mla import LINEARS as MLA_LINEARS
from .mla import NORMS as MLA_NORMS
from .mla import expected_shapes as mla_shapes

FORMAT = "mha-serve/1"  # safetensors metadata "format" of the files we write
BIAS_INIT_BOUND = 0.02  # small but nonzero, so default weights exercise the bias paths
NORM_INIT_BOUND = 0.5  # q/k norm gains in 1 +- this: unequal, so each one's place matters
SINK_INIT_BOUND = 2.0  # sink logits in +- this: each head's sink takes a share of its rows

# torch.nn.MultiheadAttention's names for our four tensors; rows of in_proj_weight
# are [Wq; Wk; Wv], which is exactly our fused wqkv when KVH == H and D == E / H.
_TORCH_TO_OURS = {
    "in_proj_weight": "wqkv.weight",
    "in_proj_bias": "wqkv.bias",
    "out_proj.weight": "wo.weight",
    "out_proj.bias": "wo.bias",
}
# Keys of nn.MultiheadAttention options that have no equivalent here.
_TORCH_UNSUPPORTED = {
    "q_proj_weight": "kdim/vdim != embed_dim (separate q/k/v projections)",
    "k_proj_weight": "kdim/vdim != embed_dim (separate q/k/v projections)",
    "v_proj_weight": "kdim/vdim != embed_dim (separate q/k/v projections)",
    "bias_k": "add_bias_kv=True",
    "bias_v": "add_bias_kv=True",
}

PathLike = str | os.PathLike[str]


def init_weights(module: MultiHeadAttention, seed: int) -> None:
    """Deterministic init: same seed, bit-identical parameters on any device.

    Draws on a CPU generator in float32 and copies, because CUDA and CPU
    generators give different streams. Xavier-uniform weights as
    nn.MultiheadAttention; biases U(-BIAS_INIT_BOUND, BIAS_INIT_BOUND). MLA: its linears
    (q_a, q_b or q, kv_a, kv_b), then wo, then its norm gains q_a_norm, kv_a_norm. The
    output gate's wgate last (so a config without one draws as before).
    """
    g = torch.Generator(device="cpu").manual_seed(seed)
    if module.config.mla is not None:
        linears = [module._modules[n] for n in (*MLA_LINEARS, "wo") if n in module._modules]
        norms = [module._parameters[n] for n in MLA_NORMS if n in module._parameters]
    else:
        linears, norms = [module.wqkv, module.wo], [module.q_norm, module.k_norm]
    with torch.no_grad():
        for linear in linears:  # fixed draw order
            fan_out, fan_in = linear.weight.shape
            bound = math.sqrt(6.0 / (fan_in + fan_out))  # xavier_uniform_ with gain 1
            linear.weight.copy_(_uniform(linear.weight.shape, bound, g))
            if linear.bias is not None:
                linear.bias.copy_(_uniform(linear.bias.shape, BIAS_INIT_BOUND, g))
        for norm in norms:  # RMSNorm gains: 1 +- NORM_INIT_BOUND
            if norm is not None:
                norm.copy_(1.0 + _uniform(norm.shape, NORM_INIT_BOUND, g))
        if module.sinks is not None:  # (drawn last: other models' draws stay as they were)
            module.sinks.copy_(_uniform(module.sinks.shape, SINK_INIT_BOUND, g))
        if module.wgate is not None:  # (likewise, after them)
            wgate = module.wgate
            fan_out, fan_in = wgate.weight.shape
            wgate.weight.copy_(_uniform(wgate.weight.shape, math.sqrt(6.0 / (fan_in + fan_out)), g))
            if wgate.bias is not None:
                wgate.bias.copy_(_uniform(wgate.bias.shape, BIAS_INIT_BOUND, g))


def save_checkpoint(module: MultiHeadAttention, path: PathLike) -> None:
    """safetensors file: wqkv.weight, wqkv.bias, wo.weight, wo.bias (q_norm, k_norm with
    q/k norm; sinks with sinks; wgate.weight, wgate.bias with output_gate; MLA's own keys, model/mla.expected_shapes, instead of wqkv
    with mla) + config in metadata."""
    tensors = {k: t.detach().cpu().contiguous() for k, t in module.state_dict().items()}
    metadata = {"format": FORMAT, **to_metadata(module.config)}
    save_file(tensors, str(path), metadata=metadata)


def load_checkpoint(
    path: PathLike,
    *,
    config: AttentionConfig | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> MultiHeadAttention:
    """Load a safetensors checkpoint (never pickle) into a module in eval mode.

    Our layout takes its config from the file's metadata, or from `config`
    (which must then agree with the metadata). A torch.nn.MultiheadAttention
    state_dict saved with safetensors needs `config`: num_heads is not stored.
    dtype None keeps the checkpoint's dtype.
    """
    path = Path(path)
    tensors, metadata = _read_safetensors(path)
    if any(k in _TORCH_TO_OURS or k in _TORCH_UNSUPPORTED for k in tensors):
        if config is None:
            raise ValueError(
                f"{path} holds a torch.nn.MultiheadAttention state_dict; such a checkpoint "
                "needs num_heads: pass config=AttentionConfig(embed_dim=..., num_heads=...)"
            )
        state = torch_mha_state_dict_to_ours(tensors, config, source=str(path))
    else:
        stored = config_from_metadata(metadata, path)
        if stored is None and config is None:
            raise ValueError(
                f"{path} has no attention config in its metadata (keys {sorted(metadata)}); "
                "pass config=AttentionConfig(...)"
            )
        if stored is not None and config is not None and stored != config:
            diff = [
                f"{f.name} {getattr(config, f.name)} vs {getattr(stored, f.name)}"
                for f in fields(AttentionConfig)
                if getattr(config, f.name) != getattr(stored, f.name)
            ]
            raise ValueError(
                f"config passed to load_checkpoint {config} does not match the config in "
                f"{path} {stored}: differs in {', '.join(diff)} (passed vs stored); "
                "make the model's settings (e.g. its [[models]] table) match the checkpoint, "
                "or pass config=None to use the stored one"
            )
        config = config or stored
        _check_tensors(tensors, _expected_shapes(config), config, source=str(path))
        state = tensors

    if dtype is None:
        dtype = state["wo.weight"].dtype
    module = MultiHeadAttention(config, device=device, dtype=dtype)
    module.load_state_dict(state)
    check_sinks(module.sinks, f"{path}: key 'sinks'")
    return module.eval()


def torch_mha_state_dict_to_ours(
    state_dict: dict[str, torch.Tensor], config: AttentionConfig, *, source: str = "state_dict"
) -> dict[str, torch.Tensor]:
    """Rename a torch.nn.MultiheadAttention state_dict to our keys, checking shapes.

    add_zero_attn leaves no trace in a state_dict; use from_torch_mha to catch it.
    """
    if config.mla is not None:
        raise ValueError(
            "torch.nn.MultiheadAttention is plain MHA, but config has mla (multi-head latent "
            "attention); leave mla out"
        )
    unsupported = sorted(k for k in state_dict if k in _TORCH_UNSUPPORTED)
    if unsupported:
        why = sorted({_TORCH_UNSUPPORTED[k] for k in unsupported})
        raise ValueError(
            f"{source} is a torch.nn.MultiheadAttention with {' and '.join(why)} "
            f"(keys {unsupported}), which mha-serve does not support; "
            "only kdim == vdim == embed_dim and add_bias_kv=False can be imported"
        )
    if config.num_kv_heads != config.num_heads or (
        config.num_heads * config.head_dim != config.embed_dim
    ):
        raise ValueError(
            "torch.nn.MultiheadAttention is plain MHA with head_dim = embed_dim / num_heads, "
            f"but config has num_kv_heads {config.num_kv_heads}, head_dim {config.head_dim} "
            f"for embed_dim {config.embed_dim}, num_heads {config.num_heads}; "
            "leave num_kv_heads and head_dim unset"
        )
    ours_to_torch = {v: k for k, v in _TORCH_TO_OURS.items()}
    expected = {ours_to_torch[k]: shape for k, shape in _expected_shapes(config).items()}
    _check_tensors(state_dict, expected, config, source=source)
    return {_TORCH_TO_OURS[k]: t for k, t in state_dict.items()}


def from_torch_mha(mha: nn.MultiheadAttention) -> MultiHeadAttention:
    """Same weights, device and dtype as `mha`, in eval mode (we have no dropout)."""
    options = []
    if not mha._qkv_same_embed_dim:
        options.append(f"kdim {mha.kdim} / vdim {mha.vdim} != embed_dim {mha.embed_dim}")
    if mha.bias_k is not None:
        options.append("add_bias_kv=True")
    if mha.add_zero_attn:
        options.append("add_zero_attn=True")
    if options:
        raise ValueError(
            f"cannot import torch.nn.MultiheadAttention with {', '.join(options)}; "
            "mha-serve supports kdim == vdim == embed_dim, add_bias_kv=False, add_zero_attn=False"
        )
    config = AttentionConfig(
        embed_dim=mha.embed_dim, num_heads=mha.num_heads, bias=mha.in_proj_bias is not None
    )
    state = torch_mha_state_dict_to_ours(mha.state_dict(), config, source="nn.MultiheadAttention")
    w = mha.in_proj_weight
    module = MultiHeadAttention(config, device=w.device, dtype=w.dtype)
    module.load_state_dict(state)
    return module.eval()


def _expected_shapes(config: AttentionConfig) -> dict[str, tuple[int, ...]]:
    shapes = mla_shapes(config) if config.mla is not None else _mha_shapes(config)
    if config.output_gate:  # rows by query head (per dim, or one each), as wo's columns
        shapes["wgate.weight"] = (config.gate_width, config.embed_dim)
        if config.bias:
            shapes["wgate.bias"] = (config.gate_width,)
    return shapes


def _mha_shapes(config: AttentionConfig) -> dict[str, tuple[int, ...]]:
    shapes = {
        "wqkv.weight": (config.qkv_dim, config.embed_dim),
        "wo.weight": (config.embed_dim, config.num_heads * config.head_dim),
    }
    if config.bias:
        shapes["wqkv.bias"] = (config.qkv_dim,)
        shapes["wo.bias"] = (config.embed_dim,)
    if config.qk_norm is not None and config.qk_norm.gain:
        whole = config.qk_norm.scope == "projection"
        H, KVH, D = config.num_heads, config.num_kv_heads, config.head_dim
        shapes["q_norm"] = (H * D if whole else D,)
        shapes["k_norm"] = (KVH * D if whole else D,)
    if config.sinks:
        shapes["sinks"] = (config.num_heads,)
    return shapes


def _check_tensors(
    tensors: dict[str, torch.Tensor],
    expected: dict[str, tuple[int, ...]],
    config: AttentionConfig,
    *,
    source: str,
) -> None:
    """Report every missing, unexpected, wrong-shape or non-float key at once."""
    problems = []
    for key, shape in expected.items():
        if key not in tensors:
            problems.append(f"missing key {key!r} (expected shape {shape})")
        elif tuple(tensors[key].shape) != shape:
            problems.append(f"key {key!r} has shape {tuple(tensors[key].shape)}, expected {shape}")
        elif not tensors[key].is_floating_point():
            problems.append(f"key {key!r} has dtype {tensors[key].dtype}, expected a float")
    for key in sorted(set(tensors) - set(expected)):
        problems.append(f"unexpected key {key!r} (shape {tuple(tensors[key].shape)})")
    if problems:
        raise ValueError(f"{source} does not fit {config}: " + "; ".join(problems))


def _read_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path.absolute()} does not exist")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            metadata = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is no dict)
    except SafetensorError as e:
        raise ValueError(
            f"{path} is not a safetensors file ({e}); only safetensors is loaded, never "
            "pickle: convert a trusted .pt/.bin with safetensors.torch.save_file"
        ) from e
    return tensors, metadata


def _uniform(shape: torch.Size, bound: float, g: torch.Generator) -> torch.Tensor:
    return torch.empty(shape, dtype=torch.float32).uniform_(-bound, bound, generator=g)
