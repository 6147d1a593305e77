"""A lone session step (Sessions._run_alone: a step that finds its lane idle, without weights
or a head mask, whose bounds clear it) answers as the batch's path does: the same outputs as
the same steps batched with another session's, and as a recompute of the whole sequence, for
every family the engine hosts (MHA, GQA, MQA, RoPE with and without a sliding window,
soft-capped scores, q/k norm, a narrower cache, multi-head latent attention); the same outcome (a batch of one, its session's stats); and it is
the path such steps take, while any other lone step takes the batch's. The one-token views
the lone step's projection takes (MultiHeadAttention.project, _merge_heads) equal the
general transposes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mha_serve.cache import Reservation, SessionBusy
from mha_serve.engine import Abandoned, Engine, ModelSpec
from mha_serve.engine import sessions as engine_sessions
from mha_serve.engine import settle as engine_settle
from mha_serve.engine.bounds import cleared
from mha_serve.engine.types import tensor_of
from mha_serve.model import AttentionConfig, MultiHeadAttention
from tests.engine.test_attend import MLA_MODEL, MODELS, POSITION_MODELS, close
from tests.engine_calls import State, req, run, run_batch
from tests.helpers import suite_torch_device

LONE_MODELS = [
    *MODELS,  # mha, gqa, mqa; RoPE with a sliding window and small blocks; soft-capped
    ModelSpec("norm", AttentionConfig(64, 4, 2, qk_norm={"scope": "head"}), seed=6),
    # RoPE without a window: decode_one rotates the token itself
    ModelSpec("rope", AttentionConfig(64, 4, 2, rope={"theta": 500.0}), seed=8),
    ModelSpec(  # Mistral's: RoPE and a window, in decode_one while the session fits it
        "mistral", AttentionConfig(64, 4, 2, rope={"theta": 500.0}, sliding_window=64), seed=10
    ),
    ModelSpec(  # Qwen3's: RoPE and a q/k norm per head, both in decode_one
        "qwen3", AttentionConfig(64, 4, 2, rope={"theta": 500.0}, qk_norm={"scope": "head"}), seed=9
    ),
    ModelSpec("narrow", AttentionConfig(64, 4, 1), seed=7, kv_cache_dtype="bfloat16"),
    ModelSpec(  # GLM's: RoPE by interleaved pairs over half of each head, in decode_one
        "glm", AttentionConfig(64, 4, 2, rope={"interleaved": True, "partial": 0.5}), seed=12
    ),
    MLA_MODEL,  # multi-head latent attention: its own bounds (mla_bounds.LatentBounds)
    *POSITION_MODELS,  # queries scaled by position, q/k norms after RoPE (decode_one's too)
]
NAMES = [m.name for m in LONE_MODELS]


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(
        LONE_MODELS, device=suite_torch_device(), dtype=torch.float32, max_response_bytes=2**28
    )


@pytest.fixture
def paths(monkeypatch) -> list[str]:
    """Which path each session step took, in order: "alone" (_run_alone answered it: an
    outcome or an error) or "batch" (the batch's forward)."""
    seen: list[str] = []
    real_alone, real_forward = (
        engine_sessions.Sessions._run_alone,
        engine_sessions.Sessions._forward,
    )

    def alone(self, hosted, p):
        outcome = real_alone(self, hosted, p)
        if outcome is not None and not isinstance(outcome, Reservation):  # (else: measured)
            seen.append("alone")
        return outcome

    def forward(self, *args, **kwargs):
        seen.append("batch")
        return real_forward(self, *args, **kwargs)

    monkeypatch.setattr(engine_sessions.Sessions, "_run_alone", alone)
    monkeypatch.setattr(engine_sessions.Sessions, "_forward", forward)
    return seen


def tokens(engine: Engine, name: str, n: int, seed: int) -> torch.Tensor:
    width = engine.get(name).spec.attention.embed_dim
    return torch.randn(1, n, width, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", NAMES)
def test_lone_steps_equal_the_same_steps_batched_and_a_recompute(engine, name, paths):
    """Session A steps alone (a prompt of 9, then 3 tokens, then 6 single tokens); session B
    takes the very same steps, each in one batch with session C's: A's outputs equal B's
    and the causal recompute of the whole sequence; A's outcomes are batches of one with
    its session's count."""
    hosted = engine.get(name)
    x, other = tokens(engine, name, 18, seed=1), tokens(engine, name, 18, seed=2)
    a, b, c = (engine.sessions.create(name, None, None).session_id for _ in range(3))
    spans = [(0, 9), (9, 12)] + [(p, p + 1) for p in range(12, 18)]
    alone, batched = [], []
    for lo, hi in spans:
        paths.clear()
        step = run(engine, hosted, req(name, x[:, lo:hi], session_id=a))
        assert paths == ["alone"], f"{name} [{lo}, {hi}): {paths}"
        assert step.batch_size == 1 and step.weights is None
        assert step.session.num_tokens == hi and step.compute_ms > 0
        alone.append(step.output)
        paths.clear()
        mine, _ = run_batch(
            engine,
            hosted,
            [req(name, x[:, lo:hi], session_id=b), req(name, other[:, lo:hi], session_id=c)],
        )
        assert paths == ["batch"] and mine.batch_size == 2 and mine.session.num_tokens == hi
        batched.append(mine.output)
    # A bfloat16 cache holds K/V rounded to 8 bits of mantissa: the recompute does not, and
    # on CUDA the batch of two attends padded (engine/attend.py), whose kernel rounds the
    # queries to the cache's dtype in another order than the lone step's.
    atol = 2e-2 if hosted.spec.kv_cache_dtype == "bfloat16" else 1e-5
    for (lo, hi), got, want in zip(spans, alone, batched, strict=True):
        close(got, want, f"{name} [{lo}, {hi}): alone vs batched", atol)
    ref = run(engine, hosted, req(name, x, causal=True)).output
    close(torch.cat(alone, dim=1), ref, f"{name}: alone vs recompute", atol)
    for sid in (a, b, c):
        engine.sessions.close(sid)


def test_steps_with_weights_a_head_mask_or_unproven_bounds_take_the_batch_path(engine, paths):
    """A lone step that asks for weights or gates heads, or whose bounds cannot clear it (a
    huge input: measured instead), runs as a batch of one, and what it keeps counts."""
    hosted = engine.get("gqa")
    sid = engine.sessions.create("gqa", None, None).session_id
    x = tokens(engine, "gqa", 4, seed=3)
    run(engine, hosted, req("gqa", x[:, :1], session_id=sid))
    paths.clear()
    run(engine, hosted, req("gqa", x[:, 1:2], session_id=sid, need_weights=True))
    gate = (1.0, 0.0, 0.5, 1.0, 2.0, 1.0, 0.0, 1.0)
    run(engine, hosted, req("gqa", x[:, 2:3], session_id=sid, head_mask=gate))
    huge = run(engine, hosted, req("gqa", x[:, 3:4] * 1e17, session_id=sid))  # finite
    assert paths == ["batch"] * 3
    assert huge.session.num_tokens == 4 and torch.isfinite(huge.output).all()
    engine.sessions.close(sid)


def test_a_lone_step_in_another_dtype_equals_its_output_converted(engine, paths):
    """A float16 or bfloat16 output of a lone step is the float32 step's, converted."""
    hosted = engine.get("mqa")
    x = tokens(engine, "mqa", 6, seed=4)
    outputs = {}
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        sid = engine.sessions.create("mqa", None, None).session_id
        run(engine, hosted, req("mqa", x[:, :5], session_id=sid))
        step = run(engine, hosted, req("mqa", x[:, 5:], session_id=sid, output_dtype=dtype))
        outputs[dtype] = step.output
        engine.sessions.close(sid)
    assert paths == ["alone"] * 6
    for dtype in (torch.float16, torch.bfloat16):
        assert outputs[dtype].dtype == dtype
        assert torch.equal(outputs[dtype], outputs[torch.float32].to(dtype))


def test_a_lone_step_refused_or_abandoned_keeps_nothing(engine, paths):
    """A lone step whose session is busy answers SessionBusy; one whose caller cancelled is
    Abandoned; neither keeps a token nor leaves the session busy."""
    hosted = engine.get("mha")
    sid = engine.sessions.create("mha", None, None).session_id
    x = tokens(engine, "mha", 3, seed=5)
    run(engine, hosted, req("mha", x[:, :2], session_id=sid))
    engine.sessions.claim(sid)  # another call's step holds it
    (busy,) = run_batch(engine, hosted, [req("mha", x[:, 2:], session_id=sid)])
    assert isinstance(busy, SessionBusy)
    engine.sessions.release(sid)
    paths.clear()
    state = State(cancelled=True)
    (gone,) = run_batch(engine, hosted, [req("mha", x[:, 2:], session_id=sid)], [state])
    assert isinstance(gone, Abandoned) and paths == ["alone"]  # (answered there)
    assert engine.sessions.table.session_stats(sid).num_tokens == 2
    kept = run(engine, hosted, req("mha", x[:, 2:], session_id=sid))
    assert kept.session.num_tokens == 3
    engine.sessions.close(sid)


@pytest.mark.parametrize("batch", [1, 3])
def test_one_token_projection_and_merge_equal_the_transposes(batch):
    """project's one-token views (no rope, no q/k norm) and _merge_heads' one-token reshape
    equal the general transposes, exactly (the same values, viewed)."""
    torch.manual_seed(0)
    m = MultiHeadAttention(AttentionConfig(64, 8, 2)).eval()
    c = m.config
    H, KVH, D = c.num_heads, c.num_kv_heads, c.head_dim
    x = torch.randn(batch, 1, 64)
    with torch.inference_mode():
        q, k, v = m.project(x)
        qkv = F.linear(x, m.wqkv.weight, m.wqkv.bias)
        q_ref, k_ref, v_ref = qkv.split([H * D, KVH * D, KVH * D], dim=-1)
        for got, want, heads in ((q, q_ref, H), (k, k_ref, KVH), (v, v_ref, KVH)):
            assert got.shape == (batch, heads, 1, D)
            assert torch.equal(got, want.view(batch, 1, heads, D).transpose(1, 2))
        y = torch.randn(batch, H, 1, D)
        merged = m._merge_heads(y, None, None)
        want = F.linear(y.transpose(1, 2).reshape(batch, 1, H * D), m.wo.weight, m.wo.bias)
        assert torch.equal(merged, want)


def test_a_lone_step_whose_bounds_cannot_clear_it_keeps_its_one_reservation(engine, monkeypatch):
    """Measured as a batch of one on the reservation _run_alone made: reserved once, its
    room never given back in between (another lane could take it), and kept."""
    hosted = engine.get("gqa")
    sid = engine.sessions.create("gqa", None, None).session_id
    x = tokens(engine, "gqa", 2, seed=8)
    run(engine, hosted, req("gqa", x[:, :1], session_id=sid))
    table = engine.sessions.table
    calls: list[str] = []
    for name in ("reserve", "reserve_many", "rollback"):
        real = getattr(table, name)
        monkeypatch.setattr(
            table,
            name,
            lambda *a, __real=real, __name=name, **k: (calls.append(__name), __real(*a, **k))[1],
        )
    huge = run(engine, hosted, req("gqa", x[:, 1:] * 1e17, session_id=sid))  # finite
    assert calls == ["reserve"], calls
    assert huge.session.num_tokens == 2 and torch.isfinite(huge.output).all()
    engine.sessions.close(sid)


def test_a_batch_whose_host_copy_fails_keeps_nothing_and_leaves_no_session_busy(
    engine, monkeypatch
):
    """The batch's one host copy of its output (Sessions._settle) failing, as a device error
    would: every step answers that error, is rolled back, and its session takes the next."""
    hosted = engine.get("mqa")
    ids = [engine.sessions.create("mqa", None, None).session_id for _ in range(2)]
    x = tokens(engine, "mqa", 3, seed=9)
    for sid in ids:
        run(engine, hosted, req("mqa", x[:, :2], session_id=sid))

    def lost(*_):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine_settle, "on_host", lost)
    results = run_batch(engine, hosted, [req("mqa", x[:, 2:], session_id=s) for s in ids])
    assert [str(r) for r in results] == ["device lost"] * 2
    monkeypatch.undo()
    for sid in ids:
        assert engine.sessions.table.session_stats(sid).num_tokens == 2
        assert run(engine, hosted, req("mqa", x[:, 2:], session_id=sid)).session.num_tokens == 3
        engine.sessions.close(sid)


@pytest.mark.parametrize(
    "name",
    ["gqa", "rope", "norm", "qwen3", "mistral"]
    + ["ministral3", "llama4_nope", "llama4_rope", "nanochat", "hunyuan"],
)
def test_a_lone_decode_token_of_a_plain_or_rotary_model_runs_in_one_call(engine, name, monkeypatch):
    """decode_one answers every lone one-token step of a model without soft-cap or a q/k
    norm over the whole projection, RoPE's, a per-head norm's and a window's (while the
    session fits it) included (it norms and rotates q and K itself; the test above holds
    its outputs to the batch's and a recompute)."""
    answered: list[bool] = []
    real = MultiHeadAttention.decode_one

    def spy(self, *args):
        y = real(self, *args)
        answered.append(y is not None)
        return y

    monkeypatch.setattr(MultiHeadAttention, "decode_one", spy)
    hosted = engine.get(name)
    x = tokens(engine, name, 12, seed=3)
    sid = engine.sessions.create(name, None, None).session_id
    run(engine, hosted, req(name, x[:, :8], session_id=sid))
    for p in range(8, 12):
        run(engine, hosted, req(name, x[:, p : p + 1], session_id=sid))
    assert answered == [True] * 4
    engine.sessions.close(sid)


def mla_engine(dtype: torch.dtype, kv_b_scale: float = 1.0) -> Engine:
    engine = Engine([MLA_MODEL], device=suite_torch_device(), dtype=dtype, max_response_bytes=2**28)
    with torch.no_grad():  # W_uk and W_uv: q's latent dims and the merge grow with them
        engine.get(MLA_MODEL.name).module.kv_b.weight.mul_(kv_b_scale)
    return engine


def mla_steps(engine: Engine, x: torch.Tensor) -> tuple[list[torch.Tensor], object]:
    """A prompt of 5 of x's tokens, 2 single steps, then decode_now of the 8th: the steps'
    outputs, and decode_now's outcome (None where it left the step, which then runs as
    any step), the session closed after."""
    name, hosted = MLA_MODEL.name, engine.get(MLA_MODEL.name)
    sid = engine.sessions.create(name, None, None).session_id
    outs = [run(engine, hosted, req(name, x[:, :5], session_id=sid)).output]
    for p in range(5, 7):
        outs.append(run(engine, hosted, req(name, x[:, p : p + 1], session_id=sid)).output)
    engine.sessions.claim(sid)
    try:
        now = engine.decode_now(req("", x[:, 7:8], session_id=sid), name, State(claimed=True))
    finally:
        engine.sessions.release(sid)
    if now is None:
        assert engine.sessions.table.session_stats(sid).num_tokens == 7  # nothing kept
        outs.append(run(engine, hosted, req(name, x[:, 7:8], session_id=sid)).output)
    else:
        assert now.session.num_tokens == 8 and now.batch_size == 1
        outs.append(tensor_of(now.output))
    engine.sessions.close(sid)
    return outs, now


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_an_mla_step_its_bounds_clear_runs_alone_and_decode_now_takes_it(paths, dtype):
    """Multi-head latent attention's bounds (mla_bounds.LatentBounds) clear a plain input's
    steps, in float16 too: each is a lone step, decode_now answers the next, and all equal
    a recompute (float32; float16's within its rounding)."""
    engine = mla_engine(dtype)
    x = tokens(engine, MLA_MODEL.name, 8, seed=4).to(dtype)
    outs, now = mla_steps(engine, x)
    assert paths == ["alone"] * 3 and now is not None
    hosted = engine.get(MLA_MODEL.name)
    ref = run(engine, hosted, req(MLA_MODEL.name, x, causal=True)).output
    got = torch.cat(outs, dim=1)
    close(
        got.float(),
        ref.float(),
        f"mla {dtype}: steps vs recompute",
        1e-5 if dtype == torch.float32 else 2e-2,
    )


def test_an_mla_step_past_float16s_bound_is_measured_and_decode_now_leaves_it(paths):
    """W_uk and W_uv 30 times larger: the score bound passes float16's limit, so no step is
    cleared: each runs as a measured batch of one (whose exact check passes it: its actual
    scores are far smaller), decode_now leaves the 8th keeping nothing, and the answers
    equal the same weights' in float32 (to float16's rounding)."""
    x = tokens(mla_engine(torch.float32), MLA_MODEL.name, 8, seed=4)
    engine = mla_engine(torch.float16, kv_b_scale=30.0)
    hosted = engine.get(MLA_MODEL.name)
    assert cleared(hosted, torch.float16, float(x.abs().max()), 0.0, 1.0) is None
    outs, now = mla_steps(engine, x.half())
    assert paths == ["batch"] * 4 and now is None
    want, _ = mla_steps(mla_engine(torch.float32, kv_b_scale=30.0), x)
    for got, ref in zip(outs, want, strict=True):
        assert torch.isfinite(got).all()  # (float16's rounding: 3e-3 of the largest here)
        close(got.float(), ref, "mla float16 vs float32", 5e-3 * float(ref.abs().max()))
