"""Multi-head latent attention's static bounds (mla_bounds.LatentBounds): no tensor its
projection, attention or merge makes exceeds them, for random weights and norm gains (with
and without q_lora_rank, biases, RoPE by halves or pairs, yarn's attention factor on cos and
sin) and adversarial inputs at the validated max |x|: the signs of the weights' top singular
vectors and of single rows, one-hot tokens, random signs; and the latent's sqrt(C) max|g| is
reached where one latent row carries all, so a bound without it would be passed."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mha_serve.model import AttentionConfig, MultiHeadAttention, init_weights
from mha_serve.model.mla import expand_keys, merge
from mha_serve.model.mla_bounds import latent_maxima
from mha_serve.model.norm import NORM_SLACK, rms_norm
from mha_serve.model.overflow import weight_bounds
from tests.model.test_mla import C, E, H, N, Q, R, V

A = 3.0  # the validated max |x| of every adversarial token
POSITIONS = [0, 1, 7, 100, 4095]  # where the tokens are rotated (rope angles of all sizes)

VARIANTS = {
    "q_lora_bias_halves": {},
    "q_lora_no_bias_pairs_yarn": {"bias": False, "interleaved": True, "yarn": 3.0},
    "no_q_lora_bias_pairs": {"q_lora": False, "interleaved": True},
    "no_q_lora_no_bias_halves_yarn": {"q_lora": False, "bias": False, "yarn": 0.4},
}


def module_of(seed: int, *, q_lora=True, bias=True, interleaved=False, yarn=None):
    """Random weights and biases, norm gains from -4 to 4 (a negative gain flips its sign)."""
    mla = {"kv_lora_rank": C, "rope_dim": R, "nope_dim": N, "v_head_dim": V, "eps": 1e-6}
    if q_lora:
        mla["q_lora_rank"] = Q
    rope = {"theta": 50.0, "interleaved": interleaved}
    if yarn is not None:  # cos and sin times the attention factor
        rope |= {"type": "yarn", "factor": 4.0, "attention_factor": yarn}
        rope["original_max_position_embeddings"] = 64
    module = MultiHeadAttention(AttentionConfig(E, H, bias=bias, rope=rope, mla=mla))
    init_weights(module, seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm"):
                p.uniform_(-4.0, 4.0, generator=g)
            elif name.endswith("bias"):
                p.uniform_(-1.0, 1.0, generator=g)
    return module.eval()


def adversarial_tokens(module: MultiHeadAttention, seed: int) -> torch.Tensor:
    """(n, E) tokens, each at max |x| = A: the signs of the top right singular vectors of
    the input projections (q_a or q, kv_a and its rope rows alone), of single rows of them,
    one-hot tokens, and random signs."""
    first = module.q_a if module.config.mla.q_lora_rank is not None else module.q
    g = torch.Generator().manual_seed(seed)
    directions = []
    for w in (first.weight, module.kv_a.weight, module.kv_a.weight[C:]):
        w = w.detach().double()
        directions += list(torch.linalg.svd(w, full_matrices=False).Vh[:4])
        directions += list(w[torch.randperm(w.shape[0], generator=g)[:4]])
    signs = torch.stack(directions).sign()
    signs[signs == 0] = 1
    random = torch.randint(0, 2, (16, E), generator=g).double() * 2 - 1
    one_hot = torch.eye(E)[torch.randperm(E, generator=g)[:8]].double()
    tokens = torch.cat([signs, -signs, random, one_hot, -one_hot])
    return (A * tokens).float()


def measured(module: MultiHeadAttention, x: torch.Tensor, positions: list[int]) -> dict:
    """The tensors the bounds bound, for each token of x (n, E) on its own at each position:
    max |.| of the hidden ones, of q', rope(k_rope), c; each head's L1 norms of q's rope and
    latent dims; max |q'_h . k'| against every token's k' (a new key: any of them may be);
    and sum |q'_h| |k'| (every partial sum's bound)."""
    m = module.config.mla
    n = x.shape[0]
    xs = x[None].expand(len(positions), n, E)  # (P, n, E): each token at each position
    at = torch.tensor(positions)[:, None].expand(len(positions), n)  # (P, n)
    with torch.inference_mode():
        q, k, _ = module.project(xs, at)  # (P, H, n, R + C), (P, 1, n, R + C)
        hidden = [F.linear(x, module.kv_a.weight, module.kv_a.bias)]
        if m.q_lora_rank is None:
            hidden.append(F.linear(x, module.q.weight, module.q.bias))
        else:
            u = F.linear(x, module.q_a.weight, module.q_a.bias)
            normed = rms_norm(u, module.q_a_norm, m.eps)
            hidden += [u, normed, F.linear(normed, module.q_b.weight)]
        q64 = q.double().transpose(0, 1).reshape(H, -1, R + C)  # (H, P n, R + C)
        k64 = k.double().reshape(-1, R + C)  # (P n, R + C)
        return {
            "hidden": max(float(h.abs().max()) for h in hidden),
            "q": float(q.abs().max()),
            "k_rope": float(k[..., :R].abs().max()),
            "latent": float(k[..., R:].abs().max()),
            "rope_l1": float(q[..., :R].abs().sum(-1).max()),
            "latent_l1": float(q[..., R:].abs().sum(-1).max()),
            "score": float((q64 @ k64.T).abs().max()),
            "abs_score": float((q64.abs() @ k64.abs().T).max()),
        }


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_no_tensor_exceeds_its_bound_for_adversarial_inputs(variant, seed):
    module = module_of(seed, **VARIANTS[variant])
    x = adversarial_tokens(module, seed)
    assert float(x.abs().max()) == A
    got = measured(module, x, POSITIONS)
    bound = latent_maxima(A, E, weight_bounds(module).latent)
    want = {k: bound.score(0.0) if "score" in k else getattr(bound, k) for k in got}
    print({k: f"{got[k]:.3g} <= {want[k]:.3g}" for k in got})
    for name in ("hidden", "q", "k_rope", "latent", "rope_l1", "latent_l1"):
        assert got[name] <= getattr(bound, name), name
    assert got["abs_score"] <= bound.score(0.0)  # new keys only: none cached
    assert got["score"] <= got["abs_score"]
    # cached keys of the same session, bounded by max |k'| alone
    assert got["abs_score"] <= bound.score(max(got["k_rope"], got["latent"]))


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_merge_and_output_stay_under_their_bounds(variant):
    """Attention over the adversarial tokens as one causal sequence, gated by 2.5: each
    head's W_uv y_lat is at most uv_l1 * gate * max|v|, the output ||wo||_1 times that."""
    module = module_of(3, **VARIANTS[variant])
    x = adversarial_tokens(module, 3)[None]  # (1, L, E)
    lb = weight_bounds(module).latent
    v_max = latent_maxima(A, E, lb).k
    gate = torch.full((H,), 2.5)
    with torch.inference_mode():
        q, k, v = module.project(x)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=module.scale)
        merged = merge(module, y * gate.view(1, H, 1, 1))  # (1, L, H V)
        out = module(x, causal=True, head_mask=gate).output
    assert float(y.abs().max()) <= v_max
    assert float(merged.abs().max()) <= lb.uv_l1 * 2.5 * v_max
    assert float(out.abs().max()) <= lb.o_row_l1 * lb.uv_l1 * 2.5 * v_max + lb.o_bias


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("seed", [0, 1])
def test_the_expanded_form_stays_under_the_same_bounds(variant, seed):
    """A prompt's expanded form (mla.expands) sums the same products in another order: every
    head's k_nope = W_uk c at most uk_l1 max|c|, v = W_uv c at most uv_l1 max|c|, and sum
    |q_x| |k_x| of its [rope; nope] queries and keys (every partial sum of its scores)
    within the absorbed scores' bound."""
    module = module_of(seed, **VARIANTS[variant])
    x = adversarial_tokens(module, seed)
    n = x.shape[0]
    xs = x[None].expand(len(POSITIONS), n, E)
    at = torch.tensor(POSITIONS)[:, None].expand(len(POSITIONS), n)
    lb = weight_bounds(module).latent
    bound = latent_maxima(A, E, lb)
    with torch.inference_mode():
        q, k = module.project_expanded(xs, at)  # (P, H, n, R + N), (P, 1, n, R + C)
        keys, values = expand_keys(module, k)  # (P, H, n, R + N) each (V <= R + N here)
    k_nope, v = keys[..., R : R + N], values[..., :V]
    assert float(k_nope.abs().max()) <= lb.uk_l1 * bound.latent
    assert float(v.abs().max()) <= lb.uv_l1 * bound.latent
    q64 = q.double().transpose(0, 1).reshape(H, -1, R + N).abs()  # (H, P n, R + N)
    k64 = keys.double().transpose(0, 1).reshape(H, -1, R + N).abs()
    abs_score = float((q64 @ k64.transpose(1, 2)).max())
    print(f"expanded sum |q| |k| {abs_score:.3g} <= {bound.score(0.0):.3g}")
    assert abs_score <= bound.score(0.0)


