"""Gemma 3n's and Gemma 4's attention layers (values RMS-normed without a gain, q/k norm with
a gain of weight, scale 1.0; Gemma 4's global layers with their own head_dim and KV heads,
values from k_proj, proportional RoPE) against transformers' own attention modules loaded
from the same directory: the sizes as config.json gives them (per_layer_config, or
global_head_dim beside it), the multimodal wrappers' language models, Gemma 4 Unified's; and
what one served layer cannot be refused by name: KV-shared layers (naming the layers that own
their K/V, as transformers' kv_sharing_modes say), bidirectional attention, other RoPE
types, per-layer keys not read. (Parity over gRPC, sessions and the null sweep are the
shared tests', on reference.CHECKPOINTS' gemma4 and gemma3n.)"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoConfig,
    Gemma3nTextConfig,
    Gemma3nTextModel,
    Gemma4Config,
    Gemma4ForConditionalGeneration,
    Gemma4TextConfig,
    Gemma4TextModel,
    Gemma4UnifiedTextConfig,
    Gemma4UnifiedTextModel,
)

from mha_serve.model.hf import load_hf_layer
from mha_serve.model.hf_config import read_hf_layer
from tests.models_hf.reference import GEMMA_V_NORM, INIT

L = 20  # tokens: past the local layers' window of 6
SMALL = {k: v for k, v in GEMMA_V_NORM.items() if k not in ("layer_types", "num_hidden_layers")}
GEMMA4 = {
    "num_key_value_heads": 2,
    "head_dim": 16,
    "global_head_dim": 32,
    "num_global_key_value_heads": 1,
    "attention_k_eq_v": True,
    "hidden_size_per_layer_input": 0,
}
GEMMA3N = {"head_dim": 16, "hidden_size_per_layer_input": 8, "laurel_rank": 4}
GEMMA3N["altup_num_inputs"] = 2


def _save(directory, model) -> None:
    """model saved with random biases and q/k gains around 1 (a gain read as 1 + w, or
    none, would show)."""
    with torch.no_grad():
        for key, parameter in model.named_parameters():
            if key.endswith(".bias"):
                parameter.normal_(0.0, INIT)
            if key.endswith(("q_norm.weight", "k_norm.weight")):
                parameter.normal_(1.0, INIT)
    model.save_pretrained(directory, safe_serialization=True)


def _shared_kv_states(base):
    """The dict a layer that owns K/V stores them in (kv_sharing_modes "store"): never read
    here (a layer that would read it is refused)."""
    return {"shared_kv_states": {}}


@torch.no_grad()
def _their_layer(base, layer: int, x: torch.Tensor) -> torch.Tensor:
    """transformers' attention module of `layer` over x (1, L, E), as its model calls it: the
    layer type's cos and sin, its causal (and sliding) mask."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    kind = base.config.layer_types[layer]
    positions = torch.arange(x.shape[1])[None]
    make = create_sliding_window_causal_mask if kind == "sliding_attention" else create_causal_mask
    mask = make(
        config=base.config,
        inputs_embeds=x,
        attention_mask=None,
        past_key_values=None,
        position_ids=positions,
        allow_is_causal_skip=False,
    )
    return base.layers[layer].self_attn(
        x,
        position_embeddings=base.rotary_emb(x, positions, kind),
        attention_mask=mask,
        **_shared_kv_states(base),
    )[0]


def assert_served(directory, base, layer: int) -> None:
    module, _ = load_hf_layer(directory, layer)
    E = base.config.hidden_size
    x = torch.randn(1, L, E, generator=torch.Generator().manual_seed(layer + 1))
    want = _their_layer(base, layer, x)
    with torch.no_grad():
        got = module(x, causal=True).output
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _checkpoint(tmp_path, cls, config, **edits):
    torch.manual_seed(0)
    _save(tmp_path, cls(config))
    path = tmp_path / "config.json"
    cfg = {**json.loads(path.read_text()), **edits}
    for key, value in edits.items():
        if value is _GONE:
            del cfg[key]
    path.write_text(json.dumps(cfg))
    return tmp_path


