"""BLOOM's config.json as BloomConfig reads it (n_embed over hidden_size, num_attention_heads
over n_head, num_hidden_layers over n_layer), served equal to BloomAttention; what
transformers computes otherwise than we can (slow_but_exact with pretraining_tp > 1) or
builds no layer from is refused by name. (Parity over gRPC, sessions and transformers'
incremental decode: the "bloom" checkpoint of reference.py, in the shared tests.)"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, BloomConfig, BloomModel

from mha_serve.model.hf import load_hf_layer
from mha_serve.model.hf_config import read_hf_layer
from tests.models_hf.reference import reference_attention
from tests.models_hf.test_config_json import checkpoint

BLOOM = {"hidden_size": 96, "n_head": 12, "n_layer": 2, "vocab_size": 64}


def test_older_names_are_read_as_bloom_config_reads_them(tmp_path):
    """bigscience's config.json: n_embed (BloomConfig's over hidden_size),
    num_attention_heads and num_hidden_layers (its aliases, which win): 6 heads of 8 and 3
    layers here, against a decoy hidden_size, n_head and n_layer."""
    checkpoint_dir = checkpoint(
        tmp_path,
        BloomModel,
        BloomConfig(hidden_size=48, n_head=6, n_layer=3, vocab_size=64),
        hidden_size=64,
        n_embed=48,
        n_head=4,
        num_attention_heads=6,
        n_layer=2,
        num_hidden_layers=3,
    )
    theirs = AutoConfig.from_pretrained(checkpoint_dir)
    assert (theirs.hidden_size, theirs.n_head, theirs.n_layer) == (48, 6, 3)
    read = read_hf_layer(checkpoint_dir, 2)
    assert (read.attention.embed_dim, read.attention.num_heads, read.num_layers) == (48, 6, 3)
    assert read.attention.alibi and read.attention.rope is None
    base = BloomModel.from_pretrained(checkpoint_dir, attn_implementation="eager").eval()
    module, _ = load_hf_layer(checkpoint_dir, 2)
    x = torch.randn(1, 20, 48, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, want_w = reference_attention("bloom", base, 2, x)
        got = module(x, need_weights=True)
    torch.testing.assert_close(got.output, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.weights, want_w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("edits", "piece"),
    [
        ({"slow_but_exact": True, "pretraining_tp": 2}, "slow_but_exact with pretraining_tp 2"),
        ({"hidden_size": 100}, "hidden_size 100 is not divisible by n_head 12"),
        ({"n_head": None}, "config.json sets n_head to null"),
        ({"slow_but_exact": None}, "config.json sets slow_but_exact"),
    ],
    ids=["slow_but_exact", "indivisible", "n_head_null", "slow_but_exact_null"],
)
def test_what_bloom_cannot_serve_exactly_is_refused_by_name(tmp_path, edits, piece):
    BloomConfig(**BLOOM).save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    cfg = {**json.loads(path.read_text()), **edits}
    path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as err:
        read_hf_layer(tmp_path, 0)
    assert piece in str(err.value), str(err.value)
