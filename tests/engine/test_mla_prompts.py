"""Multi-head latent attention's prompt steps in sessions (engine/prompts.py): a session's
first chunk and long chunks attend expanded (every head decompressed from the cached latents,
model/mla.py), decode steps absorbed, the cache holding the latents either way. Each answer
against the same engine with the expanded form off (mla.EXPAND_MIN_ROWS out of reach), the
stateless answer over the whole history and the float64 reference of tests/model/test_mla.py:
lone steps and batches (all prompts, or a prompt beside a decode step), ragged new lengths,
head masks, a sliding window, a bfloat16 cache; and the steps that stay absorbed (bounds that
cannot clear them, weights)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from mha_serve.engine import Engine, ModelSpec
from mha_serve.engine import bounds as engine_bounds
from mha_serve.engine import forward as engine_forward
from mha_serve.engine import prompts as engine_prompts
from mha_serve.model import AttentionConfig, mla
from mha_serve.model.mla_bounds import latent_maxima
from mha_serve.model.overflow import NO_BOUNDS
from tests.engine_calls import attend, req, run_batch
from tests.model.test_mla import C, E, H, N, R, config, reference

BLOCK = 4
ATOL = 1e-5
PROMPT = 80  # >= mla.EXPAND_MIN_ROWS


def spec(window: int | None = None, kv_cache_dtype: str = "auto") -> ModelSpec:
    """test_mla's model (its float64 reference's shapes and RoPE), RoPE by pairs, causal."""
    cfg = config(interleaved=True, causal=True, sliding_window=window)
    return ModelSpec(
        "mla",
        cfg,
        seed=11,
        kv_cache_bytes=1 << 20,
        kv_block_size=BLOCK,
        kv_cache_dtype=kv_cache_dtype,
    )


def engine(s: ModelSpec | None = None) -> Engine:
    return Engine(
        [s or spec()], device=torch.device("cpu"), dtype=torch.float32, max_response_bytes=2**24
    )


def tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randn(1, n, E, generator=torch.Generator().manual_seed(seed))


@contextlib.contextmanager
def absorbed():
    """Every step absorbed: the expanded form out of reach."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mla, "EXPAND_MIN_ROWS", 1 << 30)
        yield


@pytest.fixture
def expanded_rows(monkeypatch):
    """The rows each call of the expanded attention took (the real function, counted)."""
    rows: list[int] = []
    real = engine_prompts.attend_cached_expanded

    def counted(module, q, keys, **kw):
        rows.append(q.shape[0])
        return real(module, q, keys, **kw)

    monkeypatch.setattr(engine_prompts, "attend_cached_expanded", counted)
    return rows


class Pair:
    """One session on an engine, stepped with the expanded form on and, on a twin engine,
    off: both answers, the stateless one over the history, and the float64 reference."""

    def __init__(
        self, s: ModelSpec | None = None, atol: float = ATOL, engines: tuple | None = None
    ) -> None:
        self.engines = engines or (engine(s), engine(s))
        self.ids = [e.create_session("mla").session_id for e in self.engines]
        self.history = torch.zeros(1, 0, E)
        self.atol = atol

    def requests(self, x: torch.Tensor, **kw):
        return [req("mla", x, session_id=sid, **kw) for sid in self.ids]

    def check(self, got: torch.Tensor, off: torch.Tensor, x: torch.Tensor, what: str, **kw):
        self.history = torch.cat([self.history, x], dim=1)
        n = x.shape[1]
        head_mask = kw.get("head_mask")
        gate = None if head_mask is None else torch.tensor(head_mask)
        module = self.engines[0].get("mla").module
        want = reference(module, self.history, head_mask=gate)[0][:, -n:]
        with absorbed():
            stateless = attend(self.engines[1], req("mla", self.history, causal=True, **kw))
        for name, other in (("absorbed", off), ("stateless", stateless.output[:, -n:])):
            diff = (got - other).abs().max()
            assert diff < self.atol, f"{what}: {diff:.2e} from the {name} answer"
        if self.engines[0].get("mla").spec.attention.sliding_window is None:
            diff = (got.double() - want).abs().max()
            assert diff < self.atol, f"{what}: {diff:.2e} from the float64 reference"

    def step(self, x: torch.Tensor, what: str, **kw) -> torch.Tensor:
        on, off = self.requests(x, **kw)
        got = attend(self.engines[0], on).output
        with absorbed():
            want = attend(self.engines[1], off).output
        self.check(got, want, x, what, **kw)
        return got


