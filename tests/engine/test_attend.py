"""engine/attend.py: a batch of session steps attending batched (padded groups, one kernel
each) gives the per-session path's answers and a full causal recompute's, for MHA/GQA/MQA,
ragged pasts and new lengths, sliding windows with rotary positions, soft-capping, ALiBi,
multi-head latent attention, head masks and a bfloat16 model; and the engine picks the path by device unless told."""

from __future__ import annotations

import math

import pytest
import torch

from mha_serve.config import default_models
from mha_serve.engine import Engine, ModelSpec
from mha_serve.engine.attend import (
    BATCHED_MIN_FILL,
    batched_by_default,
    plan_groups,
)
from mha_serve.model import AttentionConfig, MultiHeadAttention
from tests.engine_calls import req, run, run_batch
from tests.helpers import suite_torch_device

MLA = {"kv_lora_rank": 24, "rope_dim": 8, "nope_dim": 12, "v_head_dim": 10, "q_lora_rank": 20}
ATOL = 1e-5  # float32: the two paths and a recompute differ only in summation order
MODELS = [
    *default_models(),
    # Small blocks so that sessions span many; a window that frees them as sessions grow.
    ModelSpec(
        "win",
        AttentionConfig(64, 8, 2, sliding_window=6, rope={"theta": 100.0}),
        seed=4,
        kv_block_size=4,
    ),
    ModelSpec("cap", AttentionConfig(64, 4, 1, softcap=5.0), seed=5),
    ModelSpec("sinks", AttentionConfig(64, 8, 2, sinks=True, sliding_window=6), seed=6),
    # BLOOM's ALiBi over 12 heads (not a power of 2) in 4 KV groups, small blocks.
    ModelSpec("alibi", AttentionConfig(96, 12, 4, alibi=True), seed=9, kv_block_size=4),
    # Falcon-RW's form: slope * position in bfloat16, the bias scaled; with a window, so
    # that a step's keys start past position 0 (its terms need absolute positions).
    ModelSpec(
        "alibi_rw",
        AttentionConfig(
            96, 12, 4, alibi=True, alibi_scale=8**-0.5, alibi_bfloat16=True, sliding_window=7
        ),
        seed=10,
        kv_block_size=4,
    ),
]
NAMES = [m.name for m in MODELS]
# Multi-head latent attention, absorbed: MQA over one kv head of rope_dim + kv_lora_rank.
# Kept out of MODELS, which other modules import for paths MLA declines (decode_one, CUDA
# graphs); tests/engine/test_lone_step.py runs its lone steps and decode_now.
MLA_MODEL = ModelSpec(
    "mla",
    AttentionConfig(64, 4, rope={"theta": 100.0, "interleaved": True}, mla=MLA),
    seed=11,
    kv_block_size=4,
)
# Queries scaled by position and q/k norms after RoPE (Ministral 3, Llama 4's NoPE and RoPE
# layers, nanochat, Hunyuan v1, Mistral 4's MLA): floors small enough that the pasts below
# cross several; kept out of MODELS too (CUDA graphs decline the scale and the norm).
POSITION_MODELS = [
    ModelSpec(
        "ministral3",
        AttentionConfig(64, 4, 2, rope={"theta": 500.0}, query_scale={"beta": 0.4, "floor_div": 4}),
        seed=13,
        kv_block_size=4,
    ),
    ModelSpec(  # (p + 1) / floor_div, the product in float32; with a window
        "llama4_nope",
        AttentionConfig(
            64,
            4,
            2,
            sliding_window=12,
            query_scale={"beta": 0.6, "floor_div": 3, "offset": 1, "float32": True},
        ),
        seed=14,
    ),
    ModelSpec(
        "llama4_rope",
        AttentionConfig(
            64,
            4,
            2,
            rope={"theta": 500.0, "interleaved": True},
            qk_norm={"after_rope": True, "gain": False},
        ),
        seed=15,
    ),
    ModelSpec(
        "nanochat",
        AttentionConfig(
            64,
            4,
            4,
            rope={"theta": 500.0, "reverse": True},
            qk_norm={"after_rope": True, "gain": False},
        ),
        seed=16,
    ),
    ModelSpec(
        "hunyuan",
        AttentionConfig(64, 4, 1, rope={"theta": 500.0}, qk_norm={"after_rope": True}),
        seed=17,
    ),
    ModelSpec(
        "mistral4",
        AttentionConfig(
            64,
            4,
            rope={"theta": 100.0, "interleaved": True},
            mla=MLA,
            query_scale={"beta": 0.5, "floor_div": 5},
        ),
        seed=18,
        kv_block_size=4,
    ),
]
# Pasts and first steps whose key counts (3, 6, 21, 35, 41, 301) make two padded groups
# ({41, 35, 21} and {6, 3}) and one session alone (301), then decode steps together.
PASTS, NEWS = [0, 5, 17, 33, 40, 300], [3, 1, 4, 2, 1, 1]


