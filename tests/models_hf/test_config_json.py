"""config.json as checkpoints on the Hub write it, read as transformers reads it: a tiny
random checkpoint written by transformers, its config.json edited into a variant people
ship (transformers 4 keys beside 5's, keys left out), then the layer we load against
transformers' own attention module loaded from the same directory; what transformers would
not serve as we do is refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import (
    AutoConfig,
    Gemma2Config,
    Gemma2Model,
    Gemma3TextConfig,
    Gemma3TextModel,
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    Olmo2Config,
    Olmo3Config,
    Olmo3Model,
    Phi3Config,
    Phi3Model,
    Qwen2Config,
    Qwen2Model,
)

from mha_serve.model.hf import load_hf_layer
from mha_serve.model.hf_config import read_hf_layer
from tests.models_hf.reference import INIT, reference_attention

SMALL = {
    "hidden_size": 64,
    "num_attention_heads": 8,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "max_position_embeddings": 256,
    "vocab_size": 64,
    "initializer_range": 0.2,
}


def checkpoint(tmp_path, cls, config, **edits):
    """cls(config) saved by transformers with random biases (it writes zeros, where a bias
    mapped to the wrong rows would go unseen), then config.json's keys set (None: removed)."""
    torch.manual_seed(0)
    model = cls(config)
    with torch.no_grad():
        for key, parameter in model.named_parameters():
            if key.endswith(".bias"):
                parameter.normal_(0.0, INIT)
    model.save_pretrained(tmp_path, safe_serialization=True)
    path = tmp_path / "config.json"
    cfg = json.loads(path.read_text())
    for key, value in edits.items():
        cfg.pop(key, None) if value is None else cfg.__setitem__(key, value)
    path.write_text(json.dumps(cfg))
    return tmp_path


def assert_served_as_transformers(directory, cls, family, layer):
    base = cls.from_pretrained(directory, attn_implementation="eager").eval()
    base = getattr(base, "model", None) or base
    module, _ = load_hf_layer(directory, layer)
    x = torch.randn(1, 40, base.config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, _ = reference_attention(family, base, layer, x)
        got = module(x).output
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["yarn", "linear"])
def test_phi3_rope_scaling_other_than_longrope_is_refused(tmp_path, kind):
    # transformers' Phi-3 reads an old "yarn" (as "su") as longrope, and refuses any other
    # scaling: serving it as yarn or linear would be a layer transformers never runs.
    scaling = {"type": kind, "factor": 4.0, "original_max_position_embeddings": 64}
    if kind == "yarn":
        scaling.update({"short_factor": [1.0] * 4, "long_factor": [2.0] * 4})
    config = Phi3Config(num_key_value_heads=4, pad_token_id=0, **SMALL)
    directory = checkpoint(tmp_path, Phi3Model, config, rope_parameters=None, rope_scaling=scaling)
    with pytest.raises(ValueError, match=f"phi3 rope type '{kind}'"):
        load_hf_layer(directory, 0)


LINEAR = {"rope_type": "linear", "factor": 4.0}


@pytest.mark.parametrize(
    "edits",
    [
        # 5's table without rope_theta, 4's rope_theta beside it: transformers takes that
        {"rope_parameters": {"rope_type": "linear", "factor": 2.0}, "rope_theta": 500000.0},
        # both spellings: transformers takes 4's rope_scaling over 5's rope_parameters
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}, "rope_scaling": LINEAR},
    ],
    ids=["rope_theta_beside_rope_parameters", "rope_scaling_and_rope_parameters"],
)
def test_llama_rope_keys_are_resolved_as_transformers_does(tmp_path, edits):
    config = LlamaConfig(num_key_value_heads=2, **SMALL)
    directory = checkpoint(tmp_path, LlamaForCausalLM, config, **edits)
    assert_served_as_transformers(directory, LlamaForCausalLM, "llama", 0)


