"""Loading one layer of a Hugging Face model directory: what config.json says, what is
refused (by name) at start-up, and the tensors' mapping (transformers-free: the files are
written here by hand; tests/models_hf checks parity against transformers itself)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from mha_serve.config import load_config_file
from mha_serve.engine import Engine
from mha_serve.model.config import RopeConfig
from mha_serve.model.hf import load_hf_layer
from mha_serve.model.hf_config import read_hf_layer
from mha_serve.spec import ModelSpec

LLAMA = {
    "model_type": "llama",
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "max_position_embeddings": 128,
}


def write(tmp_path, config, tensors, name="model.safetensors"):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    if tensors is not None:
        save_file(tensors, str(tmp_path / name))
    return tmp_path


def llama_tensors(layer=1, prefix="model.", kvh=2, bias=False):
    g = torch.Generator().manual_seed(layer)
    t = {}
    for p, rows in (("q", 32), ("k", kvh * 8), ("v", kvh * 8), ("o", 32)):
        t[f"{prefix}layers.{layer}.self_attn.{p}_proj.weight"] = torch.randn(rows, 32, generator=g)
        if bias:
            t[f"{prefix}layers.{layer}.self_attn.{p}_proj.bias"] = torch.randn(rows, generator=g)
    t[f"{prefix}embed_tokens.weight"] = torch.zeros(4, 32)
    return t


def test_llama_layer_maps_q_k_v_o_onto_the_fused_projection(tmp_path):
    tensors = llama_tensors()
    module, info = load_hf_layer(write(tmp_path, LLAMA, tensors), 1)
    c = module.config
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.causal, c.bias) == (4, 2, 8, True, False)
    assert c.rope == RopeConfig(theta=10000.0) and info.family == "llama"
    want = torch.cat([tensors[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(module.wqkv.weight, want)
    assert torch.equal(module.wo.weight, tensors["model.layers.1.self_attn.o_proj.weight"])


def test_qwen2_qkv_biases_and_no_o_bias(tmp_path):
    cfg = {**LLAMA, "model_type": "qwen2"}
    tensors = llama_tensors(bias=True, prefix="")
    del tensors["layers.1.self_attn.o_proj.bias"]
    module, _ = load_hf_layer(write(tmp_path, cfg, tensors), 1)
    assert module.config.bias and torch.all(module.wo.bias == 0)
    assert torch.equal(module.wqkv.bias[:32], tensors["layers.1.self_attn.q_proj.bias"])


def test_transformers_4_rope_keys_and_shards(tmp_path):
    """rope_theta + rope_scaling (transformers 4's config.json) and a sharded checkpoint."""
    cfg = {
        **LLAMA,
        "rope_theta": 500000.0,
        "rope_scaling": {"type": "linear", "factor": 4.0},
    }
    tensors = llama_tensors()
    names = sorted(tensors)
    write(tmp_path, cfg, {k: tensors[k] for k in names[:3]}, "model-00001-of-00002.safetensors")
    save_file(
        {k: tensors[k] for k in names[3:]}, str(tmp_path / "model-00002-of-00002.safetensors")
    )
    index = {
        "weight_map": {
            k: f"model-0000{1 + (i >= 3)}-of-00002.safetensors" for i, k in enumerate(names)
        }
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    module, _ = load_hf_layer(tmp_path, 1)
    assert module.config.rope == RopeConfig(theta=500000.0, type="linear", factor=4.0)


@pytest.mark.parametrize(
    ("config", "layer", "piece"),
    [
        ({**LLAMA, "model_type": "t5"}, 0, "model_type 't5'"),
        ({**LLAMA, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, 0, "'dynamic'"),
        ({**LLAMA, "rope_parameters": {"rope_type": "longrope"}}, 0, "'longrope'"),
        ({**LLAMA, "partial_rotary_factor": 0.5}, 0, "partial_rotary_factor"),
        ({**LLAMA}, 2, "layer must be an int in 0..1"),
        ({**LLAMA}, None, "set layer = N"),
        (
            {
                "model_type": "bert",
                "hidden_size": 32,
                "num_attention_heads": 4,
                "num_hidden_layers": 1,
                "position_embedding_type": "relative_key",
            },
            0,
            "'relative_key'",
        ),
        ({**LLAMA, "num_attention_heads": 5}, 0, "num_kv_heads 2 must divide num_heads 5"),
    ],
)
def test_unsupported_architectures_and_options_are_refused_by_name(tmp_path, config, layer, piece):
    with pytest.raises(ValueError) as err:
        read_hf_layer(write(tmp_path, config, None), layer)
    assert piece in str(err.value), str(err.value)


def test_missing_or_misshaped_tensors_and_pickle_are_start_up_errors(tmp_path):
    tensors = llama_tensors()
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    with pytest.raises(ValueError, match=r"missing tensor 'layers.1.self_attn.k_proj.weight'"):
        load_hf_layer(write(tmp_path / "a", LLAMA, tensors), 1)
    tensors = llama_tensors(kvh=4)  # k/v for 4 KV heads, config says 2
    with pytest.raises(
        ValueError, match=r"k_proj.weight' has shape \(32, 32\), expected \(16, 32\)"
    ):
        load_hf_layer(write(tmp_path / "b", LLAMA, tensors), 1)
    write(tmp_path / "c", LLAMA, None)
    (tmp_path / "c" / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ValueError, match="never pickle"):
        load_hf_layer(tmp_path / "c", 1)


def test_config_file_and_engine_serve_a_directory_layer(tmp_path):
    d = write(
        tmp_path / "llama",
        {**LLAMA, "model_type": "mistral", "sliding_window": 64},
        llama_tensors(),
    )
    toml = tmp_path / "models.toml"
    toml.write_text('[[models]]\nname = "m"\ncheckpoint = "llama"\nlayer = 1\n')
    _, (spec,) = load_config_file(toml)
    assert spec.layer == 1 and spec.attention.rope is not None and spec.attention.num_kv_heads == 2
    engine = Engine(
        [spec], device=torch.device("cpu"), dtype=torch.float32, max_response_bytes=2**24
    )
    hosted = engine.get("m")  # max_seq_len is the context, not the window (issue 26)
    assert hosted.spec.max_seq_len == 4096 and hosted.module.config.sliding_window == 64
    toml.write_text('[[models]]\nname = "m"\ncheckpoint = "llama"\nlayer = 1\nnum_heads = 4\n')
    with pytest.raises(ValueError, match=r"remove \['num_heads'\]"):
        load_config_file(toml)
    toml.write_text('[[models]]\nname = "m"\nembed_dim = 8\nnum_heads = 2\nlayer = 1\n')
    with pytest.raises(ValueError, match="layer is for a Hugging Face model directory"):
        load_config_file(toml)
    bad = ModelSpec("m", spec.attention.__class__(32, 4), checkpoint=str(d), layer=1)
    with pytest.raises(ValueError, match="leave the attention keys out"):
        Engine([bad], device=torch.device("cpu"), dtype=torch.float32, max_response_bytes=2**24)


GEMMA3 = {
    "model_type": "gemma3_text",
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "num_hidden_layers": 2,
    "max_position_embeddings": 128,
    "query_pre_attn_scalar": 64,
    "sliding_window": 6,
    "layer_types": ["sliding_attention", "full_attention"],
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
    },
}


def gemma3_tensors(prefix: str, layer: int = 0, kvh: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(layer)
    t = {}
    for p, rows, cols in (("q", 64, 32), ("k", kvh * 16, 32), ("v", kvh * 16, 32), ("o", 32, 64)):
        t[f"{prefix}layers.{layer}.self_attn.{p}_proj.weight"] = torch.randn(
            rows, cols, generator=g
        )
    for p in "qk":
        t[f"{prefix}layers.{layer}.self_attn.{p}_norm.weight"] = torch.randn(16, generator=g)
    return t


def test_gemma3_per_layer_type_rope_window_scale_and_offset_norm(tmp_path):
    tensors = gemma3_tensors("model.")
    local, _ = load_hf_layer(write(tmp_path / "a", GEMMA3, tensors), 0)
    c = local.config
    assert (c.sliding_window, c.softmax_scale, c.qk_norm.scope) == (6, 64**-0.5, "head")
    assert c.rope == RopeConfig(theta=10000.0)
    # Gemma3RMSNorm scales by 1 + weight: folded into the served gain
    want = 1.0 + tensors["model.layers.0.self_attn.q_norm.weight"]
    assert torch.equal(local.q_norm, want)
    glob = read_hf_layer(tmp_path / "a", 1).attention
    assert glob.sliding_window is None and glob.rope == RopeConfig(
        theta=1e6, type="linear", factor=8.0
    )


def test_gemma3_multimodal_reads_its_text_model_only(tmp_path):
    """model_type gemma3: text_config, and the language model's tensors beside a vision
    tower whose layers carry the same names."""
    cfg = {"model_type": "gemma3", "text_config": GEMMA3, "vision_config": {}}
    tensors = gemma3_tensors("model.language_model.")
    tensors.update(gemma3_tensors("model.vision_tower.vision_model.encoder."))
    module, info = load_hf_layer(write(tmp_path, cfg, tensors), 0)
    assert info.family == "gemma3" and info.tensor_scope == "language_model"
    want = tensors["model.language_model.layers.0.self_attn.k_proj.weight"]
    assert torch.equal(module.wqkv.weight[64:80], want)


def test_gemma3_transformers_4_rope_keys(tmp_path):
    cfg = {k: v for k, v in GEMMA3.items() if k not in ("rope_parameters", "layer_types")}
    cfg.update(rope_theta=1e6, rope_local_base_freq=10000.0, sliding_window_pattern=2)
    cfg["rope_scaling"] = {"rope_type": "linear", "factor": 8.0}
    local = read_hf_layer(write(tmp_path, cfg, None), 0).attention
    glob = read_hf_layer(tmp_path, 1).attention
    assert local.sliding_window == 6 and local.rope == RopeConfig(theta=10000.0)
    assert glob.sliding_window is None
    assert glob.rope == RopeConfig(theta=1e6, type="linear", factor=8.0)


def test_phi3_fused_qkv_and_window(tmp_path):
    cfg = {**LLAMA, "model_type": "phi3", "sliding_window": 16}
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(32 + 2 * 16, 32, generator=g)
    tensors = {
        "model.layers.1.self_attn.qkv_proj.weight": qkv,
        "model.layers.1.self_attn.o_proj.weight": torch.randn(32, 32, generator=g),
    }
    module, _ = load_hf_layer(write(tmp_path, cfg, tensors), 1)
    assert torch.equal(module.wqkv.weight, qkv) and module.config.sliding_window == 16


@pytest.mark.parametrize(
    ("config", "layer", "piece"),
    [
        ({**GEMMA3, "use_bidirectional_attention": True}, 0, "use_bidirectional_attention"),
        (
            {**GEMMA3, "layer_types": ["chunked_attention", "full_attention"]},
            0,
            "layer type 'chunked_attention'",
        ),
        (  # (a flat table: transformers 5 ignores it for its per-type defaults)
            {**GEMMA3, "rope_parameters": {"rope_type": "linear", "factor": 2.0}},
            0,
            "rope_parameters must hold a table per layer type",
        ),
        ({**GEMMA3, "sliding_window": None}, 0, "sets sliding_window to null"),
        ({**GEMMA3, "query_pre_attn_scalar": 0}, 0, "query_pre_attn_scalar must be a positive"),
        ({**GEMMA3, "model_type": "gemma3", "text_config": None}, 0, "gemma3 has no text_config"),
        # (Llama 4 is served since: its text model, which a llama4 config without one lacks)
        ({**LLAMA, "model_type": "llama4"}, 0, "llama4 has no text_config table"),
    ],
)
def test_unsupported_family_options_are_refused_by_name(tmp_path, config, layer, piece):
    with pytest.raises(ValueError) as err:
        read_hf_layer(write(tmp_path, config, None), layer)
    assert piece in str(err.value), str(err.value)