def test_the_latent_bound_is_reached_when_one_row_carries_the_latent():
    """kv_a's latent rows all zero but one: u = (w . x, 0, ..), normed to sqrt(C) in that
    place, times its gain: |c_0| = sqrt(C) |g_0|, the bound without its slack."""
    module = module_of(4)
    with torch.no_grad():
        module.kv_a.weight[1:C] = 0
        module.kv_a.bias[:C] = 0
        module.kv_a_norm.fill_(0.5)
        module.kv_a_norm[0] = -2.0
    x = adversarial_tokens(module, 4)
    got = measured(module, x, [0])["latent"]
    bound = weight_bounds(module).latent.latent
    assert bound == pytest.approx(NORM_SLACK * math.sqrt(C) * 2.0)
    assert bound / NORM_SLACK * 0.999 <= got <= bound


def test_a_zero_eps_or_weights_that_are_not_finite_bound_nothing():
    """eps 0: a zero latent is 0 / 0, NaN whatever the gains, so the norms bound nothing;
    an inf or NaN weight makes its bounds inf, never NaN (which max() could drop)."""
    module = module_of(5)
    lb = weight_bounds(module).latent
    assert lb.latent < math.inf and lb.hidden_fixed < math.inf
    with torch.no_grad():
        module.kv_b.weight[3, 2] = math.nan
    bad = weight_bounds(module).latent
    assert bad.uv_l1 == math.inf or bad.latent_l1_bias == math.inf
    assert not any(math.isnan(v) for v in vars(bad).values())
    cfg = module.config
    zero = MultiHeadAttention(
        AttentionConfig(E, H, rope=cfg.rope, mla={**vars(cfg.mla), "eps": 0.0})
    )
    init_weights(zero, 5)
    lb = weight_bounds(zero).latent
    assert lb.latent == lb.hidden_fixed == math.inf
    with torch.no_grad():  # (why: a zero token without bias has a zero latent)
        zero.kv_a.bias.zero_()
        _, k, _ = zero.project(torch.zeros(1, 1, E))
    assert k[..., R:].isnan().all()