@pytest.mark.parametrize("layer", [0, 1], ids=["local", "global"])
def test_gemma3_rope_tables_without_rope_theta_take_the_layer_types_defaults(tmp_path, layer):
    # Gemma3TextConfig fills a table's missing rope_theta with rope_local_base_freq (1e4)
    # on local layers and rope_theta (1e6) on global ones
    config = Gemma3TextConfig(
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=6,
        layer_types=["sliding_attention", "full_attention"],
        **SMALL,
    )
    tables = {"sliding_attention": {"rope_type": "default"}, "full_attention": LINEAR}
    directory = checkpoint(
        tmp_path, Gemma3TextModel, config, rope_parameters=tables, rope_local_base_freq=3000.0
    )
    assert_served_as_transformers(directory, Gemma3TextModel, "gemma3_text", layer)


# Gemma 3 and OLMo 3 as transformers 5 reads their RoPE (Gemma3TextConfig's and
# Olmo3Config's convert_rope_params_to_dict): a table per layer type, each layer taking its
# type's table (their rotary_emb(x, positions, layer_type)).
PER_TYPE = {
    "gemma3_text": (
        Gemma3TextModel,
        lambda: Gemma3TextConfig(
            num_key_value_heads=2,
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=6,
            layer_types=["sliding_attention", "full_attention"],
            **SMALL,
        ),
    ),
    "olmo3": (
        Olmo3Model,
        lambda: Olmo3Config(
            num_key_value_heads=4,
            sliding_window=6,
            layer_types=["sliding_attention", "full_attention"],
            pad_token_id=1,
            **SMALL,
        ),
    ),
}


@pytest.mark.parametrize("family", list(PER_TYPE))
@pytest.mark.parametrize("layer", [0, 1], ids=["local", "global"])
@pytest.mark.parametrize(
    "edits",
    [
        # one layer type's table only: the other's is transformers' default for its type
        {"rope_parameters": {"full_attention": {**LINEAR, "rope_theta": 3000.0}}},
        {"rope_parameters": {"sliding_attention": {**LINEAR, "rope_theta": 3000.0}}},
        # 4.x's rope_scaling beside 5's tables: the global layers' table takes it, the
        # local layers' does not
        {
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 2000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 5000.0},
            },
            "rope_scaling": LINEAR,
        },
    ],
    ids=["global_table_only", "local_table_only", "rope_scaling_beside_tables"],
)
def test_rope_tables_per_layer_type_are_read_as_transformers_does(tmp_path, family, layer, edits):
    # (a missing table was refused, and rope_scaling went to a local table that had its
    # rope_theta: a linear RoPE where transformers' local layers have none)
    cls, config = PER_TYPE[family]
    directory = checkpoint(tmp_path, cls, config(), **edits)
    assert_served_as_transformers(directory, cls, family, layer)


@pytest.mark.parametrize("family", list(PER_TYPE))
@pytest.mark.parametrize(
    "tables",
    [
        {"rope_type": "linear", "factor": 2.0, "rope_theta": 3000.0},
        {  # (as transformers saves a flat table it has read: its keys beside the types')
            "rope_type": "linear",
            "factor": 2.0,
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 500000.0},
        },
    ],
    ids=["flat", "flat_beside_tables"],
)
def test_a_flat_rope_table_where_transformers_reads_one_per_layer_type_is_refused(
    tmp_path, family, tables
):
    # transformers 5 runs its per-type defaults and ignores the flat table's keys (we
    # served the flat table on every layer): which RoPE the checkpoint means is not clear
    cls, config = PER_TYPE[family]
    directory = checkpoint(tmp_path, cls, config(), rope_parameters=tables)
    for layer in (0, 1):
        with pytest.raises(ValueError, match="rope_parameters must hold a table per layer type"):
            read_hf_layer(directory, layer)


