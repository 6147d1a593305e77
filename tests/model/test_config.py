"""AttentionConfig: resolution of defaults, validation messages, variants, dict round trip."""

import dataclasses

import pytest

from mha_serve.model import AttentionConfig
from mha_serve.model.config import MLAConfig


def test_defaults_resolve():
    c = AttentionConfig(embed_dim=64, num_heads=8)
    assert (c.num_kv_heads, c.head_dim, c.bias, c.causal) == (8, 8, True, False)
    assert c.group_size == 1
    assert c.qkv_dim == 3 * 64


def test_custom_head_dim_and_gqa_sizes():
    c = AttentionConfig(embed_dim=64, num_heads=4, num_kv_heads=2, head_dim=32)
    assert c.group_size == 2
    assert c.qkv_dim == (4 + 2 * 2) * 32


@pytest.mark.parametrize(
    ("kwargs", "variant"),
    [
        ({"num_heads": 8}, "mha"),
        ({"num_heads": 8, "num_kv_heads": 8}, "mha"),
        ({"num_heads": 8, "num_kv_heads": 2}, "gqa"),
        ({"num_heads": 8, "num_kv_heads": 4}, "gqa"),
        ({"num_heads": 8, "num_kv_heads": 1}, "mqa"),
        ({"num_heads": 1}, "mha"),  # one head: nothing is shared, so MHA wins over MQA
        ({"num_heads": 1, "num_kv_heads": 1}, "mha"),
    ],
)
def test_variant(kwargs, variant):
    assert AttentionConfig(embed_dim=64, **kwargs).variant == variant


@pytest.mark.parametrize(
    ("kwargs", "pieces"),
    [
        ({"embed_dim": 500, "num_heads": 8}, ["embed_dim 500", "num_heads 8", "head_dim"]),
        ({"embed_dim": 64, "num_heads": 8, "num_kv_heads": 3}, ["num_kv_heads 3", "num_heads 8"]),
        ({"embed_dim": 64, "num_heads": 8, "num_kv_heads": 16}, ["num_kv_heads 16", "num_heads 8"]),
        ({"embed_dim": 0, "num_heads": 8}, ["embed_dim", ">= 1", "0"]),
        ({"embed_dim": 64, "num_heads": -2}, ["num_heads", "-2"]),
        ({"embed_dim": 64, "num_heads": 8, "num_kv_heads": 0}, ["num_kv_heads", "0"]),
        ({"embed_dim": 64, "num_heads": 8, "head_dim": 0}, ["head_dim", "0"]),
        ({"embed_dim": "64", "num_heads": 8}, ["embed_dim", "'64'", "str"]),
        ({"embed_dim": 64.0, "num_heads": 8}, ["embed_dim", "float"]),
        ({"embed_dim": True, "num_heads": 8}, ["embed_dim", "bool"]),
        ({"embed_dim": 64, "num_heads": 8, "bias": 1}, ["bias", "bool", "1"]),
        ({"embed_dim": 64, "num_heads": 8, "causal": "yes"}, ["causal", "bool", "'yes'"]),
    ],
)
def test_invalid_config_names_the_numbers(kwargs, pieces):
    with pytest.raises(ValueError) as err:
        AttentionConfig(**kwargs)
    for piece in pieces:
        assert piece in str(err.value), f"{piece!r} not in {str(err.value)!r}"


def test_explicit_head_dim_allows_indivisible_embed_dim():
    c = AttentionConfig(embed_dim=500, num_heads=8, head_dim=64)
    assert c.head_dim == 64