_GONE = object()


@pytest.mark.parametrize("layer", [0, 1, 2, 3])
@pytest.mark.parametrize(
    "sizes", ["per_layer_config", "global_head_dim"], ids=["per_layer_config", "legacy"]
)
def test_gemma4_layers_take_their_own_sizes_and_values_from_k_proj(tmp_path, layer, sizes):
    """Two local layers (heads of 16, 2 KV heads) and two global ones (heads of 32, 1 KV head,
    no v_proj: values v_norm(k_proj(x)), proportional RoPE), read from per_layer_config as
    transformers 5.23 writes it, or from global_head_dim and num_global_key_value_heads
    beside no per_layer_config (as Gemma4TextConfig builds it from them)."""
    types = ["sliding_attention", "full_attention"] * 2
    config = Gemma4TextConfig(num_hidden_layers=4, layer_types=types, **GEMMA4, **SMALL)
    edits = {}
    if sizes == "global_head_dim":
        edits = {"per_layer_config": _GONE, "global_head_dim": 32}
        edits["num_global_key_value_heads"] = 1
    directory = _checkpoint(tmp_path, Gemma4TextModel, config, **edits)
    info = read_hf_layer(directory, layer)
    a = info.attention
    global_ = layer % 2 == 1
    assert (a.head_dim, a.num_kv_heads, info.values_from_keys) == (
        (32, 1, True) if global_ else (16, 2, False)
    )
    assert a.v_norm and a.softmax_scale == 1.0 and a.qk_norm.scope == "head"
    assert (a.rope.type, a.rope.partial) == (("proportional", 0.25) if global_ else ("default", 1))
    assert a.sliding_window == (None if global_ else 6)
    base = Gemma4TextModel.from_pretrained(directory, attn_implementation="eager").eval()
    assert_served(directory, base, layer)


@pytest.mark.parametrize(
    ("cls", "config_cls", "own"),
    [
        (Gemma4TextModel, Gemma4TextConfig, GEMMA4),
        (Gemma4UnifiedTextModel, Gemma4UnifiedTextConfig, GEMMA4),  # ("vision": causal text)
        (Gemma3nTextModel, Gemma3nTextConfig, GEMMA3N),
    ],
    ids=["gemma4_text", "gemma4_unified_text", "gemma3n_text"],
)
def test_kv_shared_layers_are_refused_naming_the_layers_that_own_their_kv(
    tmp_path, cls, config_cls, own
):
    """The last num_kv_shared_layers layers have no k_proj or v_proj: each reads the K/V of
    the last earlier layer of its type (transformers' kv_sharing_modes "reuse"). Those are
    refused, naming that layer and the layers that own their K/V; the others are served."""
    types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    types += ["sliding_attention", "full_attention"]
    config = config_cls(num_hidden_layers=6, layer_types=types, **own, **SMALL)
    config.num_kv_shared_layers = 3
    directory = _checkpoint(tmp_path, cls, config)
    modes = AutoConfig.from_pretrained(directory).kv_sharing_modes
    assert modes[3:] == ["reuse"] * 3
    base = cls.from_pretrained(directory, attn_implementation="eager").eval()
    for layer in range(6):
        if modes[layer] == "reuse":
            owner = 2 if types[layer] == "sliding_attention" else 1
            with pytest.raises(ValueError) as err:
                read_hf_layer(directory, layer)
            message = str(err.value)
            assert f"reuses the keys and values of layer {owner}" in message, message
            assert "the layers with their own K/V are 0..2" in message, message
        else:
            assert_served(directory, base, layer)


