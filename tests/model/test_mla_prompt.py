"""Multi-head latent attention's expanded form (model/mla.py: a prompt's heads decompressed
from the latents, as Hugging Face computes them) against the float64 decompressed reference of
test_mla.py and against the absorbed form it stands in for: stateless prompts (causal or not,
padded, batched, head masks, a sliding window), bfloat16, steps over cached latents
(attend_cached_expanded), which requests stay absorbed (weights), the rule that chooses
(mla.expands) and the overflow check of the expanded tensors."""

from __future__ import annotations

import pytest
import torch

from mha_serve.model import AttentionConfig, MultiHeadAttention, init_weights, mla
from tests.model.test_mla import VARIANTS, C, E, H, R, close, config, make, reference, tokens

L = 70  # >= mla.EXPAND_MIN_ROWS: a prompt that runs expanded


@pytest.fixture
def expansions(monkeypatch):
    """How many times each form ran: mla.expand_keys (expanded) and mla.project (absorbed),
    the real functions, counted."""
    calls = {"expanded": 0, "absorbed": 0}
    expand, project = mla.expand_keys, mla.project

    def counted_expand(*a, **kw):
        calls["expanded"] += 1
        return expand(*a, **kw)

    def counted_project(*a, **kw):
        calls["absorbed"] += 1
        return project(*a, **kw)

    monkeypatch.setattr(mla, "expand_keys", counted_expand)
    monkeypatch.setattr(mla, "project", counted_project)
    return calls


def test_the_rule_expands_prompts_and_long_chunks_never_a_decode_step():
    """From EXPAND_MIN_ROWS rows of a prompt on; after cached keys only once the attention it
    saves outweighs decompressing them, so a chunk after many keys needs more rows; a decode
    step (one row) never. DeepSeek-V3's heads: the multiply-adds alone break even at 170 rows
    over many cached keys, EXPAND_COST x that is 256."""
    deepseek = AttentionConfig(
        7168, 128, mla={"kv_lora_rank": 512, "rope_dim": 64, "nope_dim": 128, "v_head_dim": 128}
    )
    assert mla.expanded_width(deepseek) == 192
    rows = mla.EXPAND_MIN_ROWS
    assert mla.expands(deepseek, rows, 0) and not mla.expands(deepseek, rows - 1, 0)
    assert not mla.expands(deepseek, 1, 4096) and not mla.expands(deepseek, 1, 0)
    assert mla.expands(deepseek, 256, 1 << 20) and not mla.expands(deepseek, 255, 1 << 20)
    fewest = {
        past: next(t for t in range(1, 1024) if mla.expands(deepseek, t, past))
        for past in (0, 256, 4096)
    }
    assert fewest == {0: rows, 256: 188, 4096: 249}, fewest
    assert not mla.expands(AttentionConfig(E, H), 1000, 0)  # (no mla: never)
    # a latent no wider than the expanded heads saves nothing: never
    narrow = {"kv_lora_rank": 8, "rope_dim": 4, "nope_dim": 8, "v_head_dim": 8}  # 12 = 12
    assert not mla.expands(AttentionConfig(E, H, mla=narrow), 1000, 0)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("causal", [True, False])
def test_a_padded_prompt_batch_expanded_equals_the_reference_and_the_absorbed_form(
    variant, causal, expansions
):
    module = make(**VARIANTS[variant])
    x = tokens(3, L, seed=3)
    lengths = torch.tensor([L, 40, 1])
    want = reference(module, x, lengths=lengths, causal=causal)[0]
    with torch.no_grad():
        got = module(x, lengths=lengths, causal=causal)
        assert expansions == {"expanded": 1, "absorbed": 0}
        absorbed = module(x, lengths=lengths, causal=causal, need_weights=True)  # stays absorbed
        assert expansions == {"expanded": 1, "absorbed": 1}
        whole = module(x[:1], causal=causal)  # unpadded: SDPA without a mask
    close(got.output, want)
    assert got.overflow.rows() == []  # (measured on the expanded tensors)
    torch.testing.assert_close(got.output, absorbed.output, rtol=1e-5, atol=1e-6)
    close(whole.output, reference(module, x[:1], causal=causal)[0])


def test_batched_equals_unbatched_and_head_masks_gate_each_head(expansions):
    module = make(interleaved=True)
    x = tokens(3, L, seed=4)
    gate = torch.tensor([1.0, 0.0, -0.5, 2.0])
    with torch.no_grad():
        batched = module(x, causal=True, head_mask=gate).output
        alone = torch.cat(
            [module(x[b : b + 1], causal=True, head_mask=gate).output for b in range(3)]
        )
    assert expansions["expanded"] == 4 and expansions["absorbed"] == 0
    torch.testing.assert_close(batched, alone, rtol=1e-6, atol=1e-6)
    close(batched, reference(module, x, head_mask=gate)[0])