def cached_keys(e: Engine, sid: str) -> torch.Tensor:
    """The session's cached k' (1, 1, S, R + C)."""
    session = e.sessions.table.get(sid)
    return e.sessions.cache("mla").read(session.block_table, session.num_tokens)[0]


def test_a_prompt_decode_steps_and_a_long_chunk(expanded_rows):
    """The prompt (a lone step) expanded; decode steps and a short chunk absorbed over the
    latents it cached; a long chunk expanded over them all (read back and decompressed)."""
    pair = Pair()
    pair.step(tokens(PROMPT, seed=1), "prompt")
    assert expanded_rows == [1]
    for i in range(2):
        pair.step(tokens(1, seed=2 + i), f"decode step {i}")
    pair.step(tokens(5, seed=4), "a short chunk")
    assert expanded_rows == [1]
    assert mla.expands(pair.engines[0].get("mla").spec.attention, 70, PROMPT + 7)
    pair.step(tokens(70, seed=5), "a long chunk")
    assert expanded_rows == [1, 1]
    pair.step(tokens(1, seed=6), "a decode step after it")
    assert expanded_rows == [1, 1]
    k, k_off = (cached_keys(e, sid) for e, sid in zip(pair.engines, pair.ids, strict=True))
    assert k.shape == (1, 1, PROMPT + 78, R + C)
    assert torch.equal(k, k_off)  # the same latents cached either way


def test_batches_of_prompts_and_a_prompt_beside_a_decode_step(expanded_rows):
    """Two sessions' prompts of unequal lengths in one batch (both expanded, one call, the
    shorter's rows padding); then one session's decode step beside a new session's prompt
    (the prompt expanded, the step absorbed): each row as the absorbed engine answers it."""
    first = Pair()
    engines = first.engines

    def batch(pairs: list[Pair], xs: list[torch.Tensor], what: str) -> None:
        outs = []
        for i, e in enumerate(engines):  # expanded on, then off
            reqs = [p.requests(x)[i] for p, x in zip(pairs, xs, strict=True)]
            with absorbed() if i else contextlib.nullcontext():
                outs.append([o.output for o in run_batch(e, e.get("mla"), reqs)])
        for j, (p, x) in enumerate(zip(pairs, xs, strict=True)):
            p.check(outs[0][j], outs[1][j], x, f"{what}, row {j}")

    second = Pair(engines=engines)
    batch([first, second], [tokens(PROMPT, seed=10), tokens(66, seed=11)], "two prompts")
    assert expanded_rows == [2]
    third = Pair(engines=engines)
    batch([first, third], [tokens(1, seed=12), tokens(PROMPT, seed=13)], "a step and a prompt")
    assert expanded_rows == [2, 1]


def test_a_prompt_with_a_head_mask_runs_expanded_in_the_batch_path(expanded_rows):
    pair = Pair()
    pair.step(tokens(PROMPT, seed=20), "masked prompt", head_mask=[1.0, 0.0, -0.5, 2.0])
    pair.step(tokens(1, seed=21), "masked step", head_mask=[1.0, 0.0, -0.5, 2.0])
    assert expanded_rows == [1]


def test_a_sliding_window_reads_the_chunks_window_expanded(expanded_rows):
    """A window of 24: the long chunk's read starts inside the session (read_start > 0),
    and its mask cuts each row's window."""
    pair = Pair(spec(window=24))
    pair.step(tokens(PROMPT, seed=30), "windowed prompt")
    for i in range(3):
        pair.step(tokens(1, seed=31 + i), f"windowed step {i}")
    pair.step(tokens(70, seed=35), "windowed chunk")
    assert expanded_rows == [1, 1]
    assert pair.engines[0].get_session(pair.ids[0]).first_position > 0


def test_a_bfloat16_cache_is_decompressed_in_the_models_dtype(expanded_rows):
    """The latents cached rounded to bfloat16, decompressed in float32: the expanded answer
    within bfloat16's rounding of the absorbed one's (which rounds q to bfloat16 too)."""
    pair = Pair(spec(kv_cache_dtype="bfloat16"), atol=0.02)
    pair.step(tokens(PROMPT, seed=40), "bfloat16 prompt")
    pair.step(tokens(1, seed=41), "bfloat16 step")
    pair.step(tokens(70, seed=42), "bfloat16 chunk")
    assert expanded_rows == [1, 1]


