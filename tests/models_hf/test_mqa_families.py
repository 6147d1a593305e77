"""The classic multi-query families, Falcon (FalconAttention) and GPT-BigCode (StarCoder 1,
SantaCoder: GPTBigCodeAttention): each layout of their fused q/k/v projection, as config.json
selects it, against transformers' attention loaded from the same directory; and what
transformers builds no layer from, or we cannot serve exactly, refused by name. (The
reference checkpoints' parity over gRPC, sessions and incremental decode are
test_parity_grpc's and test_sessions_cache's; their nulls test_config_nulls'.)"""

from __future__ import annotations

import pytest
from transformers import (
    FalconConfig,
    FalconModel,
    GPT2Config,
    GPT2Model,
    GPTBigCodeConfig,
    GPTBigCodeModel,
)

from mha_serve.model.hf_config import read_hf_layer
from tests.models_hf.test_config_json import SMALL, assert_served_as_transformers, checkpoint
from tests.models_hf.test_families import _config_only

FALCON = {k: v for k, v in SMALL.items() if k != "intermediate_size"}
BIGCODE = {"n_embd": 64, "n_head": 8, "n_layer": 2, "n_positions": 256, "vocab_size": 64}
BIGCODE["initializer_range"] = SMALL["initializer_range"]


@pytest.mark.parametrize(
    ("config", "edits", "layer", "kv_heads"),
    [
        # neither multi_query nor the new decoder: MHA, rows per head [q_h; k_h; v_h]
        (FalconConfig(multi_query=False, bias=True, **FALCON), {}, 1, 8),
        # the new decoder architecture (Falcon-40B): [q x 4, k, v] per KV head
        (FalconConfig(new_decoder_architecture=True, num_kv_heads=2, **FALCON), {}, 0, 2),
        # ... without num_kv_heads: one per query head (FalconConfig's default), [q, k, v]
        (
            FalconConfig(new_decoder_architecture=True, bias=True, **FALCON),
            {"num_kv_heads": None},
            1,
            8,
        ),
        # multi_query left out: FalconConfig's default (true), whatever num_kv_heads says
        (
            FalconConfig(multi_query=True, bias=True, **FALCON),
            {"multi_query": None, "num_kv_heads": 4},
            0,
            1,
        ),
        # n_embed, FalconConfig's old name for hidden_size, wins over it where set
        (FalconConfig(multi_query=True, **FALCON), {"n_embed": 64, "hidden_size": 32}, 1, 1),
        # transformers 4's rope_theta beside no table
        (
            FalconConfig(multi_query=True, **FALCON),
            {"rope_parameters": None, "rope_theta": 500.0},
            0,
            1,
        ),
    ],
    ids=["mha", "new_decoder_gqa", "new_decoder_mha", "multi_query_default", "n_embed", "v4"],
)
def test_falcon_layouts_are_served_as_transformers_runs_them(
    tmp_path, config, edits, layer, kv_heads
):
    directory = checkpoint(tmp_path, FalconModel, config, **edits)
    assert read_hf_layer(directory, layer).attention.num_kv_heads == kv_heads
    assert_served_as_transformers(directory, FalconModel, "falcon", layer)


@pytest.mark.parametrize(
    ("config", "edits", "piece"),
    [
        # FalconConfig computes head_dim and rotary: transformers loads no config.json that
        # sets them (a property without a setter), even to what it computes
        (FalconConfig(**FALCON), {"head_dim": 8}, "falcon config.json sets head_dim (8)"),
        (FalconConfig(**FALCON), {"rotary": True}, "falcon config.json sets rotary (True)"),
        # MHA with num_kv_heads other than the heads: FalconAttention's view of its keys fails
        (
            FalconConfig(multi_query=False, **FALCON),
            {"num_kv_heads": 4},
            "falcon num_kv_heads 4 without multi_query or new_decoder_architecture",
        ),
        # the new decoder's groups need num_kv_heads to divide the heads
        (
            FalconConfig(new_decoder_architecture=True, **FALCON),
            {"num_kv_heads": 3},
            "falcon num_kv_heads must be a positive int dividing num_attention_heads (8)",
        ),
        (
            FalconConfig(**FALCON),
            {"hidden_size": 68},
            "hidden_size 68 is not divisible by num_attention_heads 8",
        ),
    ],
    ids=["head_dim", "rotary", "mha_num_kv_heads", "new_decoder_num_kv_heads", "E%H"],
)
def test_falcon_variants_we_cannot_serve_exactly_are_refused_by_name(
    tmp_path, config, edits, piece
):
    for layer in (0, 1):
        with pytest.raises(ValueError) as err:
            read_hf_layer(_config_only(tmp_path, config, **edits), layer)
        assert piece in str(err.value), str(err.value)


