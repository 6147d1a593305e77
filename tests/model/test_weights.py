"""Weights: seeded init, safetensors round trip, nn.MultiheadAttention import, and the
errors for files that do not fit the config."""

import math

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from mha_serve.model import (
    AttentionConfig,
    MultiHeadAttention,
    from_torch_mha,
    init_weights,
    load_checkpoint,
    save_checkpoint,
    torch_mha_state_dict_to_ours,
)
from mha_serve.model.weights import BIAS_INIT_BOUND, FORMAT

ATOL = 1e-5  # float32, ours against nn.MultiheadAttention
RTOL = 1e-5


def assert_close(actual, expected, *, what="output"):
    diff = (actual.double() - expected.double()).abs()
    assert torch.allclose(actual, expected, atol=ATOL, rtol=RTOL), (
        f"{what}: max abs diff {diff.max().item():.3e}, mean {diff.mean().item():.3e}"
    )


def make(config, seed=0, dtype=None):
    module = MultiHeadAttention(config, dtype=dtype)
    init_weights(module, seed)
    return module.eval()


def torch_mha(E=32, H=4, *, bias=True, **kwargs):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, H, bias=bias, batch_first=True, **kwargs).eval()
    if bias:  # torch zero-initialises biases; make them matter
        with torch.no_grad():
            mha.in_proj_bias.uniform_(-0.1, 0.1)
            mha.out_proj.bias.uniform_(-0.1, 0.1)
    return mha


MHA = AttentionConfig(embed_dim=64, num_heads=8)
GQA = AttentionConfig(embed_dim=64, num_heads=8, num_kv_heads=2)
CONFIGS = [
    MHA,
    GQA,
    AttentionConfig(embed_dim=64, num_heads=4, num_kv_heads=1, head_dim=32, causal=True),
    AttentionConfig(embed_dim=64, num_heads=8, bias=False),
]


# --- init --------------------------------------------------------------------------------


@pytest.mark.parametrize("config", CONFIGS)
def test_init_is_deterministic(config):
    a, b, c = make(config, seed=7), make(config, seed=7), make(config, seed=8)
    params = zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True)
    for (name, pa), pb, pc in params:
        assert torch.equal(pa, pb), f"{name} differs for the same seed"
        assert not torch.equal(pa, pc), f"{name} equal for different seeds"


def test_init_ranges():
    module = make(GQA)
    for linear in (module.wqkv, module.wo):
        fan_out, fan_in = linear.weight.shape
        bound = math.sqrt(6.0 / (fan_in + fan_out))
        assert linear.weight.abs().max() <= bound
        assert linear.weight.abs().max() > 0.5 * bound
        assert 0 < linear.bias.abs().max() <= BIAS_INIT_BOUND


def test_init_same_values_in_any_dtype():
    full, half = make(GQA, dtype=torch.float32), make(GQA, dtype=torch.bfloat16)
    for p32, p16 in zip(full.parameters(), half.parameters(), strict=True):
        assert torch.equal(p32.to(torch.bfloat16), p16)


# --- our safetensors layout --------------------------------------------------------------


@pytest.mark.parametrize("config", CONFIGS)
def test_save_load_round_trip(tmp_path, config):
    module = make(config, seed=3)
    path = tmp_path / "m.safetensors"
    save_checkpoint(module, path)

    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
        keys = set(f.keys())
    assert metadata["format"] == FORMAT
    assert metadata["num_kv_heads"] == str(config.num_kv_heads)
    want_keys = {"wqkv.weight", "wo.weight"} | ({"wqkv.bias", "wo.bias"} if config.bias else set())
    assert keys == want_keys

    loaded = load_checkpoint(path)
    assert loaded.config == config
    assert not loaded.training
    x = torch.randn(2, 5, 64)
    lengths = torch.tensor([5, 3])
    with torch.no_grad():
        assert torch.equal(loaded(x, lengths=lengths).output, module(x, lengths=lengths).output)
    assert load_checkpoint(path, config=config).config == config


def test_load_dtype(tmp_path):
    path = tmp_path / "m.safetensors"
    save_checkpoint(make(GQA, dtype=torch.bfloat16), path)
    assert load_checkpoint(path).wqkv.weight.dtype == torch.bfloat16  # the file's dtype
    assert load_checkpoint(path, dtype=torch.float32).wo.weight.dtype == torch.float32


def save_tensors(tmp_path, tensors, metadata=None):
    path = tmp_path / "edited.safetensors"
    save_file(tensors, str(path), metadata=metadata)
    return path


def our_tensors_and_metadata(config):
    module = make(config)
    metadata = {"format": FORMAT, **{k: str(v) for k, v in config.to_dict().items()}}
    return {k: t.clone() for k, t in module.state_dict().items()}, metadata


@pytest.mark.parametrize(
    ("edit", "pieces"),
    [
        (lambda t: t.update({"wo.weight": torch.zeros(64, 32)}), ["'wo.weight'", "(64, 32)"]),
        (lambda t: t.pop("wo.bias"), ["missing key 'wo.bias'", "(64,)"]),
        (lambda t: t.update({"rotary.freqs": torch.zeros(4)}), ["unexpected key 'rotary.freqs'"]),
        (lambda t: t.update({"wqkv.bias": torch.zeros(8)}), ["'wqkv.bias'", "(8,)", "(96,)"]),
    ],
)
def test_tensors_that_do_not_fit_are_named(tmp_path, edit, pieces):
    tensors, metadata = our_tensors_and_metadata(GQA)
    edit(tensors)
    with pytest.raises(ValueError) as err:
        load_checkpoint(save_tensors(tmp_path, tensors, metadata))
    for piece in pieces:
        assert piece in str(err.value), f"{piece!r} not in {str(err.value)!r}"