def test_steps_the_bounds_cannot_clear_or_that_ask_weights_stay_absorbed(
    monkeypatch, expanded_rows
):
    """The expanded form runs only where the bounds prove it cannot overflow (a measured
    step's exact check reads the absorbed q) and no weights are asked."""
    e = engine()
    sid = e.create_session("mla").session_id
    got = attend(e, req("mla", tokens(PROMPT, seed=50), session_id=sid, need_weights=True))
    assert got.weights.shape == (1, 4, PROMPT, PROMPT) and expanded_rows == []
    for place in (engine_bounds, engine_forward):
        monkeypatch.setattr(place, "weight_bounds", lambda m: NO_BOUNDS)
    other = e.create_session("mla").session_id
    x = tokens(PROMPT, seed=51)
    out = attend(e, req("mla", x, session_id=other)).output
    assert expanded_rows == []
    want = reference(e.get("mla").module, x)[0]
    assert (out.double() - want).abs().max() < ATOL


def test_the_bounds_refuse_to_clear_what_only_the_expanded_form_would_overflow():
    """float16, q's weights tiny and W_uk's huge: the absorbed scores are tiny, but the
    expanded keys W_uk c pass float16's range, so latent_cleared clears nothing (and the
    step is measured, absorbed) where before it cleared."""
    e = Engine([spec()], device=torch.device("cpu"), dtype=torch.float16, max_response_bytes=2**24)
    hosted = e.get("mla")
    assert engine_bounds.cleared(hosted, torch.float16, 1.0, 0.0, 1.0) is not None
    module = hosted.module
    with torch.no_grad():
        module.q_b.weight.mul_(1e-4)
        module.kv_b.weight.view(H, -1, C)[:, :N].fill_(2000.0)  # W_uk: rows of C x 2000
    lb = engine_bounds.weight_bounds(module).latent
    assert lb.uk_l1 * lb.latent > 65504  # the expanded keys' bound
    score = latent_maxima(1.0, E, lb).score(0.0)
    assert score < 4000  # the scores' (either form's): far inside float16
    assert engine_bounds.cleared(hosted, torch.float16, 1.0, 0.0, 1.0) is None


def test_a_chunk_after_cached_keys_expands_only_where_it_pays(expanded_rows):
    """Wide latents (C 128, N = V = 64, R 8): over many cached keys the chunk must have
    EXPAND_COST x C (N + V) / (2 (R + C - D_x)) = 192 rows or so before the attention it
    saves pays for decompressing those keys: a chunk of 100 after 200 stays absorbed, one of
    250 expands; a decode step stays absorbed; every answer the stateless one."""
    wide = {"kv_lora_rank": 128, "rope_dim": 8, "nope_dim": 64, "v_head_dim": 64}
    cfg = AttentionConfig(64, 2, rope={"theta": 100.0}, mla=wide, causal=True)
    e = Engine(
        [ModelSpec("mla", cfg, seed=3, kv_cache_bytes=1 << 20, kv_block_size=BLOCK)],
        device=torch.device("cpu"),
        dtype=torch.float32,
        max_response_bytes=2**24,
    )
    sid = e.create_session("mla").session_id
    g = torch.Generator().manual_seed(12)
    history = torch.zeros(1, 0, 64)
    for n, rows in ((200, [1]), (100, [1]), (1, [1]), (250, [1, 1])):
        x = torch.randn(1, n, 64, generator=g)
        got = attend(e, req("mla", x, session_id=sid)).output
        assert expanded_rows == rows, (n, expanded_rows)
        history = torch.cat([history, x], dim=1)
        with absorbed():
            want = attend(e, req("mla", history, causal=True)).output[:, -n:]
        assert (got - want).abs().max() < ATOL


def test_a_chunk_whose_expanded_keys_pass_the_byte_limit_stays_absorbed(monkeypatch, expanded_rows):
    """Decompressing every key a step reads is held beside the cache's budget: past
    MAX_EXPANDED_BYTES the step stays absorbed (here 2 x 4 heads x 20 dims x 4 bytes a key:
    100 keys fit in 64000 bytes; the prompt's 80 do, the chunk after it, 150 keys, not)."""
    monkeypatch.setattr(engine_prompts, "MAX_EXPANDED_BYTES", 640 * 100)
    pair = Pair()
    pair.step(tokens(PROMPT, seed=60), "prompt within the limit")
    assert expanded_rows == [1]
    pair.step(tokens(70, seed=61), "a chunk past it")
    assert expanded_rows == [1]
