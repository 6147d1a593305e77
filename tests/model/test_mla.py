"""Multi-head latent attention (AttentionConfig.mla), served absorbed into MQA, against a
float64 reference written here from Hugging Face's DeepseekV3Attention in its DECOMPRESSED
form (k_nope and v of every head from kv_b, k = [k_nope; rope(k_rope)], a plain softmax):
stateless (causal or not, padded, batched), weights (heads, a query range), head_mask,
session steps over the cache's layout, the state dict, checkpoints, the KV bytes per token
(K alone: its values are its keys), and what MLA declines (decode_one, the plain overflow
bounds, CUDA graphs, pruning, pooling). With an output gate (Ling 3.0's
BailingHybridAttention: each head's output after its W_uv times sigmoid(wgate x), one value
per head or per dim, before wo) on every one of those paths."""

from __future__ import annotations

import math

import pytest
import torch

from mha_serve.model import (
    AttentionConfig,
    MultiHeadAttention,
    init_weights,
    load_checkpoint,
    save_checkpoint,
)
from mha_serve.model.overflow import weight_bounds

# C = 24, R = 8, N = 12, V = 10, Q = 20 over E = 48, H = 4: head_dim R + C = 32.
E, H, C, R, N, V, Q = 48, 4, 24, 8, 12, 10, 20
THETA = 50.0  # short wavelengths: a wrong rotation or position shows far above tolerance
RTOL, ATOL = 1e-5, 1e-5


def config(
    *, q_lora: bool = True, bias: bool = True, interleaved: bool = False, nope: bool = False, **kw
):
    mla = {"kv_lora_rank": C, "rope_dim": R, "nope_dim": N, "v_head_dim": V}
    if q_lora:
        mla["q_lora_rank"] = Q
    rope = None if nope else {"theta": THETA, "interleaved": interleaved}
    return AttentionConfig(E, H, bias=bias, rope=rope, mla={**mla, "eps": 1e-5}, **kw)


def make(seed: int = 0, **kw) -> MultiHeadAttention:
    module = MultiHeadAttention(config(**kw))
    init_weights(module, seed)
    with torch.no_grad():  # biases and norm gains as large as weights: each one's place shows
        for name, p in module.named_parameters():
            if name.endswith("bias"):
                p.uniform_(-0.5, 0.5, generator=torch.Generator().manual_seed(len(name)))
        if module.wgate is not None:  # a gate far from 1/2: a gate on the wrong dims shows
            module.wgate.weight.mul_(8.0)
    return module.eval()