@pytest.mark.parametrize(
    ("cls", "config", "edits", "layer", "kv_heads"),
    [
        # MHA (multi_query false): c_attn's rows per head [q_h; k_h; v_h]; config.json's
        # num_key_value_heads is GPTBigCodeConfig's own (from multi_query), not read
        (
            GPTBigCodeModel,
            GPTBigCodeConfig(multi_query=False, **BIGCODE),
            {"num_key_value_heads": 1},
            1,
            8,
        ),
        # scale_attn_weights false: a scale of 1, not head_dim ** -0.5
        (
            GPTBigCodeModel,
            GPTBigCodeConfig(multi_query=False, scale_attn_weights=False, **BIGCODE),
            {},
            0,
            8,
        ),
        # multi_query left out: GPTBigCodeConfig's default (true); the float32 softmax
        # switches change no math (transformers 5 softmaxes in float32 whatever they say)
        (
            GPTBigCodeModel,
            GPTBigCodeConfig(**BIGCODE),
            {
                "multi_query": None,
                "attention_softmax_in_fp32": False,
                "scale_attention_softmax_in_fp32": False,
            },
            0,
            1,
        ),
        # GPT-2's names beside hidden_size, ...: those win (their configs' attribute_map):
        # 4 heads, not n_head's 8; 2 layers, not n_layer's 1. (GPT-2 was served with n_head's:
        # the same weights' shapes, another layer, answered OK)
        *[
            (
                cls,
                config,
                {"n_head": 8, "num_attention_heads": 4, "n_layer": 1, "num_hidden_layers": 2},
                1,
                4,
            )
            for cls, config in (
                (GPTBigCodeModel, GPTBigCodeConfig(multi_query=False, **{**BIGCODE, "n_head": 4})),
                (GPT2Model, GPT2Config(**{**BIGCODE, "n_head": 4})),
            )
        ],
    ],
    ids=["mha", "unscaled", "multi_query_default", "gpt2_names", "gpt2_names_gpt2"],
)
def test_gpt_bigcode_layouts_are_served_as_transformers_runs_them(
    tmp_path, cls, config, edits, layer, kv_heads
):
    directory = checkpoint(tmp_path, cls, config, **edits)
    assert read_hf_layer(directory, layer).attention.num_kv_heads == kv_heads
    assert_served_as_transformers(directory, cls, config.model_type, layer)


@pytest.mark.parametrize(
    ("config", "edits", "piece"),
    [
        (
            GPTBigCodeConfig(multi_query=False, **BIGCODE),
            {"add_cross_attention": True},
            "gpt_bigcode add_cross_attention is not supported (self-attention only)",
        ),
        (
            GPTBigCodeConfig(**BIGCODE),
            {"n_embd": 68},
            "embed_dim 68 is not divisible by num_heads 8",
        ),
    ],
    ids=["add_cross_attention", "E%H"],
)
def test_gpt_bigcode_variants_we_cannot_serve_exactly_are_refused_by_name(
    tmp_path, config, edits, piece
):
    for layer in (0, 1):
        with pytest.raises(ValueError) as err:
            read_hf_layer(_config_only(tmp_path, config, **edits), layer)
        assert piece in str(err.value), str(err.value)
