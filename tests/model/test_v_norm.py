"""The value norm (Gemma 3n, Gemma 4: AttentionConfig.v_norm): each value head RMS-normed over
its head_dim values without a gain, eps the q/k norm's, before the values are cached; with
Gemma 4's proportional RoPE. Against a float64 reference written here, on every path of the
module (stateless causal and not, padded, batched equal to unbatched; session steps token by
token and in chunks, ragged and padded, equal to the stateless answer); the config checked
and round-tripped; the overflow bounds that hold whatever the input."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from mha_serve.model import AttentionConfig, MultiHeadAttention
from mha_serve.model.overflow import projected_bounds, weight_bounds
from mha_serve.model.weights import init_weights, load_checkpoint, save_checkpoint

# Gemma 4's global layers, small: GQA 4:2, head_dim 16 (not E / H), q/k RMSNorm per head,
# values RMS-normed, scale 1.0, proportional RoPE over the whole head with half of its
# frequencies non-zero.
NORMED = AttentionConfig(
    48,
    4,
    2,
    16,
    causal=True,
    rope={"theta": 100.0, "type": "proportional", "partial": 0.5},
    softmax_scale=1.0,
    qk_norm={"scope": "head", "eps": 1e-6},
    v_norm=True,
)
ATOL = 2e-5  # float32 against float64


def normed_module(config: AttentionConfig = NORMED, seed: int = 0) -> MultiHeadAttention:
    module = MultiHeadAttention(config)
    init_weights(module, seed)
    with torch.no_grad():  # values far from unit RMS: the norm changes them
        module.wqkv.weight[-config.num_kv_heads * config.head_dim :].mul_(5.0)
    return module.eval()


def inputs(B: int, L: int, seed: int = 1, E: int = 48) -> torch.Tensor:
    return torch.randn(B, L, E, generator=torch.Generator().manual_seed(seed))


def reference(
    module: MultiHeadAttention,
    x: torch.Tensor,
    *,
    causal: bool = True,
    lengths: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gemma4TextAttention's arithmetic in float64, from the module's parameters: q, k and v
    projected; q and k RMS-normed per head by their gains, v without one; q and k rotated by
    halves over the whole head at frequencies theta ** (-2i / D) for the first
    int(partial * D // 2), 0 past them; the softmax over allowed keys at the config's scale;
    wo. Output (B, L, E) (padded rows 0) and weights (B, H, L, L)."""
    c = module.config
    H, KVH, D = c.num_heads, c.num_kv_heads, c.head_dim
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

    def norm(t, w=1.0):
        return t / (t.pow(2).mean(-1, keepdim=True) + c.qk_norm.eps).sqrt() * w

    q, k, v = norm(q, p["q_norm"]), norm(k, p["k_norm"]), norm(v)
    turned = int(c.rope.partial * D // 2)
    inv = c.rope.theta ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)  # (D/2,)
    inv[turned:] = 0.0
    angle = torch.arange(L, dtype=torch.float64)[:, None] * inv  # (L, D/2)
    cos, sin = angle.cos(), angle.sin()

    def rotate(t):
        a, b = t[..., : D // 2], t[..., D // 2 :]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

    q, k = rotate(q), rotate(k)
    k = k.repeat_interleave(H // KVH, dim=1)  # (B, H, L, D)
    v = v.repeat_interleave(H // KVH, dim=1)
    scores = q @ k.transpose(-1, -2) * c.scale  # (B, H, L, L)
    allowed = valid[:, None, None, :].expand(B, 1, L, L)
    if causal:
        allowed = allowed & torch.ones(L, L, dtype=torch.bool).tril()
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    y = (weights @ v).transpose(1, 2).reshape(B, L, H * D)  # (B, L, H*D)
    out = (y @ p["wo.weight"].T + p.get("wo.bias", 0)) * valid[..., None]
    return out, weights * valid[:, None, :, None]


def close(a: torch.Tensor, b: torch.Tensor, what: str, atol: float = ATOL) -> None:
    diff = (a.double() - b.double()).abs()
    assert diff.max() <= atol, f"{what}: max {diff.max():.2e} mean {diff.mean():.2e}"


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_stateless_equals_the_reference_and_the_norm_matters(causal, bias):
    module = normed_module(dataclasses.replace(NORMED, bias=bias))
    x = inputs(2, 9)
    out = module(x, causal=causal, need_weights=True)
    want, weights = reference(module, x, causal=causal)
    close(out.output, want, f"causal {causal} bias {bias}: output")
    close(out.weights, weights, "weights")
    plain = MultiHeadAttention(dataclasses.replace(NORMED, bias=bias, v_norm=False)).eval()
    plain.load_state_dict(module.state_dict())
    assert (plain(x, causal=causal).output - out.output).abs().max() > 0.1


def test_project_caches_each_value_head_at_unit_rms():
    """The values project hands to the cache are normed per head (mean square 1, up to
    eps), whatever their scale before: what a session stores is the normed value."""
    module = normed_module()
    x = inputs(1, 6, seed=2) * 1e3
    _, _, v = module.project(x)  # (1, KVH, L, D)
    close(v.pow(2).mean(-1), torch.ones(1, 2, 6), "mean square of each value head", 1e-5)


def test_padded_equals_the_reference():
    module = normed_module()
    x = inputs(3, 8, seed=2)
    x[1, 5:] = float("nan")  # padding is never read
    lengths = [8, 5, 2]
    out = module(x, lengths=torch.tensor(lengths), need_weights=True)
    want, weights = reference(module, x.nan_to_num(), lengths=lengths)
    close(out.output, want, "padded: output")
    close(out.weights, weights, "padded: weights")


def test_batched_equals_unbatched():
    module = normed_module()
    x = inputs(3, 7, seed=3)
    together = module(x).output
    for b in range(3):
        close(together[b : b + 1], module(x[b : b + 1]).output, f"row {b}", atol=1e-5)


def _session(module: MultiHeadAttention, x: torch.Tensor, cuts: list[int]) -> torch.Tensor:
    """x (1, L, E) stepped through attend_cached in chunks [cuts[i], cuts[i + 1]), its K/V
    kept as a cache would: the chunks' outputs, concatenated."""
    keys = values = None
    outs = []
    for a, b in zip(cuts, cuts[1:], strict=False):
        q, k, v = module.project(x[:, a:b], torch.arange(a, b))
        keys = k if keys is None else torch.cat([keys, k], dim=2)
        values = v if values is None else torch.cat([values, v], dim=2)
        out = module.attend_cached(q, [(keys, values)], past_lengths=[a], new_lengths=[b - a])
        outs.append(out.output)
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("cuts", [list(range(11)), [0, 4, 5, 10]], ids=["tokens", "chunks"])
def test_cached_steps_equal_the_uncached_answer(cuts):
    module = normed_module()
    x = inputs(1, 10, seed=4)
    close(_session(module, x, cuts), module(x).output, f"steps {cuts}", atol=1e-5)


def test_ragged_and_padded_steps_equal_the_stateless_answer():
    """Two sessions stepped together with unequal new tokens: attend_cached's per-row loop
    and attend_padded's one kernel, over values normed once when projected."""
    module = normed_module()
    xs = [inputs(1, 9, seed=5), inputs(1, 7, seed=6)]
    past, new = [6, 3], [3, 2]
    T = max(new)
    q_rows, kv = [], []
    for x, p, n in zip(xs, past, new, strict=True):
        chunk = torch.cat([x[:, p : p + n], torch.zeros(1, T - n, 48)], dim=1)  # (1, T, E)
        _, k, v = module.project(x[:, : p + n])
        q_rows.append(module.project(chunk, torch.arange(p, p + T))[0])
        kv.append((k, v))
    q = torch.cat(q_rows)
    got = module.attend_cached(q, kv, past_lengths=past, new_lengths=new).output
    width = max(p + n for p, n in zip(past, new, strict=True))
    keys, values = torch.zeros(2, 2, width, 16), torch.zeros(2, 2, width, 16)
    for b, (k, v) in enumerate(kv):
        keys[b, :, : k.shape[2]], values[b, :, : v.shape[2]] = k[0], v[0]
    padded = module.attend_padded(q, keys, values, past_lengths=past, new_lengths=new).output
    for b, (x, p, n) in enumerate(zip(xs, past, new, strict=True)):
        want = module(x[:, : p + n]).output[:, p:]  # (1, n, E)
        close(got[b : b + 1, :n], want, f"row {b}", atol=1e-5)
        close(padded[b : b + 1, :n], want, f"padded row {b}", atol=1e-5)


def test_config_needs_a_qk_norm_per_head_and_round_trips(tmp_path):
    for qk_norm in (None, {"scope": "projection"}):
        with pytest.raises(ValueError, match="v_norm needs qk_norm with scope 'head'"):
            dataclasses.replace(NORMED, qk_norm=qk_norm)
    with pytest.raises(ValueError, match="v_norm must be a bool"):
        dataclasses.replace(NORMED, v_norm="yes")
    assert NORMED.to_dict()["v_norm"] is True
    assert AttentionConfig.from_dict(NORMED.to_dict()) == NORMED
    assert "v_norm" not in dataclasses.replace(NORMED, v_norm=False).to_dict()
    module = normed_module()
    path = tmp_path / "normed.safetensors"
    save_checkpoint(module, path)
    loaded = load_checkpoint(path)
    assert loaded.config == NORMED
    x = inputs(1, 6)
    assert torch.equal(loaded(x).output, module(x).output)


def test_the_value_bound_is_the_norms_whatever_the_input():
    """|v_i| <= sqrt(head_dim) after a norm without a gain (a head with one nonzero value
    reaches it): the bound holds for inputs from 1e-10 to 1e20 and does not grow with them."""
    module = normed_module()
    wb = weight_bounds(module)
    assert wb.v_norm == pytest.approx(math.sqrt(16), rel=2e-3)
    g = torch.Generator().manual_seed(7)
    for trial in range(11):
        x = torch.randn(2, 7, 48, generator=g) * 10.0 ** (3 * trial - 10)
        with torch.no_grad():
            _, _, v = module.project(x)
        _, _, v_b = projected_bounds(float(x.abs().max()), 48, wb, rotary=True)
        assert float(v.abs().max()) <= v_b == wb.v_norm
    with torch.no_grad():  # one nonzero value in a head: |v_0| / rms = sqrt(D)
        module.wqkv.weight[-32:].zero_()
        module.wqkv.bias[-32:].zero_()
        module.wqkv.weight[-32, 0] = 1.0
        _, _, v = module.project(inputs(1, 3))
    reached = float(v.abs().max())
    assert reached == pytest.approx(4.0, rel=1e-5) and reached <= wb.v_norm