def _wrapped(tmp_path, wrapper: str, text_dir, text_config: dict) -> None:
    """A multimodal checkpoint's files from a text model's: its tensors under
    model.language_model., its config a text_config under the wrapper's model_type."""
    tensors = load_file(str(text_dir / "model.safetensors"))
    renamed = {"model.language_model." + k.removeprefix("model."): t for k, t in tensors.items()}
    # a tower's attention beside it, which must not be read
    renamed["model.vision_tower.encoder.layers.0.self_attn.q_proj.weight"] = torch.zeros(8, 8)
    save_file(renamed, str(tmp_path / "model.safetensors"))
    cfg = {"model_type": wrapper, "text_config": text_config, "architectures": ["X"]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    ("wrapper", "cls", "config_cls", "own"),
    [
        ("gemma3n", Gemma3nTextModel, Gemma3nTextConfig, GEMMA3N),
        ("gemma4_unified", Gemma4UnifiedTextModel, Gemma4UnifiedTextConfig, GEMMA4),
    ],
)
@pytest.mark.parametrize("layer", [0, 1])
def test_multimodal_wrappers_serve_their_language_model(
    tmp_path, wrapper, cls, config_cls, own, layer
):
    config = config_cls(**{**own, **GEMMA_V_NORM})
    text_dir = _checkpoint(tmp_path / "text", cls, config)
    _wrapped(tmp_path, wrapper, text_dir, json.loads((text_dir / "config.json").read_text()))
    info = read_hf_layer(tmp_path, layer)
    assert info.family == wrapper and info.tensor_scope == "language_model"
    base = cls.from_pretrained(text_dir, attn_implementation="eager").eval()
    assert_served(tmp_path, base, layer)


@pytest.mark.parametrize("layer", [0, 1])
def test_gemma4_serves_its_language_model_not_its_towers(tmp_path, layer):
    text = Gemma4TextConfig(**{**GEMMA4, **GEMMA_V_NORM})
    torch.manual_seed(0)
    _save(tmp_path, Gemma4ForConditionalGeneration(Gemma4Config(text_config=text.to_dict())))
    model = Gemma4ForConditionalGeneration.from_pretrained(tmp_path, attn_implementation="eager")
    info = read_hf_layer(tmp_path, layer)
    assert info.family == "gemma4" and info.values_from_keys == (layer == 1)
    assert_served(tmp_path, model.eval().model.language_model, layer)


@pytest.mark.parametrize(
    ("edits", "piece"),
    [
        # every token both ways (and a window halved plus one): served causal, so refused
        ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention 'all'"),
        # RoPE types transformers 5 would run but that are not read here
        (
            {
                "rope_parameters": {
                    "sliding_attention": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0},
                    "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                }
            },
            "rope_parameters.sliding_attention.rope_type 'linear' is not supported",
        ),
        # a per-layer key Gemma4TextAttention does not read per layer
        (
            {"per_layer_config": {"0": {"sliding_window": 4}}},
            "per_layer_config[0] sets sliding_window, which is not supported",
        ),
    ],
    ids=["bidirectional_all", "rope_linear", "per_layer_window"],
)
def test_gemma4_variants_not_served_are_refused_naming_the_key(tmp_path, edits, piece):
    Gemma4TextConfig(**{**GEMMA4, **GEMMA_V_NORM}).save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **edits}))
    with pytest.raises(ValueError) as err:
        read_hf_layer(tmp_path, 0)
    assert piece in str(err.value), str(err.value)


def test_gemma4_local_layers_of_other_sizes_are_refused_as_transformers_builds_none(tmp_path):
    """Its rotary embedding reads one config per layer type: local layers of two head sizes
    build no model (transformers raises), so neither is served."""
    types = ["sliding_attention", "sliding_attention", "full_attention"]
    Gemma4TextConfig(num_hidden_layers=3, layer_types=types, **{**GEMMA4, **SMALL}).save_pretrained(
        tmp_path
    )
    path = tmp_path / "config.json"
    cfg = json.loads(path.read_text())
    cfg["per_layer_config"] = {**cfg["per_layer_config"], "1": {"head_dim": 8}}
    path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError):
        Gemma4TextModel(AutoConfig.from_pretrained(tmp_path))
    for layer in (0, 1):
        with pytest.raises(ValueError, match="reads one config per layer type"):
            read_hf_layer(tmp_path, layer)
