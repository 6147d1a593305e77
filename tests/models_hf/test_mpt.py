"""MPT's config.json as MptConfig reads it (d_model, n_heads, n_layers; hidden_size,
num_attention_heads, num_hidden_layers win where set; attn_config a table whose keys left
out, or itself null, are MptAttentionConfig's defaults), served equal to MptAttention; what
transformers and MosaicML's own code would compute differently, or what transformers
builds no layer from, is refused by name. (Parity over gRPC, sessions and transformers'
incremental decode: the "mpt" checkpoint of reference.py, in the shared tests.)"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, MptConfig, MptForCausalLM

from mha_serve.model.hf import load_hf_layer
from mha_serve.model.hf_config import read_hf_layer
from tests.models_hf.reference import reference_attention
from tests.models_hf.test_config_json import checkpoint

MPT = {"d_model": 96, "n_heads": 12, "n_layers": 2, "max_seq_len": 64, "vocab_size": 64}


def _served_as_transformers(directory, layer, E, L=20):
    base = MptForCausalLM.from_pretrained(directory).eval().transformer
    module, _ = load_hf_layer(directory, layer)
    x = torch.randn(1, L, E, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, want_w = reference_attention("mpt", base, layer, x)
        got = module(x, need_weights=True)
    torch.testing.assert_close(got.output, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.weights, want_w, atol=1e-5, rtol=1e-5)


def test_attribute_map_names_win_as_mpt_config_reads_them(tmp_path):
    """hidden_size, num_attention_heads, num_hidden_layers (MptConfig's attribute_map) over
    decoy d_model, n_heads, n_layers: 6 heads of 8 and 3 layers here; max_seq_len is the
    context (MptModel's ALiBi covers no more keys)."""
    checkpoint_dir = checkpoint(
        tmp_path,
        MptForCausalLM,
        MptConfig(**{**MPT, "d_model": 48, "n_heads": 6, "n_layers": 3}),
        d_model=64,
        hidden_size=48,
        n_heads=4,
        num_attention_heads=6,
        n_layers=2,
        num_hidden_layers=3,
    )
    theirs = AutoConfig.from_pretrained(checkpoint_dir)
    assert (theirs.d_model, theirs.n_heads, theirs.n_layers) == (48, 6, 3)
    read = read_hf_layer(checkpoint_dir, 2)
    assert (read.attention.embed_dim, read.attention.num_heads, read.num_layers) == (48, 6, 3)
    assert read.attention.alibi and read.attention.rope is None and not read.attention.bias
    assert read.max_position_embeddings == 64
    _served_as_transformers(checkpoint_dir, 2, 48)


@pytest.mark.parametrize("attn_config", [None, {}, {"attn_impl": "triton", "attn_pdrop": 0}])
def test_attn_config_null_or_partial_takes_mpt_attention_config_defaults(tmp_path, attn_config):
    """No attn_config, an empty one, or one with only some keys: ALiBi (bias_max 8) and scale
    1 / sqrt(head_dim), as MptAttentionConfig fills them in."""
    checkpoint_dir = checkpoint(
        tmp_path, MptForCausalLM, MptConfig(**MPT), attn_config=attn_config or {}
    )
    if attn_config is None:
        path = checkpoint_dir / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "attn_config": None}))
    read = read_hf_layer(checkpoint_dir, 1)
    assert read.attention.alibi and read.attention.alibi_bias_max == 8
    assert read.attention.scale == pytest.approx(8**-0.5)
    _served_as_transformers(checkpoint_dir, 1, 96)


@pytest.mark.parametrize(
    ("edits", "attn", "piece"),
    [
        ({"no_bias": False}, {}, "mpt no_bias false is not supported"),
        ({}, {"alibi_bias_max": 4}, "attn_config.alibi_bias_max 4 is not supported"),
        ({}, {"alibi": False}, "attn_config.alibi False is not supported"),
        ({}, {"qk_ln": True}, "attn_config.qk_ln True is not supported"),
        ({}, {"clip_qkv": 6.0}, "attn_config.clip_qkv 6.0 is not supported"),
        ({}, {"prefix_lm": True}, "attn_config.prefix_lm True is not supported"),
        (
            {},
            {"attn_type": "multiquery_attention"},
            "attn_config.attn_type 'multiquery_attention' is not supported",
        ),
        ({}, {"attn_impl": "xformers"}, "attn_config.attn_impl 'xformers' is not supported"),
        ({}, {"rope": True}, "attn_config.rope True is not supported"),
        ({}, {"fused_qkv": False}, "attn_config.fused_qkv False is not supported"),
        ({}, {"sliding_window_size": 16}, "attn_config.sliding_window_size 16 is not"),
        ({}, {"softmax_scale": -1.0}, "attn_config.softmax_scale must be a positive number"),
        ({"d_model": 100}, {}, "d_model 100 is not divisible by n_heads 12"),
        ({}, {"alibi_bias_max": None}, "config.json sets attn_config.alibi_bias_max to null"),
        ({"attn_config": [1]}, None, "mpt attn_config must be a table"),
    ],
    ids=[
        *("no_bias", "alibi_bias_max", "alibi_off", "qk_ln", "clip_qkv", "prefix_lm"),
        *("multiquery", "attn_impl", "rope", "unfused", "sliding_window", "scale"),
        *("indivisible", "bias_max_null", "attn_config_list"),
    ],
)
def test_what_mpt_cannot_serve_exactly_is_refused_by_name(tmp_path, edits, attn, piece):
    MptConfig(**MPT).save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    cfg = {**json.loads(path.read_text()), **edits}
    if attn is not None:
        cfg["attn_config"] = {**cfg["attn_config"], **attn}
    path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as err:
        read_hf_layer(tmp_path, 0)
    assert piece in str(err.value), str(err.value)