def make_engine(batched: bool | None, dtype=torch.float32) -> Engine:
    return Engine(
        [*MODELS, MLA_MODEL, *POSITION_MODELS],
        device=suite_torch_device(),
        dtype=dtype,
        max_response_bytes=2**28,
        batched_attention=batched,
    )


@pytest.fixture(scope="module")
def engines() -> dict[bool, Engine]:
    return {flag: make_engine(flag) for flag in (False, True)}


def seq(n: int, seed: int, width: int) -> torch.Tensor:
    return torch.randn(1, n, width, generator=torch.Generator().manual_seed(seed))


def decode_together(engine, name, rounds, head_mask=None):
    """Sessions prefilled to PASTS, then stepped together: NEWS tokens, then `rounds` single
    tokens each round. Every round's outputs, and each session's whole sequence."""
    hosted = engine.get(name)
    width = hosted.spec.attention.embed_dim
    full = [
        seq(p + n + rounds, seed=i, width=width)
        for i, (p, n) in enumerate(zip(PASTS, NEWS, strict=True))
    ]
    ids = []
    for i, p in enumerate(PASTS):
        sid = engine.sessions.create(name, None, None).session_id
        if p:
            run(engine, hosted, req(name, full[i][:, :p], session_id=sid, head_mask=head_mask))
        ids.append(sid)
    outs = []
    spans = [[(p, p + n) for p, n in zip(PASTS, NEWS, strict=True)]]
    spans += [
        [(p + n + r, p + n + r + 1) for p, n in zip(PASTS, NEWS, strict=True)]
        for r in range(rounds)
    ]
    for span in spans:
        calls = [
            req(name, full[i][:, a:b], session_id=ids[i], head_mask=head_mask)
            for i, (a, b) in enumerate(span)
        ]
        results = run_batch(engine, hosted, calls)
        assert all(r.batch_size == len(calls) for r in results)
        outs.append([r.output for r in results])
    for sid in ids:
        engine.sessions.close(sid)
    return outs, full


def close(a, b, what, atol=ATOL):
    diff = (a - b).abs()
    assert diff.max() <= atol, f"{what}: max {diff.max():.2e} mean {diff.mean():.2e} (atol {atol})"


@pytest.mark.parametrize("name", [*NAMES, MLA_MODEL.name, *(m.name for m in POSITION_MODELS)])
def test_batched_equals_per_session_and_a_recompute(engines, name, monkeypatch):
    padded_calls = []
    real = MultiHeadAttention.attend_padded

    def spy(self, q, *args, **kwargs):
        padded_calls.append(q.shape[0])
        return real(self, q, *args, **kwargs)

    monkeypatch.setattr(MultiHeadAttention, "attend_padded", spy)
    per_session, full = decode_together(engines[False], name, rounds=3)
    assert padded_calls == [], "per session: no padded kernel"
    batched, _ = decode_together(engines[True], name, rounds=3)
    assert padded_calls and max(padded_calls) >= 3, "batched: padded groups of several rows"
    hosted = engines[True].get(name)
    for r, (got, want) in enumerate(zip(batched, per_session, strict=True)):
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            close(a, b, f"{name} round {r} session {i}: batched vs per session")
    for i, x in enumerate(full):
        ref = run(engines[True], hosted, req(name, x, causal=True)).output  # (1, L, E)
        steps = torch.cat([batched[r][i] for r in range(len(batched))], dim=1)
        close(steps, ref[:, PASTS[i] :], f"{name} session {i}: batched vs recompute")