def test_config_mismatch_names_both(tmp_path):
    path = tmp_path / "m.safetensors"
    save_checkpoint(make(GQA), path)
    with pytest.raises(ValueError) as err:
        load_checkpoint(path, config=AttentionConfig(embed_dim=64, num_heads=8, num_kv_heads=4))
    assert "num_kv_heads 4 vs 2" in str(err.value)


def test_metadata_free_file_needs_config(tmp_path):
    tensors, _ = our_tensors_and_metadata(GQA)
    path = save_tensors(tmp_path, tensors)
    with pytest.raises(ValueError, match="pass config"):
        load_checkpoint(path)
    assert load_checkpoint(path, config=GQA).config == GQA


def test_bad_metadata_value_is_named(tmp_path):
    tensors, metadata = our_tensors_and_metadata(GQA)
    path = save_tensors(tmp_path, tensors, {**metadata, "bias": "1"})
    with pytest.raises(ValueError, match="bias must be a bool"):
        load_checkpoint(path)


def test_only_safetensors_is_loaded(tmp_path):
    path = tmp_path / "m.pt"
    torch.save(make(GQA).state_dict(), path)
    with pytest.raises(ValueError, match="not a safetensors file"):
        load_checkpoint(path)
    with pytest.raises(FileNotFoundError, match="nope.safetensors"):
        load_checkpoint(tmp_path / "nope.safetensors")


# --- torch.nn.MultiheadAttention ---------------------------------------------------------


@pytest.mark.parametrize("bias", [True, False])
def test_load_torch_state_dict_file(tmp_path, bias):
    mha = torch_mha(bias=bias)
    path = save_tensors(tmp_path, dict(mha.state_dict()))
    with pytest.raises(ValueError, match="needs num_heads: pass config"):
        load_checkpoint(path)

    config = AttentionConfig(embed_dim=32, num_heads=4, bias=bias)
    ours = load_checkpoint(path, config=config)
    x = torch.randn(2, 6, 32)
    with torch.no_grad():
        want, want_w = mha(x, x, x, need_weights=True, average_attn_weights=False)
        got = ours(x, need_weights=True)
    assert_close(got.output, want, what="output")
    assert_close(got.weights, want_w, what="weights")


def test_state_dict_conversion_is_a_rename():
    mha = torch_mha()
    config = AttentionConfig(embed_dim=32, num_heads=4)
    ours = torch_mha_state_dict_to_ours(mha.state_dict(), config)
    assert torch.equal(ours["wqkv.weight"], mha.in_proj_weight)  # rows [Wq; Wk; Wv]
    assert torch.equal(ours["wo.bias"], mha.out_proj.bias)
    assert from_torch_mha(mha).config == config


def test_torch_file_shape_errors_name_the_torch_key(tmp_path):
    path = save_tensors(tmp_path, dict(torch_mha().state_dict()))
    with pytest.raises(ValueError, match="'in_proj_weight' has shape \\(96, 32\\), expected"):
        load_checkpoint(path, config=AttentionConfig(embed_dim=64, num_heads=4))
    with pytest.raises(ValueError, match="unexpected key 'in_proj_bias'"):
        load_checkpoint(path, config=AttentionConfig(embed_dim=32, num_heads=4, bias=False))


def test_torch_layout_needs_plain_mha_config(tmp_path):
    path = save_tensors(tmp_path, dict(torch_mha().state_dict()))
    with pytest.raises(ValueError, match="num_kv_heads 2"):
        load_checkpoint(path, config=AttentionConfig(embed_dim=32, num_heads=4, num_kv_heads=2))


@pytest.mark.parametrize(
    ("kwargs", "piece"),
    [({"kdim": 16, "vdim": 16}, "kdim"), ({"add_bias_kv": True}, "add_bias_kv")],
)
def test_unsupported_torch_options_in_files(tmp_path, kwargs, piece):
    path = save_tensors(tmp_path, dict(torch_mha(bias=False, **kwargs).state_dict()))
    with pytest.raises(ValueError, match=piece):
        load_checkpoint(path, config=AttentionConfig(embed_dim=32, num_heads=4, bias=False))


@pytest.mark.parametrize(
    ("kwargs", "piece"),
    [
        ({"kdim": 16, "vdim": 16}, "kdim 16"),
        ({"add_bias_kv": True}, "add_bias_kv"),
        ({"add_zero_attn": True}, "add_zero_attn"),
    ],
)
def test_from_torch_mha_rejects_unsupported_options(kwargs, piece):
    with pytest.raises(ValueError, match=piece):
        from_torch_mha(torch_mha(bias=False, **kwargs))


def test_a_missing_checkpoint_names_its_model_and_where_it_was_looked_for(tmp_path, monkeypatch):
    """A [[models]] table that gives its attention may name a checkpoint written later: its
    absence shows only when the server loads it, which says which model and which path."""
    from mha_serve.engine import Engine
    from mha_serve.spec import ModelSpec

    monkeypatch.chdir(tmp_path)
    spec = ModelSpec(name="late", attention=GQA, checkpoint="nope.safetensors")
    with pytest.raises(FileNotFoundError) as err:
        Engine([spec], device="cpu", dtype="float32", max_response_bytes=1 << 20)
    assert str(err.value) == (
        f"model 'late': checkpoint {tmp_path / 'nope.safetensors'} does not exist"
    )
