"""The output gate (Qwen3-Next, Qwen3.5: AttentionConfig.output_gate; one value per head with
output_gate_per_head, LFM3's): each query head's
output times sigmoid(wgate x) before wo, against a float64 reference written here, on every
path of the module (stateless causal and not, padded, with weights and a head mask; session
steps token by token, in chunks, ragged and padded, equal to the stateless answer; batched
equal to unbatched); merges without the gate, or with one for a model without it, refused;
its weights saved, loaded, initialised, pruned and pooled."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import load_file, save_file

from mha_serve.model import AttentionConfig, MultiHeadAttention
from mha_serve.model.convert import pool_kv_heads
from mha_serve.model.metadata import to_metadata
from mha_serve.model.prune import cost_per_token, prune_heads
from mha_serve.model.weights import init_weights, load_checkpoint, save_checkpoint

# Qwen3-Next's options, small: GQA 4:2, head_dim 16 (not E / H), q/k RMSNorm per head, RoPE
# by halves over a quarter of each head, biases (Qwen's attention_bias may set them).
GATED = AttentionConfig(
    48,
    4,
    2,
    16,
    causal=True,
    rope={"theta": 100.0, "partial": 0.25},
    qk_norm={"scope": "head", "eps": 1e-6},
    output_gate=True,
)
ATOL = 2e-5  # float32 against float64


def gated_module(config: AttentionConfig = GATED, seed: int = 0) -> MultiHeadAttention:
    module = MultiHeadAttention(config)
    init_weights(module, seed)
    with torch.no_grad():  # a gate far from 1/2 everywhere: its rows' places matter
        module.wgate.weight.mul_(8.0)
    return module.eval()


def inputs(B: int, L: int, seed: int = 1, E: int = 48) -> torch.Tensor:
    return torch.randn(B, L, E, generator=torch.Generator().manual_seed(seed))


def reference(
    module: MultiHeadAttention,
    x: torch.Tensor,
    *,
    causal: bool = True,
    lengths: list[int] | None = None,
    head_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3NextAttention's arithmetic in float64, from the module's parameters: q, k, v;
    q and k RMS-normed per head and rotated by halves over their first rope_dim dims; the
    softmax over allowed keys; each head's output times the head mask, then times
    sigmoid(wgate x); wo. Output (B, L, E) (padded rows 0) and weights (B, H, L, L)."""
    c = module.config
    H, KVH, D, R = c.num_heads, c.num_kv_heads, c.head_dim, c.rope_dim
    p = {k: v.detach().double() for k, v in module.state_dict().items()}
    x = x.double()
    B, L, _ = x.shape
    lengths = lengths or [L] * B
    valid = torch.arange(L)[None] < torch.tensor(lengths)[:, None]  # (B, L)
    x = x * valid[..., None]
    qkv = x @ p["wqkv.weight"].T + p.get("wqkv.bias", 0)
    q, k, v = qkv.split([H * D, KVH * D, KVH * D], dim=-1)
    q = q.view(B, L, H, D).transpose(1, 2)  # (B, H, L, D)
    k = k.view(B, L, KVH, D).transpose(1, 2)
    v = v.view(B, L, KVH, D).transpose(1, 2)

    def norm(t, w):
        return t / (t.pow(2).mean(-1, keepdim=True) + c.qk_norm.eps).sqrt() * w

    q, k = norm(q, p["q_norm"]), norm(k, p["k_norm"])
    inv = c.rope.theta ** (-torch.arange(0, R, 2, dtype=torch.float64) / R)  # (R/2,)
    angle = torch.arange(L, dtype=torch.float64)[:, None] * inv  # (L, R/2)
    cos, sin = angle.cos(), angle.sin()

    def rotate(t):
        a, b = t[..., : R // 2], t[..., R // 2 : R]
        return torch.cat([a * cos - b * sin, b * cos + a * sin, t[..., R:]], dim=-1)

    q, k = rotate(q), rotate(k)
    k = k.repeat_interleave(H // KVH, dim=1)  # (B, H, L, D)
    v = v.repeat_interleave(H // KVH, dim=1)
    scores = q @ k.transpose(-1, -2) * D**-0.5  # (B, H, L, L)
    allowed = valid[:, None, None, :].expand(B, 1, L, L)
    if causal:
        allowed = allowed & torch.ones(L, L, dtype=torch.bool).tril()
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    y = weights @ v  # (B, H, L, D)
    if head_mask is not None:
        y = y * head_mask.double().view(1, H, 1, 1)
    y = y.transpose(1, 2).reshape(B, L, H * D)
    gate = torch.sigmoid(x @ p["wgate.weight"].T + p.get("wgate.bias", 0))  # (B, L, H*D)
    if c.output_gate_per_head:  # LFM3's: one value per head, on every dim of its output
        gate = gate.repeat_interleave(D, dim=-1)  # (B, L, H) -> (B, L, H*D)
    out = (y * gate) @ p["wo.weight"].T + p.get("wo.bias", 0)
    out = out * valid[..., None]
    weights = weights * valid[:, None, :, None]
    return out, weights


def close(a: torch.Tensor, b: torch.Tensor, what: str, atol: float = ATOL) -> None:
    diff = (a.double() - b.double()).abs()
    assert diff.max() <= atol, f"{what}: max {diff.max():.2e} mean {diff.mean():.2e}"


PER_HEAD = dataclasses.replace(GATED, output_gate_per_head=True)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("per_head", [False, True], ids=["per_dim", "per_head"])
def test_stateless_equals_the_reference_and_the_gate_matters(causal, bias, per_head):
    module = gated_module(dataclasses.replace(GATED, bias=bias, output_gate_per_head=per_head))
    assert module.wgate.weight.shape == ((4 if per_head else 64), 48)
    x = inputs(2, 9)
    out = module(x, causal=causal, need_weights=True)
    want, weights = reference(module, x, causal=causal)
    close(out.output, want, f"causal {causal} bias {bias}: output")
    close(out.weights, weights, "weights")
    ungated = module(x, causal=causal).output.clone()
    with torch.no_grad():
        module.wgate.weight.zero_()  # (gate 1/2 or sigmoid(bias) everywhere)
    assert (module(x, causal=causal).output - ungated).abs().max() > 0.1


def test_padded_with_a_head_mask_equals_the_reference():
    module = gated_module()
    x = inputs(3, 8, seed=2)
    x[1, 5:] = float("nan")  # padding is never read
    lengths = [8, 5, 2]
    mask = torch.tensor([1.0, 0.0, 0.5, 2.0])
    out = module(x, lengths=torch.tensor(lengths), head_mask=mask, need_weights=True)
    want, weights = reference(module, x.nan_to_num(), lengths=lengths, head_mask=mask)
    close(out.output, want, "padded, head mask: output")
    close(out.weights, weights, "padded: weights")
    assert torch.equal(out.output[1, 5:], torch.zeros_like(out.output[1, 5:]))


def test_batched_equals_unbatched():
    module = gated_module()
    x = inputs(3, 7, seed=3)
    together = module(x).output
    for b in range(3):
        close(together[b : b + 1], module(x[b : b + 1]).output, f"row {b}", atol=1e-6)


def _session(module: MultiHeadAttention, x: torch.Tensor, cuts: list[int]) -> torch.Tensor:
    """x (1, L, E) stepped through attend_cached in chunks [cuts[i], cuts[i + 1]), its K/V
    kept as a cache would: the chunks' outputs, concatenated."""
    keys = values = None
    outs = []
    for a, b in zip(cuts, cuts[1:], strict=False):
        chunk = x[:, a:b]
        q, k, v = module.project(chunk, torch.arange(a, b))
        keys = k if keys is None else torch.cat([keys, k], dim=2)
        values = v if values is None else torch.cat([values, v], dim=2)
        out = module.attend_cached(
            q,
            [(keys, values)],
            past_lengths=[a],
            new_lengths=[b - a],
            out_gate=module.output_gate(chunk),
        )
        outs.append(out.output)
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("cuts", [list(range(11)), [0, 4, 5, 10]], ids=["tokens", "chunks"])
@pytest.mark.parametrize("config", [GATED, PER_HEAD], ids=["per_dim", "per_head"])
def test_session_steps_equal_the_stateless_answer(cuts, config):
    module = gated_module(config)
    x = inputs(1, 10, seed=4)
    close(_session(module, x, cuts), module(x).output, f"steps {cuts}", atol=1e-5)


@pytest.mark.parametrize("config", [GATED, PER_HEAD], ids=["per_dim", "per_head"])
def test_ragged_and_padded_steps_equal_the_stateless_answer(config):
    """Two sessions stepped together with unequal new tokens: attend_cached's per-row loop
    (with a head mask), attend_step, and attend_padded's one kernel, each gated by the rows'
    own gates."""
    module = gated_module(config)
    xs = [inputs(1, 9, seed=5), inputs(1, 7, seed=6)]
    past, new = [6, 3], [3, 2]
    T = max(new)
    mask = torch.tensor([1.0, 0.5, 0.0, 1.0])
    q_rows, kv, x_rows = [], [], []
    for x, p, n in zip(xs, past, new, strict=True):
        chunk = torch.cat([x[:, p : p + n], torch.zeros(1, T - n, 48)], dim=1)  # (1, T, E)
        _, k, v = module.project(x[:, : p + n])
        q_rows.append(module.project(chunk, torch.arange(p, p + T))[0])
        kv.append((k, v))
        x_rows.append(chunk)
    q, x_new = torch.cat(q_rows), torch.cat(x_rows)
    gate = module.output_gate(x_new)  # (2, T, H*D)
    for head_mask in (None, mask):
        got = module.attend_cached(
            q, kv, past_lengths=past, new_lengths=new, head_mask=head_mask, out_gate=gate
        ).output
        width = max(p + n for p, n in zip(past, new, strict=True))
        keys = torch.zeros(2, 2, width, 16)
        values = torch.zeros(2, 2, width, 16)
        for b, (k, v) in enumerate(kv):
            keys[b, :, : k.shape[2]], values[b, :, : v.shape[2]] = k[0], v[0]
        padded = module.attend_padded(
            q, keys, values, past_lengths=past, new_lengths=new, head_mask=head_mask, out_gate=gate
        ).output
        for b, (x, p, n) in enumerate(zip(xs, past, new, strict=True)):
            want = module(x[:, : p + n], head_mask=head_mask).output[:, p:]  # (1, n, E)
            close(got[b : b + 1, :n], want, f"row {b}, mask {head_mask is not None}", atol=1e-5)
            close(padded[b : b + 1, :n], want, f"padded row {b}", atol=1e-5)
            assert not got[b, n:].any() and not padded[b, n:].any(), "padded rows are 0"
    x = xs[0]
    q, k, v = module.project(x)
    step = module.attend_step(q[:, :, 4:], k, v, 4, 0, module.output_gate(x[:, 4:]))
    close(step, module(x).output[:, 4:], "attend_step", atol=1e-5)


def test_a_merge_without_the_gate_or_with_one_it_has_not_is_refused():
    """A gated model merged without its gate would answer wrongly, not fail: every merge
    refuses it, naming what to pass; and a gate for a model without one, or of a wrong
    shape."""
    module = gated_module()
    x = inputs(1, 4)
    q, k, v = module.project(x)
    with pytest.raises(ValueError, match=r"has an output gate .* out_gate is None"):
        module.attend_step(q, k, v, 0)
    with pytest.raises(ValueError, match="out_gate=module.output_gate"):
        module.merge_heads(torch.zeros(1, 4, 4, 16))
    with pytest.raises(ValueError, match=r"out_gate must be .* = \(1, 4, 64\), got \(1, 3, 64\)"):
        module.attend_step(q, k, v, 0, 0, module.output_gate(x[:, :3]))
    plain = MultiHeadAttention(dataclasses.replace(GATED, output_gate=False))
    init_weights(plain, 0)
    assert plain.output_gate(x) is None and plain.wgate is None
    with pytest.raises(ValueError, match=r"has no output gate .* out_gate is given"):
        plain.merge_heads(torch.zeros(1, 4, 4, 16), torch.ones(1, 4, 64))


def test_decode_one_declines_and_a_gate_with_mla_is_sized_by_its_value_heads():
    module = gated_module()
    assert not module.decodes_in_one
    x = inputs(1, 1)
    slot = torch.zeros(1, 4, 1, 16)
    assert module.decode_one(x, slot, torch.zeros(1, 2, 1, 16), torch.zeros(1, 2, 1, 16)) is None
    assert not slot.any(), "nothing written"
    # (refused before Ling 3.0's MLA layers were served: tests/model/test_mla.py computes it)
    mla = {"kv_lora_rank": 16, "rope_dim": 4, "nope_dim": 8, "v_head_dim": 6}
    gated = AttentionConfig(64, 4, rope={}, output_gate=True, mla=mla)
    assert gated.gate_width == 4 * 6  # each head's V merged dims, not its R + C
    assert dataclasses.replace(gated, output_gate_per_head=True).gate_width == 4


def test_config_round_trips_and_leaves_ungated_configs_as_they_were():
    assert GATED.to_dict()["output_gate"] is True
    assert AttentionConfig.from_dict(GATED.to_dict()) == GATED
    assert "output_gate" not in dataclasses.replace(GATED, output_gate=False).to_dict()
    assert "output_gate_per_head" not in GATED.to_dict()
    assert AttentionConfig.from_dict(PER_HEAD.to_dict()) == PER_HEAD
    assert PER_HEAD.to_dict()["output_gate_per_head"] is True
    with pytest.raises(ValueError, match="output_gate must be a bool"):
        AttentionConfig(48, 4, output_gate="yes")
    with pytest.raises(ValueError, match="output_gate_per_head is set but output_gate is not"):
        AttentionConfig(48, 4, output_gate_per_head=True)


def test_a_per_head_gate_equals_a_per_dim_gate_of_each_heads_row_repeated():
    """Exact, not an approximation: one value per head is the per-dim gate whose rows repeat
    each head's row head_dim times; and its projection costs 1/head_dim of theirs."""
    module = gated_module(PER_HEAD)
    wide = MultiHeadAttention(GATED)
    state = dict(module.state_dict())
    state["wgate.weight"] = state["wgate.weight"].repeat_interleave(16, dim=0)
    state["wgate.bias"] = state["wgate.bias"].repeat_interleave(16, dim=0)
    wide.load_state_dict(state)
    x = inputs(2, 7, seed=9)
    close(module(x).output, wide(x).output, "per head vs repeated rows", atol=1e-6)
    plain = cost_per_token(dataclasses.replace(GATED, output_gate=False), 4)["projection_flops"]
    assert cost_per_token(PER_HEAD, 4)["projection_flops"] - plain == 2 * 4 * 48
    pruned = prune_heads(module, [1, 3])  # the kept heads' one row each
    assert pruned.wgate.weight.shape == (2, 48)
    mask = torch.tensor([1.0, 0.0, 1.0, 0.0])
    close(pruned(x).output, module(x, head_mask=mask).output, "pruned per head", atol=1e-5)


def test_saved_and_loaded_with_its_gate_named_in_shape_errors(tmp_path):
    module = gated_module()
    path = tmp_path / "gated.safetensors"
    save_checkpoint(module, path)
    loaded = load_checkpoint(path)
    assert loaded.config == GATED
    x = inputs(1, 6)
    assert torch.equal(loaded(x).output, module(x).output)
    tensors = load_file(str(path))
    tensors["wgate.weight"] = tensors["wgate.weight"][:32]
    bad = tmp_path / "bad.safetensors"
    save_file(tensors, str(bad), metadata=to_metadata(GATED))
    with pytest.raises(ValueError, match=r"key 'wgate.weight' has shape \(32, 48\), expected"):
        load_checkpoint(bad, config=GATED)
    del tensors["wgate.weight"]
    save_file(tensors, str(bad))
    with pytest.raises(ValueError, match=r"missing key 'wgate.weight'"):
        load_checkpoint(bad, config=GATED)


def test_init_draws_the_gate_last_so_other_models_draw_as_before():
    gated, plain = (
        MultiHeadAttention(GATED),
        MultiHeadAttention(dataclasses.replace(GATED, output_gate=False)),
    )
    init_weights(gated, 7)
    init_weights(plain, 7)
    for name, p in plain.state_dict().items():
        assert torch.equal(gated.state_dict()[name], p), name
    again = MultiHeadAttention(GATED)
    init_weights(again, 7)
    assert torch.equal(again.wgate.weight, gated.wgate.weight)
    assert gated.wgate.weight.std() > 0.05 and gated.wgate.bias.abs().max() > 0


def test_pruned_heads_take_their_gate_rows_and_pooling_keeps_the_gate():
    """prune_heads: the kept heads' gate rows go with them (served, the pruned model equals
    the original with those heads masked); pool_kv_heads: the gate is per query head, so it
    stays as it is (with kv heads that agree, the pooled model answers as the original)."""
    module = gated_module()
    x = inputs(2, 6, seed=8)
    pruned = prune_heads(module, [1, 3])  # one query head of each kv group
    mask = torch.tensor([1.0, 0.0, 1.0, 0.0])
    close(pruned(x).output, module(x, head_mask=mask).output, "pruned vs masked", atol=1e-5)
    assert pruned.wgate.weight.shape == (32, 48)
    # (the report's compute per token counts the gate's projection, and its pruned rows)
    flops = [cost_per_token(m.config, 4)["projection_flops"] for m in (module, pruned)]
    ungated = cost_per_token(dataclasses.replace(GATED, output_gate=False), 4)
    assert flops[0] - ungated["projection_flops"] == 2 * 64 * 48
    assert flops[0] - flops[1] == 2 * 48 * (32 + 32 + 32)  # two heads' q, wo and gate rows
    with torch.no_grad():  # both kv heads alike: pooling them changes nothing
        w, b = module.wqkv.weight, module.wqkv.bias
        w[80:96], w[112:128] = w[64:80], w[96:112]
        b[80:96], b[112:128] = b[64:80], b[96:112]
    pooled = pool_kv_heads(module, 1)
    assert torch.equal(pooled.wgate.weight, module.wgate.weight)
    close(pooled(x).output, module(x).output, "pooled kv heads", atol=1e-5)