@pytest.mark.parametrize(
    ("cls", "config"),
    [
        (LlamaForCausalLM, LlamaConfig(num_key_value_heads=2, **SMALL)),
        (  # (it has layer_types: transformers takes the tables for its own, and fails)
            GptOssForCausalLM,
            GptOssConfig(
                num_key_value_heads=2,
                head_dim=16,
                sliding_window=6,
                num_local_experts=2,
                num_experts_per_tok=1,
                **SMALL,
            ),
        ),
    ],
    ids=["llama", "gpt_oss"],
)
def test_rope_tables_per_layer_type_where_the_family_reads_one_table_are_refused(
    tmp_path, cls, config
):
    # we served each layer its type's table; transformers' Llama runs its default RoPE
    # (10000, no scaling) on every layer whatever the tables say
    tables = {
        "full_attention": {**LINEAR, "rope_theta": 3000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 2000.0},
    }
    directory = checkpoint(tmp_path, cls, config, rope_parameters=tables)
    for layer in (0, 1):
        with pytest.raises(ValueError, match=r"rope_parameters holds tables per layer type \("):
            read_hf_layer(directory, layer)


@pytest.mark.parametrize("kind", ["yarn", "llama3"])
def test_original_max_position_embeddings_beside_rope_scaling_wins(tmp_path, kind):
    # transformers' standardize_rope_params: the top-level value over the table's own
    scaling = {"rope_type": kind, "factor": 4.0, "original_max_position_embeddings": 32}
    if kind == "llama3":
        scaling.update({"low_freq_factor": 1.0, "high_freq_factor": 4.0})
    config = LlamaConfig(num_key_value_heads=2, **SMALL)
    directory = checkpoint(
        tmp_path,
        LlamaForCausalLM,
        config,
        rope_parameters=None,
        rope_scaling=scaling,
        rope_theta=10000.0,
        original_max_position_embeddings=128,
    )
    assert_served_as_transformers(directory, LlamaForCausalLM, "llama", 0)


def test_gemma3_attn_logit_softcapping_is_refused(tmp_path):
    # Gemma3TextConfig keeps the key, but Gemma3Attention never passes it to the attention
    # (Gemma 3 dropped soft-capping for its q/k norms): capping would serve another layer
    config = Gemma3TextConfig(
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=6,
        attn_logit_softcapping=4.0,
        **SMALL,
    )
    directory = checkpoint(tmp_path, Gemma3TextModel, config)
    with pytest.raises(ValueError, match="attn_logit_softcapping 4.0"):
        load_hf_layer(directory, 0)
    directory = checkpoint(tmp_path, Gemma3TextModel, config, attn_logit_softcapping=None)
    assert_served_as_transformers(directory, Gemma3TextModel, "gemma3_text", 0)


@pytest.mark.parametrize(
    ("cls", "config", "family", "edits", "layer"),
    [
        # transformers' Gemma 2 caps at 50 when config.json has no attn_logit_softcapping
        (
            Gemma2Model,
            Gemma2Config(num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, **SMALL),
            "gemma2",
            {"attn_logit_softcapping": None},
            1,
        ),
        # use_sliding_window without max_window_layers: transformers slides from layer 28 on
        (
            Qwen2Model,
            Qwen2Config(num_key_value_heads=2, **SMALL),
            "qwen2",
            {
                "use_sliding_window": True,
                "sliding_window": 6,
                "max_window_layers": None,
                "layer_types": None,
            },
            1,
        ),
    ],
    ids=["gemma2_softcap", "qwen2_max_window_layers"],
)
def test_keys_left_out_are_read_with_transformers_defaults(
    tmp_path, cls, config, family, edits, layer
):
    directory = checkpoint(tmp_path, cls, config, **edits)
    assert_served_as_transformers(directory, cls, family, layer)


@pytest.mark.parametrize(
    ("config", "key", "ours"),
    [
        (MistralConfig(num_key_value_heads=2, **SMALL), "sliding_window", "sliding_window"),
        (Olmo2Config(num_key_value_heads=2, pad_token_id=1, **SMALL), "rms_norm_eps", "eps"),
        (GptOssConfig(num_key_value_heads=2, **SMALL), "sliding_window", "sliding_window"),
    ],
    ids=["mistral_sliding_window", "olmo2_rms_norm_eps", "gpt_oss_sliding_window"],
)
def test_options_left_out_take_transformers_defaults(tmp_path, config, key, ours):
    # (a window of 4096 and an eps of 1e-5 differ too little on a short input to test by
    # outputs: the values themselves are compared)
    path = tmp_path / "config.json"
    config.save_pretrained(tmp_path)
    cfg = json.loads(path.read_text())
    del cfg[key]
    path.write_text(json.dumps(cfg))
    attention = read_hf_layer(tmp_path, 0).attention
    got = attention.qk_norm.eps if ours == "eps" else attention.sliding_window
    assert got == getattr(AutoConfig.from_pretrained(tmp_path), key)