def tokens(B: int, L: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(B, L, E, generator=torch.Generator().manual_seed(seed))


def _rope(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x (..., L, R) rotated at positions 0..L-1: halves (rotate_half) or pairs."""
    L = x.shape[-2]
    freq = THETA ** (-torch.arange(0, R, 2, dtype=torch.float64) / R)  # (R/2,)
    angle = torch.arange(L, dtype=torch.float64)[:, None] * freq  # (L, R/2)
    cos, sin = angle.cos(), angle.sin()
    if interleaved:
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
    a, b = x[..., : R // 2], x[..., R // 2 :]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def reference(
    module: MultiHeadAttention,
    x: torch.Tensor,
    *,
    lengths: torch.Tensor | None = None,
    causal: bool = True,
    head_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output (B, L, E), weights (B, H, L, L)) in float64, HF's decompressed MLA."""
    cfg = module.config
    m = cfg.mla
    p = {k: t.double() for k, t in module.state_dict().items()}
    x = x.double()
    B, L, _ = x.shape

    def linear(name: str, h: torch.Tensor) -> torch.Tensor:
        out = h @ p[f"{name}.weight"].T
        return out + p[f"{name}.bias"] if f"{name}.bias" in p else out

    def rms(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + m.eps) * w

    if m.q_lora_rank is None:
        q = linear("q", x)
    else:
        q = linear("q_b", rms(linear("q_a", x), p["q_a_norm"]))
    q = q.view(B, L, H, N + R).transpose(1, 2)  # (B, H, L, N + R)
    q_nope, q_rope = q[..., :N], q[..., N:]
    kv = linear("kv_a", x)  # (B, L, C + R)
    latent, k_rope = rms(kv[..., :C], p["kv_a_norm"]), kv[..., C:]
    kv = linear("kv_b", latent).view(B, L, H, N + V).transpose(1, 2)  # (B, H, L, N + V)
    k_nope, v = kv[..., :N], kv[..., N:]
    k_rope = k_rope[:, None]  # (B, 1, L, R): without rope (NoPE), not rotated
    if cfg.rope is not None:
        q_rope, k_rope = _rope(q_rope, cfg.rope.interleaved), _rope(k_rope, cfg.rope.interleaved)
    k_rope = k_rope.expand(B, H, L, R)  # shared by every head
    q = torch.cat([q_nope, q_rope], dim=-1)
    k = torch.cat([k_nope, k_rope], dim=-1)  # (B, H, L, N + R)
    scores = q @ k.transpose(-1, -2) * (N + R) ** -0.5  # (B, H, L, L)
    allowed = torch.ones(B, 1, L, L, dtype=torch.bool)
    if causal:
        allowed &= torch.ones(L, L, dtype=torch.bool).tril()
    if lengths is not None:
        allowed &= (torch.arange(L)[None, :] < lengths[:, None])[:, None, None, :]
    weights = scores.masked_fill(~allowed, -math.inf).softmax(-1)  # (B, H, L, L)
    y = weights @ v  # (B, H, L, V)
    if head_mask is not None:
        y = y * head_mask.double().view(1, H, 1, 1)
    y = y.transpose(1, 2)  # (B, L, H, V)
    if cfg.output_gate:  # BailingHybridAttention's: attn_output * sigmoid(g_proj(x)), per head
        y = y * torch.sigmoid(linear("wgate", x)).view(B, L, H, -1)  # (.., 1 | V): per dim
    out = linear("wo", y.reshape(B, L, H * V))
    if lengths is not None:
        real = torch.arange(L)[None, :] < lengths[:, None]  # (B, L)
        out = out.masked_fill(~real[:, :, None], 0.0)
        weights = weights.masked_fill(~real[:, None, :, None], 0.0)
    return out, weights


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    diff = (got.double() - want).abs()
    print(f"max abs diff {diff.max():.2e}, mean {diff.mean():.2e}")
    torch.testing.assert_close(got.double(), want, rtol=RTOL, atol=ATOL)


VARIANTS = {
    "q_lora_bias_halves": {},
    "q_lora_no_bias_pairs": {"bias": False, "interleaved": True},  # DeepSeek V3's layout
    "no_q_lora_bias_pairs": {"q_lora": False, "interleaved": True},
    "no_q_lora_no_bias_halves": {"q_lora": False, "bias": False},  # DeepSeek-V2-Lite's
    "no_q_lora_nope": {"q_lora": False, "bias": False, "nope": True},  # Kimi Linear's
    # Ling 3.0's (BailingHybridAttention): q_proj, pairs, a sigmoid gate per head
    "gate_per_head": {
        "q_lora": False,
        "interleaved": True,
        "output_gate": True,
        "output_gate_per_head": True,
    },
    "gate_per_dim_q_lora": {"output_gate": True},  # (H * V gate values, biased)
}


def gate_of(module: MultiHeadAttention, x: torch.Tensor) -> dict:
    """The out_gate argument of a merge of tokens x: {} for a module without a gate."""
    return {} if module.wgate is None else {"out_gate": module.output_gate(x)}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("causal", [True, False])
def test_stateless_padded_batch_equals_the_decompressed_reference(variant, causal):
    module = make(**VARIANTS[variant])
    x = tokens(3, 11)
    lengths = torch.tensor([11, 6, 1])
    want, want_w = reference(module, x, lengths=lengths, causal=causal)
    with torch.no_grad():
        fast = module(x, lengths=lengths, causal=causal)
        slow = module(x, lengths=lengths, causal=causal, need_weights=True)
        part = module(
            x,
            lengths=lengths,
            causal=causal,
            need_weights=True,
            weight_heads=[3, 0],
            query_range=(2, 9),
        )
        whole = module(x[:1], causal=causal)  # unpadded: SDPA with no mask at all
    close(fast.output, want)
    close(slow.output, want)
    close(slow.weights, want_w)
    close(part.weights, want_w[:, [3, 0], 2:9])
    close(whole.output, reference(module, x[:1], causal=causal)[0])


def test_batched_equals_unbatched():
    module = make()
    x = tokens(3, 9, seed=4)
    with torch.no_grad():
        batched = module(x, causal=True).output
        alone = torch.cat([module(x[b : b + 1], causal=True).output for b in range(3)])
    torch.testing.assert_close(batched, alone, rtol=1e-6, atol=1e-6)


def test_head_mask_gates_each_head_before_its_w_uv():
    module = make(interleaved=True)
    x = tokens(2, 7, seed=2)
    gate = torch.tensor([1.0, 0.0, -0.5, 2.0])
    with torch.no_grad():
        got = module(x, causal=True, head_mask=gate).output
    close(got, reference(module, x, head_mask=gate)[0])


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_session_grown_token_by_token_equals_the_stateless_answer(variant):
    """Each token projected at its absolute position, its K/V appended to the session's
    keys as the cache holds them (one kv head of R + C), then attended: attend_cached with
    and without weights, attend_step, attend_padded (two sessions in one kernel)."""
    module = make(**VARIANTS[variant])
    L = 9
    x = tokens(2, L, seed=5)
    want, want_w = reference(module, x)
    keys = [torch.zeros(1, 1, 0, R + C) for _ in range(2)]
    values = [torch.zeros(1, 1, 0, R + C) for _ in range(2)]
    with torch.no_grad():
        for t in range(L):
            qs = []
            for b in range(2):
                q, k, v = module.project(x[b : b + 1, t : t + 1], torch.tensor([t]))
                assert q.shape == (1, H, 1, R + C) and k.shape == v.shape == (1, 1, 1, R + C)
                keys[b] = torch.cat([keys[b], k], dim=2)
                values[b] = torch.cat([values[b], v], dim=2)
                qs.append(q)
                gate = gate_of(module, x[b : b + 1, t : t + 1])
                step = module.attend_step(q, keys[b], values[b], t, **gate)
                close(step[0, 0], want[b, t])
            q = torch.cat(qs)
            gate = gate_of(module, x[:, t : t + 1])
            kv = list(zip(keys, values, strict=True))
            out = module.attend_cached(q, kv, past_lengths=[t, t], new_lengths=[1, 1], **gate)
            close(out.output[:, 0], want[:, t])
            out = module.attend_cached(
                q, kv, past_lengths=[t, t], new_lengths=[1, 1], need_weights=True, **gate
            )
            close(out.output[:, 0], want[:, t])
            close(out.weights[:, :, 0], want_w[:, :, t, : t + 1])
            padded = module.attend_padded(
                q,
                torch.cat(keys),
                torch.cat(values),
                past_lengths=[t, t],
                new_lengths=[1, 1],
                **gate,
            )
            close(padded.output[:, 0], want[:, t])


def test_a_prefill_then_steps_with_a_head_mask_equal_the_stateless_answer():
    """A chunk of tokens at once, then single tokens, through attend_cached (with a gate)."""
    module = make(q_lora=False)
    x = tokens(1, 8, seed=6)
    gate = torch.tensor([0.5, 1.0, 0.0, 1.5])
    want = reference(module, x, head_mask=gate)[0]
    with torch.no_grad():
        q, k, v = module.project(x[:, :5])
        out = module.attend_cached(q, [(k, v)], past_lengths=[0], new_lengths=[5], head_mask=gate)
        close(out.output, want[:, :5])
        for t in range(5, 8):
            q, k_t, v_t = module.project(x[:, t : t + 1], torch.tensor([t]))
            k, v = torch.cat([k, k_t], dim=2), torch.cat([v, v_t], dim=2)
            out = module.attend_cached(
                q, [(k, v)], past_lengths=[t], new_lengths=[1], head_mask=gate
            )
            close(out.output[0, 0], want[0, t])


@pytest.mark.parametrize(
    ("kw", "keys"),
    [
        ({}, {"q_a.weight", "q_a.bias", "q_a_norm", "q_b.weight", "kv_a.bias"}),
        ({"bias": False}, {"q_a.weight", "q_a_norm", "q_b.weight"}),
        ({"q_lora": False}, {"q.weight", "q.bias", "kv_a.bias"}),
        ({"q_lora": False, "bias": False}, {"q.weight"}),
    ],
)
def test_state_dict_keys_and_shapes_are_hf_s(kw, keys):
    """No wqkv: q_a, q_a_norm, q_b (or q), kv_a, kv_a_norm, kv_b and wo, in HF's shapes;
    biases on q_a (or q), kv_a and wo only."""
    state = MultiHeadAttention(config(**kw)).state_dict()
    keys = keys | {"kv_a.weight", "kv_a_norm", "kv_b.weight", "wo.weight"}
    if kw.get("bias", True):
        keys |= {"wo.bias"}
    assert set(state) == keys
    shapes = {
        "q_a.weight": (Q, E),
        "q_a.bias": (Q,),
        "q_a_norm": (Q,),
        "q_b.weight": (H * (N + R), Q),
        "q.weight": (H * (N + R), E),
        "q.bias": (H * (N + R),),
        "kv_a.weight": (C + R, E),
        "kv_a.bias": (C + R,),
        "kv_a_norm": (C,),
        "kv_b.weight": (H * (N + V), C),
        "wo.weight": (E, H * V),
        "wo.bias": (E,),
    }
    assert {k: tuple(t.shape) for k, t in state.items()} == {k: shapes[k] for k in state}


def test_init_is_seeded_and_draws_every_parameter():
    a, b, c = (MultiHeadAttention(config()) for _ in range(3))
    for module, seed in ((a, 3), (b, 3), (c, 4)):
        init_weights(module, seed)
    for name, p in a.state_dict().items():
        assert torch.equal(p, b.state_dict()[name]), name
        assert not torch.equal(p, c.state_dict()[name]), name
    assert not torch.equal(a.kv_a_norm, torch.ones(C))  # the gains are drawn too


def test_checkpoint_round_trip_and_shape_checks_name_the_key(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    module = make(interleaved=True)
    path = tmp_path / "mla.safetensors"
    save_checkpoint(module, path)
    loaded = load_checkpoint(path)
    assert loaded.config == module.config
    x = tokens(2, 6)
    with torch.no_grad():
        assert torch.equal(loaded(x, causal=True).output, module(x, causal=True).output)
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
    tensors = load_file(path)
    tensors["kv_b.weight"] = tensors["kv_b.weight"][:-1]
    del tensors["kv_a_norm"]
    tensors["wqkv.weight"] = torch.zeros(3, 3)
    save_file(tensors, path, metadata=metadata)
    with pytest.raises(ValueError) as err:
        load_checkpoint(path)
    for piece in (
        f"key 'kv_b.weight' has shape ({H * (N + V) - 1}, {C}), expected ({H * (N + V)}, {C})",
        f"missing key 'kv_a_norm' (expected shape ({C},))",
        "unexpected key 'wqkv.weight'",
    ):
        assert piece in str(err.value), str(err.value)


def test_the_cache_holds_one_kv_head_of_rope_plus_latent_dims_per_token():
    """MLA's point: per token and layer R + C cached values (one kv head of R + C, K alone:
    its values are its keys), where HF's decompressed K/V would be H (N + R) + H V: here 32
    vs 120; the same budget holds twice the tokens of a cache that kept V apart."""
    from mha_serve.cache.kv_cache import KVCache

    assert config().values_are_keys and not AttentionConfig(E, H).values_are_keys
    cache = KVCache.from_config(config(), budget_bytes=2**16, block_size=4)
    assert cache.values_are_keys and cache.v is cache.k
    assert cache.bytes_per_token == (R + C) * 4
    assert cache.bytes_per_token < (H * (N + R) + H * V) * 4
    apart = KVCache(num_kv_heads=1, head_dim=R + C, budget_bytes=2**16, block_size=4)
    assert cache.num_blocks == 2 * apart.num_blocks and cache.nbytes == apart.nbytes


def test_what_mla_declines():
    """decode_one (its projection is not wqkv's), the plain overflow bounds (which describe
    wqkv's rows: inf, bounding nothing; its own are WeightBounds.latent,
    tests/model/test_mla_bounds.py), CUDA graphs, head pruning and kv-head pooling: each
    declines rather than compute something else."""
    from mha_serve.engine.graphs import StaticDecode
    from mha_serve.model.convert import pool_kv_heads
    from mha_serve.model.prune import prune_heads

    module = make()
    assert not module.decodes_in_one
    x = tokens(1, 1)
    slot = torch.zeros(1, 2, 1, R + C)
    assert module.decode_one(x, slot, torch.zeros(1, 1, 1, R + C), slot[:, 1:]) is None
    bounds = weight_bounds(module)
    assert bounds.q_norm == bounds.k_norm == bounds.q_row == bounds.o_row_l1 == math.inf
    assert bounds.latent is not None
    assert not StaticDecode.supports(module.config)
    with pytest.raises(ValueError, match="multi-head latent attention .* head_mask instead"):
        prune_heads(module, [1])
    with pytest.raises(ValueError, match="already share one latent K/V head"):
        pool_kv_heads(module, 1)


@pytest.mark.parametrize("per_head", [True, False], ids=["per_head", "per_dim"])
def test_a_gated_mla_saves_its_gate_and_merges_only_with_it(tmp_path, per_head):
    """wgate beside MLA's own keys, (H, E) per head or (H * V, E) per dim of each merged
    head (not H * (R + C), the absorbed head_dim), its bias with bias; the checkpoint round
    trip; a merge without the gate refused; the gate matters (a gate of zeros, sigmoid 1/2,
    answers otherwise)."""
    module = make(output_gate=True, output_gate_per_head=per_head)
    rows = H if per_head else H * V
    assert module.config.gate_width == rows
    state = module.state_dict()
    assert state["wgate.weight"].shape == (rows, E) and state["wgate.bias"].shape == (rows,)
    path = tmp_path / "gated_mla.safetensors"
    save_checkpoint(module, path)
    loaded = load_checkpoint(path)
    assert loaded.config == module.config
    x = tokens(1, 6, seed=7)
    with torch.no_grad():
        want = module(x, causal=True).output
        assert torch.equal(loaded(x, causal=True).output, want)
        q, k, v = module.project(x)
        with pytest.raises(ValueError, match=r"has an output gate .* out_gate is None"):
            module.attend_step(q, k, v, 0)
        module.wgate.weight.zero_()
        module.wgate.bias.zero_()
        assert (module(x, causal=True).output - want).abs().max() > 0.05


def test_a_per_head_gate_equals_a_per_dim_gate_of_each_heads_row_repeated():
    """The per-head gate is exact, not an approximation: the same module with a per-dim
    gate whose rows repeat each head's row V times answers the same."""
    per_head = make(q_lora=False, interleaved=True, output_gate=True, output_gate_per_head=True)
    per_dim = MultiHeadAttention(config(q_lora=False, interleaved=True, output_gate=True))
    state = dict(per_head.state_dict())
    state["wgate.weight"] = state["wgate.weight"].repeat_interleave(V, dim=0)
    state["wgate.bias"] = state["wgate.bias"].repeat_interleave(V, dim=0)
    per_dim.load_state_dict(state)
    x = tokens(2, 7, seed=8)
    with torch.no_grad():
        torch.testing.assert_close(
            per_head(x, causal=True).output, per_dim(x, causal=True).output, rtol=0, atol=1e-6
        )