@pytest.mark.parametrize("q_lora", [True, False])
@pytest.mark.parametrize("part", ["latent", "rope"])
def test_a_rank_one_model_reaches_its_score_and_query_bounds(part, q_lora):
    """Every factor aligned: q = r times one number (q_a one row and q_b one column, so
    the norm puts sqrt(Q) max|g| in one place; or q's rows r_j s with s of equal magnitudes,
    which sign(s) at max|x| fills), kv_a's latent one row (c one-hot), and either W_uk one
    column matching q_nope's signs with q and k's rope rows zero ("latent": |q'_h . c| is
    latent_l1 * max|c|, the score bound itself) or W_uk zero ("rope": q' is its rotated rope
    dims alone, yarn's factor 3 on cos and sin). Each bound is then within a small factor of
    what is reached, so a term or a rotation left out of it would be passed."""
    module = module_of(6, q_lora=q_lora, bias=False, yarn=3.0)
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        r = 5 * torch.randn(H * (N + R), generator=g)  # (q_b past q_a: both bounded)
        if q_lora:
            module.q_a.weight[1:] = 0
            module.q_a_norm.fill_(2.0)
            module.q_b.weight.copy_(torch.outer(r, torch.eye(Q)[0]))
        else:
            s = (torch.randint(0, 2, (E,), generator=g) * 2 - 1) / math.sqrt(E)
            module.q.weight.copy_(torch.outer(r, s))
        q_rows = (module.q_b if q_lora else module.q).weight.view(H, N + R, -1)
        module.kv_a.weight[1:C] = 0
        module.kv_a_norm.fill_(1.5)
        w = module.kv_b.weight.view(H, N + V, C)
        w[:, :N] = 0
        if part == "latent":
            w[:, :N, 0] = r.view(H, N + R)[:, :N].sign() * torch.rand(H, N, generator=g)
            q_rows[:, N:] = 0
            module.kv_a.weight[C:] = 0
    x = adversarial_tokens(module, 6)
    got = measured(module, x, POSITIONS)
    bound = latent_maxima(A, E, weight_bounds(module).latent)
    print(part, {k: f"{v:.3g}" for k, v in got.items()}, bound)
    for name in ("hidden", "q", "k_rope", "latent", "rope_l1", "latent_l1"):
        assert got[name] <= getattr(bound, name), name
    assert got["abs_score"] <= bound.score(0.0)
    if part == "latent":
        assert got["score"] >= 0.99 * bound.score(0.0)
    else:  # (the angle's best: sqrt(2) f of 2 f)
        assert got["q"] >= 0.5 * bound.q and got["rope_l1"] >= 0.4 * bound.rope_l1