def test_frozen():
    c = AttentionConfig(embed_dim=64, num_heads=8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.num_heads = 4


@pytest.mark.parametrize(
    "config",
    [
        AttentionConfig(embed_dim=64, num_heads=8),
        AttentionConfig(embed_dim=64, num_heads=8, num_kv_heads=2, bias=False, causal=True),
        AttentionConfig(embed_dim=64, num_heads=4, num_kv_heads=1, head_dim=32),
    ],
)
def test_dict_round_trip(config):
    d = config.to_dict()
    assert set(d) == {"embed_dim", "num_heads", "num_kv_heads", "head_dim", "bias", "causal"}
    assert None not in d.values()
    assert AttentionConfig.from_dict(d) == config


def test_dict_round_trip_with_rope_and_scale():
    config = AttentionConfig(
        64,
        8,
        2,
        rope={
            "theta": 5e5,
            "type": "llama3",
            "factor": 8.0,
            "original_max_position_embeddings": 32,
        },
        softmax_scale=0.25,
    )
    d = config.to_dict()
    assert d["rope"]["type"] == "llama3" and d["softmax_scale"] == 0.25
    assert AttentionConfig.from_dict(d) == config
    assert config.scale == 0.25 and AttentionConfig(64, 8).scale == 8**-0.5


@pytest.mark.parametrize(
    ("rope", "piece"),
    [
        ({"type": "dynamic"}, "'dynamic' is not supported"),
        ({"type": "longrope"}, "'longrope' is not supported"),
        ({"type": "yarn", "factor": 4.0}, "original_max_position_embeddings"),
        ({"theta": -1.0}, "theta and factor must be > 0"),
        ({"thetaa": 1.0}, "unknown rope key(s) ['thetaa']"),
    ],
)
def test_bad_rope_is_refused_by_name(rope, piece):
    with pytest.raises(ValueError) as err:
        AttentionConfig(64, 8, rope=rope)
    assert piece in str(err.value), str(err.value)


def test_from_dict_rejects_unknown_keys():
    with pytest.raises(ValueError) as err:
        AttentionConfig.from_dict({"embed_dim": 64, "num_heads": 8, "n_heads": 8, "dropout": 0.1})
    msg = str(err.value)
    assert "dropout" in msg and "n_heads" in msg
    assert "num_kv_heads" in msg  # lists the valid keys


def test_from_dict_requires_embed_dim_and_num_heads():
    with pytest.raises(ValueError, match="num_heads"):
        AttentionConfig.from_dict({"embed_dim": 64})


# Multi-head latent attention: C = 32, R = 8, N = 16, V = 12 (DeepSeek's shape, small).
MLA = {"kv_lora_rank": 32, "rope_dim": 8, "nope_dim": 16, "v_head_dim": 12, "q_lora_rank": 24}


def test_mla_resolves_to_one_kv_head_of_rope_plus_latent_dims():
    """MLA is served as MQA over [rope (R); latent (C)]: one kv head of R + C dims, RoPE on
    its R dims, and HF's scale 1 / sqrt(N + R), not 1 / sqrt(R + C)."""
    c = AttentionConfig(64, 4, rope={"theta": 100.0}, mla=MLA)
    assert isinstance(c.mla, MLAConfig) and c.mla.q_lora_rank == 24 and c.mla.eps == 1e-6
    assert (c.num_kv_heads, c.head_dim, c.variant, c.rope_dim) == (1, 40, "mqa", 8)
    assert c.scale == (16 + 8) ** -0.5
    assert AttentionConfig(64, 4, rope={}, mla=MLA, softmax_scale=0.5).scale == 0.5
    # the values the resolution would give are taken as given
    assert AttentionConfig(64, 4, 1, 40, rope={}, mla=MLA) == c.__class__(64, 4, rope={}, mla=MLA)
    assert MLAConfig(32, 8, 16, 12).q_lora_rank is None


def test_mla_without_rope_keeps_its_rope_dims_unrotated():
    """Kimi Linear's MLA has no RoPE (NoPE): its rope_dim dims are still in q and k (one
    k_rope shared by every head), not rotated; an odd count then turns no pairs."""
    c = AttentionConfig(64, 4, mla={**MLA, "rope_dim": 7})
    assert c.rope is None and (c.num_kv_heads, c.head_dim, c.rope_dim) == (1, 39, 7)
    assert c.scale == (16 + 7) ** -0.5


@pytest.mark.parametrize(
    ("kwargs", "pieces"),
    [
        ({"num_kv_heads": 4}, ["num_kv_heads 4", "mla", "1", "leave num_kv_heads out"]),
        ({"head_dim": 16}, ["head_dim 16", "rope_dim + kv_lora_rank = 40"]),
        ({"rope": {"partial": 0.5}}, ["rope partial must be 1", "0.5"]),
        ({"qk_norm": {}}, ["mla with qk_norm is not supported"]),
        ({"sinks": True}, ["mla with sinks is not supported"]),
        ({"alibi": True}, ["mla with alibi is not supported"]),
        ({"softcap": 30.0}, ["mla with softcap is not supported"]),
        ({"mla": {**MLA, "kv_rank": 3}}, ["unknown mla key(s) ['kv_rank']", "kv_lora_rank"]),
        ({"mla": {**MLA, "rope_dim": 7}}, ["mla rope_dim must be even", "7"]),
        ({"mla": {**MLA, "nope_dim": 0}}, ["mla nope_dim must be >= 1, got 0"]),
        ({"mla": {**MLA, "v_head_dim": "12"}}, ["mla v_head_dim must be an int", "'12'"]),
        ({"mla": {**MLA, "q_lora_rank": True}}, ["mla q_lora_rank must be an int", "bool"]),
        ({"mla": {**MLA, "eps": -1.0}}, ["mla eps must be a finite number >= 0"]),
        ({"mla": {"kv_lora_rank": 32}}, ["mla is missing required key(s)", "'rope_dim'"]),
        ({"mla": 5}, ["mla must be a table of MLAConfig fields, got 5"]),
    ],
)
def test_bad_mla_is_refused_by_name(kwargs, pieces):
    args = {"embed_dim": 64, "num_heads": 4, "rope": {"theta": 100.0}, "mla": MLA, **kwargs}
    with pytest.raises(ValueError) as err:
        AttentionConfig(**args)
    for piece in pieces:
        assert piece in str(err.value), f"{piece!r} not in {str(err.value)!r}"


def test_mla_dict_round_trip():
    """to_dict writes mla as a table only when set (a config without it reads as before)."""
    config = AttentionConfig(64, 4, bias=False, causal=True, rope={"interleaved": True}, mla=MLA)
    d = config.to_dict()
    assert d["mla"] == {**MLA, "eps": 1e-6}
    assert AttentionConfig.from_dict(d) == config
    assert "mla" not in AttentionConfig(64, 4, rope={}).to_dict()