def test_a_sliding_window_expanded_equals_the_absorbed_form(expansions):
    """No window in the float64 reference: against the absorbed form (itself checked against
    it window and all by tests/engine/test_mla_sessions.py)."""
    module = MultiHeadAttention(config(sliding_window=17))
    init_weights(module, 5)
    x = tokens(2, L, seed=6)
    lengths = torch.tensor([L, 50])
    with torch.no_grad():
        got = module(x, lengths=lengths).output
        want = module(x, lengths=lengths, need_weights=True).output
    assert expansions == {"expanded": 1, "absorbed": 1}
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_bfloat16_expanded_is_as_close_to_the_reference_as_absorbed():
    """Both forms round differently in bfloat16 (the expanded one decompresses keys, the
    absorbed one absorbs queries): each within 0.03 of outputs near 1 from the float64
    answer, and the expanded one no further from it than twice the absorbed one's error."""
    module = make(q_lora=False, interleaved=True).to(torch.bfloat16)
    x = tokens(2, L, seed=7)
    want = reference(module, x.to(torch.bfloat16))[0]
    with torch.no_grad():
        got = module(x.to(torch.bfloat16), causal=True).output.double()
        absorbed = module(x.to(torch.bfloat16), causal=True, need_weights=True).output.double()
    err, err_absorbed = (got - want).abs().max(), (absorbed - want).abs().max()
    print(f"bfloat16 max abs error: expanded {err:.2e}, absorbed {err_absorbed:.2e}")
    assert want.abs().max() > 0.5
    assert err < 0.03 and err_absorbed < 0.03
    assert err < 2 * err_absorbed + 1e-3


@pytest.mark.parametrize("variant", ["q_lora_bias_halves", "no_q_lora_nope"])
def test_steps_over_cached_latents_equal_the_stateless_answer(variant):
    """A prompt expanded (attend_cached_expanded over the latents it cached), decode steps
    absorbed over the same latents, then a long chunk expanded over them all (its keys
    decompressed too), and two sequences at once, one of them padded: each equal to the
    reference over the whole sequence (cached against uncached)."""
    module = make(**VARIANTS[variant])
    total = L + 3 + L
    x = tokens(2, total, seed=8)
    want = reference(module, x)[0]
    with torch.no_grad():
        q, k = module.project_expanded(x[:, :L])  # (2, H, L, D_x), (2, 1, L, R + C)
        assert q.shape == (2, H, L, mla.expanded_width(module.config))
        assert k.shape == (2, 1, L, R + C)
        keys = [k[:1], k[1:]]
        out = mla.attend_cached_expanded(
            module, q, keys, past_lengths=[0, 0], new_lengths=[L, L], first_keys=[0, 0]
        )
        close(out, want[:, :L])
        for t in range(L, L + 3):  # decode steps, absorbed
            q, k_t, _ = module.project(x[:, t : t + 1], torch.tensor([t]))
            keys = [torch.cat([keys[b], k_t[b : b + 1]], dim=2) for b in range(2)]
            out = module.attend_cached(
                q, list(zip(keys, keys, strict=True)), past_lengths=[t, t], new_lengths=[1, 1]
            )
            close(out.output[:, 0], want[:, t])
        start = L + 3  # a chunk after the cached keys; sequence 1's last 20 tokens padding
        positions = torch.arange(start, total)
        q, k = module.project_expanded(x[:, start:], positions)
        keys = [torch.cat([keys[0], k[:1]], dim=2), torch.cat([keys[1], k[1:, :, : L - 20]], dim=2)]
        out = mla.attend_cached_expanded(
            module,
            q,
            keys,
            past_lengths=[start, start],
            new_lengths=[L, L - 20],
            first_keys=[0, 0],
        )
    close(out[0], want[0, start:])
    close(out[1, : L - 20], want[1, start : total - 20])
    assert torch.equal(out[1, L - 20 :], torch.zeros(20, E))


def test_attend_cached_expanded_says_what_is_wrong():
    module = make()
    q, k = module.project_expanded(tokens(1, 4))
    with pytest.raises(
        ValueError, match=r"q must be \(batch >= 1, num_heads=4, new_len >= 1, expanded_width=20\)"
    ):
        mla.attend_cached_expanded(
            module, q[..., :-1], [k], past_lengths=[0], new_lengths=[4], first_keys=[0]
        )
    with pytest.raises(ValueError, match="keys must be"):
        mla.attend_cached_expanded(
            module, q, [k[:, :, :3]], past_lengths=[0], new_lengths=[4], first_keys=[0]
        )
    with pytest.raises(ValueError, match="multi-head latent attention"):
        MultiHeadAttention(AttentionConfig(E, H)).project_expanded(tokens(1, 4))


def test_the_expanded_forms_overflow_is_measured_on_its_own_tensors(expansions):
    """float16 with scores past its range: the expanded forward's check (its q, k, v, whose
    scores are the same dot products) refuses the rows, as the absorbed one's does."""
    module = make(q_lora=False, bias=False).half()
    with torch.no_grad():
        module.q.weight.mul_(64.0)
        module.kv_a.weight[C:].mul_(64.0)  # k_rope: the scores' rope part far past 65504
    x = tokens(2, L, seed=9).half()
    x[1] = 0.0  # a row whose scores are 0: kept
    with torch.no_grad():
        expanded = module(x)
        absorbed = module(x, need_weights=True)
    assert expansions == {"expanded": 1, "absorbed": 1}
    assert expanded.overflow.rows() == absorbed.overflow.rows() == [0]