def test_head_mask_batched_equals_per_session(engines):
    gate = (1.0, 0.0, 0.5, 1.0, 2.0, 1.0, 0.0, 1.0)
    per_session, _ = decode_together(engines[False], "gqa", rounds=1, head_mask=gate)
    batched, _ = decode_together(engines[True], "gqa", rounds=1, head_mask=gate)
    for r, (got, want) in enumerate(zip(batched, per_session, strict=True)):
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            close(a, b, f"head_mask round {r} session {i}")


def test_bfloat16_batched_equals_per_session():
    """A bfloat16 model: both paths round alike and differ by summation order only, within
    4 units in the last place of the largest output (bfloat16 keeps 8 bits; here they
    differed by 1 on the CPU)."""
    outs = {
        flag: decode_together(make_engine(flag, torch.bfloat16), "gqa", 2)[0] for flag in (0, 1)
    }
    largest = max(float(b.float().abs().max()) for r in outs[0] for b in r)
    ulp = 2.0 ** (math.floor(math.log2(largest)) - 7)
    for r, (got, want) in enumerate(zip(outs[1], outs[0], strict=True)):
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            close(a.float(), b.float(), f"bfloat16 round {r} session {i}", atol=4 * ulp)


def test_the_device_picks_the_path_unless_told():
    assert batched_by_default(torch.device("cuda")) and not batched_by_default(torch.device("cpu"))
    auto = make_engine(None)
    device = suite_torch_device()
    names = [*NAMES, MLA_MODEL.name, *(m.name for m in POSITION_MODELS)]
    assert auto.sessions.batched_attention == dict.fromkeys(names, device.type == "cuda")
    assert make_engine(True).sessions.batched_attention == dict.fromkeys(names, True)


def test_groups_keep_padding_under_half_and_within_the_byte_cap():
    groups, alone = plan_groups([301, 41, 35, 21, 6, 3], bytes_per_token=1)
    assert groups == [[1, 2, 3], [4, 5]] and alone == [0]
    for g in groups:
        lengths = [[301, 41, 35, 21, 6, 3][i] for i in g]
        assert min(lengths) >= BATCHED_MIN_FILL * max(lengths)
    assert plan_groups([7, 7, 7], bytes_per_token=8) == ([[0, 1, 2]], [])  # no padding
    # 16 keys of 1 byte a row, at most 32 bytes a group: pairs, the odd one alone.
    assert plan_groups([16] * 5, bytes_per_token=1, max_bytes=32) == ([[0, 1], [2, 3]], [4])
    assert plan_groups([5], bytes_per_token=1) == ([], [0])


def test_one_group_at_once_equals_the_loops_groups():
    """plan_groups answers a batch whose rows all join the longest's group without its loop:
    the loop's groups for any lengths, fills and byte caps. The loop's own answer: with a
    last row of no keys, which joins no group (a group of its own) and defeats the shortcut."""
    g = torch.Generator().manual_seed(0)
    at_once = 0
    for _ in range(400):
        B = int(torch.randint(0, 9, (), generator=g))
        top = int(torch.randint(1, 200, (), generator=g))
        low = int(torch.randint(1, top + 1, (), generator=g))
        lengths = torch.randint(low, top + 1, (B,), generator=g).tolist()
        fill = 0.05 + 0.95 * float(torch.rand((), generator=g))
        cap = int(torch.randint(16, 4096, (), generator=g))
        groups, alone = plan_groups(lengths + [0], 2, min_fill=fill, max_bytes=cap)
        alone.remove(B)
        got = plan_groups(lengths, 2, min_fill=fill, max_bytes=cap)
        assert got == (groups, alone), (lengths, fill, cap)
        at_once += B > 1 and got == ([list(range(B))], [])
    assert at_once > 50  # the shortcut's case, often
