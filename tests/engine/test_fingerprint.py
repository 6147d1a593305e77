"""A model's fingerprint (what a spilled or moved session's K/V are bound to) stays what
earlier releases computed for a model without the options added since (durable sessions
are adopted across a rolling update), and tells apart models that compute differently."""

from __future__ import annotations

import dataclasses

import torch

from mha_serve.engine import Engine, ModelSpec
from mha_serve.engine.fingerprint import model_fingerprint
from mha_serve.model import AttentionConfig

# What the release before attention sinks (1d7be1c) computed for PINNED_CONFIG's model with
# the weights of fixed_weights: AttentionConfig then had no `sinks` field.
PINNED_CONFIG = AttentionConfig(64, 8, 2, rope={"theta": 100.0}, sliding_window=16)
PINNED = "fb36ffaa8e22fd549f12d4b57f9b4f261eab6a765bba491171efafb0589d595d"
# What the release before alibi_scale and alibi_bfloat16 (6aad783) computed for PINNED_CONFIG
# with alibi, the same weights.
PINNED_ALIBI = "a983e69ca9e875566d51c147d0a6671001a15d3d86d6d7d82be89205775c3e5e"
# What the release that added multi-head latent attention computed for this MLA model with
# the weights of fixed_weights.
MLA_CONFIG = AttentionConfig(
    64,
    4,
    rope={"theta": 100.0, "interleaved": True},
    mla={"kv_lora_rank": 24, "rope_dim": 8, "nope_dim": 12, "v_head_dim": 10, "q_lora_rank": 20},
)
PINNED_MLA = "1707551f2f2b84db82905817561ed8d04eb89a18d3fa97e392f4fbdfc20dcd86"
# What the release that added the output gate computed for this gated model (Qwen3-Next's
# options) with the weights of fixed_weights.
GATED_CONFIG = AttentionConfig(
    64,
    4,
    2,
    32,
    rope={"theta": 100.0, "partial": 0.25},
    qk_norm={"scope": "head"},
    output_gate=True,
)
PINNED_GATED = "b6a535e811c237e1304de654052297b69286088c5387b8fba2d504426e3dbfa5"


def hosted_with_fixed_weights(config: AttentionConfig):
    """The model of `config` with every parameter set by arithmetic alone (no RNG)."""
    engine = Engine(
        [ModelSpec("m", config, seed=0)],
        device=torch.device("cpu"),
        dtype=torch.float32,
        max_response_bytes=2**20,
    )
    hosted = engine.get("m")
    with torch.no_grad():
        for _, p in sorted(hosted.module.named_parameters()):
            p.copy_((torch.arange(p.numel()) % 7).reshape(p.shape) / 7.0 - 0.5)
    return hosted


def test_a_model_without_sinks_keeps_its_fingerprint_from_before_sinks():
    """Adding AttentionConfig.sinks (default False) changed every model's fingerprint (the
    config's fields are hashed), so a rolling update would have dropped every durable
    session; a field at its default is left out of the hash."""
    assert model_fingerprint(hosted_with_fixed_weights(PINNED_CONFIG)) == PINNED


def test_sinks_change_the_fingerprint():
    plain = hosted_with_fixed_weights(PINNED_CONFIG)
    sinks = hosted_with_fixed_weights(dataclasses.replace(PINNED_CONFIG, sinks=True))
    assert model_fingerprint(sinks) != model_fingerprint(plain)


def test_alibi_and_its_bias_max_change_the_fingerprint():
    """AttentionConfig.alibi and alibi_bias_max (added after PINNED) are hashed only with
    alibi set: PINNED keeps its fingerprint (above); ALiBi, and ALiBi of another spread,
    give others."""
    plain = model_fingerprint(hosted_with_fixed_weights(PINNED_CONFIG))
    seen = {plain}
    for option in ({"alibi": True}, {"alibi": True, "alibi_bias_max": 4.0}):
        other = hosted_with_fixed_weights(dataclasses.replace(PINNED_CONFIG, **option))
        seen.add(model_fingerprint(other))
    assert len(seen) == 3


def test_alibi_scale_and_bfloat16_change_the_fingerprint_only_when_set():
    """alibi_scale and alibi_bfloat16 (Falcon-RW's form, added after alibi) are hashed only
    when set: an ALiBi model without them keeps the fingerprint it had; each gives another."""
    alibi = dataclasses.replace(PINNED_CONFIG, alibi=True)
    plain = model_fingerprint(hosted_with_fixed_weights(alibi))
    assert plain == PINNED_ALIBI
    seen = {plain}
    for option in ({"alibi_scale": 0.5}, {"alibi_bfloat16": True}):
        other = hosted_with_fixed_weights(dataclasses.replace(alibi, **option))
        seen.add(model_fingerprint(other))
    assert len(seen) == 3


def test_rope_by_pairs_or_partial_changes_the_fingerprint_and_the_default_keeps_it():
    """RopeConfig.interleaved and .partial (added after PINNED) are hashed only when set:
    PINNED's RoPE model keeps its fingerprint (the test above), and either option set gives
    another (cached keys rotated by pairs, or over half of each head, mean other things)."""
    plain = model_fingerprint(hosted_with_fixed_weights(PINNED_CONFIG))
    seen = {plain}
    for option in ({"interleaved": True}, {"partial": 0.5}):
        rope = dataclasses.replace(PINNED_CONFIG.rope, **option)
        other = hosted_with_fixed_weights(dataclasses.replace(PINNED_CONFIG, rope=rope))
        seen.add(model_fingerprint(other))
    assert len(seen) == 3


def test_an_mla_model_keeps_its_fingerprint_and_its_shape_changes_it():
    """MLA's fields are hashed (its K/V are latents of that shape), pinned so that a later
    field added to MLAConfig keeps it; another latent width or q_lora_rank gives another."""
    plain = model_fingerprint(hosted_with_fixed_weights(MLA_CONFIG))
    assert plain == PINNED_MLA
    seen = {plain}
    for option in ({"q_lora_rank": None}, {"eps": 1e-5}):
        mla = dataclasses.replace(MLA_CONFIG.mla, **option)
        other = hosted_with_fixed_weights(dataclasses.replace(MLA_CONFIG, mla=mla))
        seen.add(model_fingerprint(other))
    assert len(seen) == 3


def test_a_gated_model_keeps_its_fingerprint_and_the_gate_changes_it():
    """AttentionConfig.output_gate is hashed only when set (PINNED, above, keeps its
    fingerprint), and a gated model's is pinned; the same model without its gate (and so
    without wgate) gives another."""
    gated = model_fingerprint(hosted_with_fixed_weights(GATED_CONFIG))
    assert gated == PINNED_GATED
    plain = hosted_with_fixed_weights(dataclasses.replace(GATED_CONFIG, output_gate=False))
    assert model_fingerprint(plain) != gated