@pytest.mark.parametrize(
    ("scaling", "missing"),
    [
        ({"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}, "low_freq_factor"),
        ({"rope_type": "linear"}, "factor"),
    ],
)
def test_a_rope_table_missing_a_parameter_names_it(tmp_path, scaling, missing):
    # a bare KeyError ('low_freq_factor') or TypeError (float(None)) said neither where nor what
    config = LlamaConfig(num_key_value_heads=2, **SMALL)
    directory = checkpoint(tmp_path, LlamaForCausalLM, config, rope_parameters=None)
    cfg = json.loads((directory / "config.json").read_text())
    cfg["rope_scaling"] = scaling
    (directory / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=f"config.json: rope type .* needs {missing}"):
        read_hf_layer(directory, 0)


# GPT-OSS's config.json as openai/gpt-oss-20b ships it (transformers 4.55 keys): RoPE in
# rope_scaling with rope_theta beside, every layer's type listed.
GPT_OSS_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


def gpt_oss_checkpoint(tmp_path, **edits):
    config = GptOssConfig(
        num_key_value_heads=2, head_dim=16, sliding_window=6, num_local_experts=2,
        num_experts_per_tok=1, **SMALL,
    )  # fmt: skip
    return checkpoint(tmp_path, GptOssForCausalLM, config, **edits)


@pytest.mark.parametrize(
    "edits",
    [
        {"rope_parameters": None, "rope_scaling": GPT_OSS_ROPE, "rope_theta": 150000},
        {"rope_parameters": None, "layer_types": None, "attention_bias": None},
    ],
    ids=["as_shipped", "keys_left_out"],
)
def test_gpt_oss_as_shipped_and_with_keys_left_out_is_served_as_transformers(tmp_path, edits):
    """Both layer kinds (sliding 0, full 1: GptOssConfig's alternation when layer_types is
    left out), biases (attention_bias defaults to true), attention sinks (the tensor
    model.layers.N.self_attn.sinks of GptOssForCausalLM), YaRN RoPE with truncate false
    (GptOssConfig's when config.json has no RoPE table)."""
    directory = gpt_oss_checkpoint(tmp_path, **edits)
    for layer, window in ((0, 6), (1, None)):
        attention = read_hf_layer(directory, layer).attention
        assert (attention.sliding_window, attention.sinks, attention.bias) == (window, True, True)
        assert attention.rope.type == "yarn" and attention.rope.truncate is False
        assert_served_as_transformers(directory, GptOssForCausalLM, "gpt_oss", layer)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_gpt_oss_sinks_missing_or_not_finite_are_refused(tmp_path, bad):
    from safetensors.torch import load_file, save_file

    directory = gpt_oss_checkpoint(tmp_path)
    path = directory / "model.safetensors"
    tensors = load_file(path)
    name = "model.layers.1.self_attn.sinks"
    tensors[name][3] = bad
    save_file(tensors, path, metadata={"format": "pt"})
    load_hf_layer(directory, 0)  # layer 0's sinks are finite
    with pytest.raises(ValueError, match="layers.1.self_attn.sinks' holds NaN or Inf"):
        load_hf_layer(directory, 1)
    tensors[name][3] = 1e5  # finite in the checkpoint, inf in a float16 model
    save_file(tensors, path, metadata={"format": "pt"})
    assert load_hf_layer(directory, 1)[0].sinks[3] == 1e5
    with pytest.raises(ValueError, match="sinks' holds NaN or Inf as float16"):
        load_hf_layer(directory, 1, dtype=torch.float16)
    del tensors[name]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing tensor 'layers.1.self_attn.sinks' .*\(8,\)"):
        load_hf_layer(directory, 1)
