"""Sessions' static_decode: with it on, plain decode steps (one token, no weights, no head
mask), alone or batched, run through engine/graphs.py's StaticDecode and answer as the engine
does with it off (per session, and a full recompute); every other step (a prompt, a step with
weights or a head mask) runs as before; an overflowing step is refused alike; a bad mode is
refused with the choices. On CUDA, "graphs" replays CUDA graphs with the same answers."""

from __future__ import annotations

import pytest
import torch

from mha_serve.engine import Engine
from mha_serve.engine.graphs import StaticDecode
from tests.engine.test_attend import MODELS, NAMES, PASTS, close, decode_together
from tests.engine_calls import req, run, run_batch
from tests.helpers import suite_torch_device


def make_engine(static_decode: str, device: torch.device | None = None) -> Engine:
    return Engine(
        MODELS,
        device=device or suite_torch_device(),
        dtype=torch.float32,
        max_response_bytes=2**28,
        static_decode=static_decode,
    )


@pytest.fixture(scope="module")
def engines() -> dict[str, Engine]:
    return {mode: make_engine(mode) for mode in ("off", "eager")}


@pytest.fixture
def static_steps(monkeypatch):
    """The number of steps each StaticDecode.step call ran, in order."""
    seen: list[int] = []
    real = StaticDecode.step

    def spy(self, x, reservations):
        seen.append(len(reservations))
        return real(self, x, reservations)

    monkeypatch.setattr(StaticDecode, "step", spy)
    return seen


@pytest.mark.parametrize("name", NAMES)
def test_batched_decode_steps_run_static_and_answer_as_before(engines, name, static_steps):
    """Sessions at ragged pasts take a first step of 1-4 tokens together (not static: some
    bring several), then 3 rounds of one token each together (static, all six at once);
    every output equals the engine's without it, and a recompute of the whole sequence."""
    before, full = decode_together(engines["off"], name, rounds=3)
    assert static_steps == []
    static, _ = decode_together(engines["eager"], name, rounds=3)
    assert static_steps == [len(PASTS)] * 3, static_steps
    for r, (got, want) in enumerate(zip(static, before, strict=True)):
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            close(a, b, f"{name} round {r} session {i}: static vs off")
    hosted = engines["eager"].get(name)
    for i, x in enumerate(full):
        ref = run(engines["eager"], hosted, req(name, x, causal=True)).output  # (1, L, E)
        steps = torch.cat([static[r][i] for r in range(len(static))], dim=1)
        close(steps, ref[:, PASTS[i] :], f"{name} session {i}: static vs recompute")


def test_a_lone_step_runs_static_and_other_steps_do_not(engines, static_steps):
    """A lone decode step runs static (a batch of one); a prompt, a step with weights and a
    step with a head mask do not; all answer as with static_decode off."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 12, 512, generator=g)
    answers = {}
    for mode, engine in engines.items():
        hosted = engine.get("gqa")
        sid = engine.sessions.create("gqa", None, None).session_id
        got = [run(engine, hosted, req("gqa", x[:, :8], session_id=sid)).output]
        got.append(run(engine, hosted, req("gqa", x[:, 8:9], session_id=sid)).output)
        weighed = run(engine, hosted, req("gqa", x[:, 9:10], session_id=sid, need_weights=True))
        got += [weighed.output, weighed.weights]
        gate = (1.0, 0.0, 0.5, 1.0, 2.0, 1.0, 0.0, 1.0)
        got.append(
            run(engine, hosted, req("gqa", x[:, 10:11], session_id=sid, head_mask=gate)).output
        )
        got.append(run(engine, hosted, req("gqa", x[:, 11:12], session_id=sid)).output)
        engine.sessions.close(sid)
        answers[mode] = got
        if mode == "off":
            assert static_steps == []
    assert static_steps == [1, 1], "the two plain decode steps, nothing else"
    for k, (a, b) in enumerate(zip(answers["eager"], answers["off"], strict=True)):
        close(a, b, f"answer {k}")


def test_an_overflowing_step_is_refused_alike_and_keeps_nothing(engines, static_steps):
    """A decode step whose K/V overflow float32 would poison its session: refused by both
    (nothing kept: the session's next step equals the one without it), alongside a plain
    step in the same batch that is kept."""
    outcomes = {}
    for mode in ("off", "eager"):
        engine = Engine(
            [m for m in MODELS if m.name == "gqa"],
            device=suite_torch_device(),
            dtype=torch.float32,
            max_response_bytes=2**28,
            static_decode=mode,
        )
        hosted = engine.get("gqa")
        g = torch.Generator().manual_seed(5)
        x = torch.randn(2, 6, 512, generator=g)
        ids = [engine.sessions.create("gqa", None, None).session_id for _ in range(2)]
        for i, sid in enumerate(ids):
            run(engine, hosted, req("gqa", x[i : i + 1, :5], session_id=sid))
        huge = x[1:2, 5:6] * 1e38  # scores past float32's range
        results = run_batch(
            engine,
            hosted,
            [req("gqa", x[:1, 5:6], session_id=ids[0]), req("gqa", huge, session_id=ids[1])],
        )
        after = run(engine, hosted, req("gqa", x[1:2, 5:6], session_id=ids[1])).output
        outcomes[mode] = (results, after)
    assert static_steps == [2, 1], static_steps
    for mode, (results, _) in outcomes.items():
        assert not isinstance(results[0], Exception), (mode, results[0])
        assert isinstance(results[1], Exception), mode
        assert "overflow" in str(results[1]), (mode, results[1])
    close(outcomes["eager"][0][0].output, outcomes["off"][0][0].output, "the kept step")
    close(outcomes["eager"][1], outcomes["off"][1], "the refused session's next step")


def test_a_bad_mode_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="static_decode 'fast' is not one of off, eager, graphs"):
        make_engine("fast")


def test_graphs_without_cuda_run_as_any_step(static_steps):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: graphs would run")
    engine = make_engine("graphs", torch.device("cpu"))
    hosted = engine.get("mha")
    sid = engine.sessions.create("mha", None, None).session_id
    x = torch.randn(1, 3, 512, generator=torch.Generator().manual_seed(1))
    run(engine, hosted, req("mha", x[:, :2], session_id=sid))
    run(engine, hosted, req("mha", x[:, 2:], session_id=sid))
    assert static_steps == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graphs_replay_the_steps_with_the_same_answers(static_steps):
    device = torch.device("cuda")
    before, _ = decode_together(make_engine("off", device), "gqa", rounds=3)
    graphed = make_engine("graphs", device)
    got, _ = decode_together(graphed, "gqa", rounds=3)
    assert static_steps == [len(PASTS)] * 3
    decode, _ = graphed.sessions._static["gqa"]
    assert decode.graph and 1 <= decode.captures <= 2  # the key widths of 3 rounds
    for r, (a_round, b_round) in enumerate(zip(got, before, strict=True)):
        for i, (a, b) in enumerate(zip(a_round, b_round, strict=True)):
            close(a, b, f"round {r} session {i}: graphs vs off")


def test_a_failing_fixed_shape_step_falls_back_and_is_switched_off(engines, monkeypatch, caplog):
    """Should StaticDecode fail (a graph that cannot be captured, its memory), here after
    it wrote the steps' K/V, the batch runs as any step with the same answers, the failure
    is logged, and the model's later steps run as any step without trying again."""
    tried: list[int] = []
    real = StaticDecode._compute

    def broken(self, Bb, W):
        tried.append(Bb)
        real(self, Bb, W)  # the K/V written, the attention run
        raise RuntimeError("CUDA graph capture failed (made up)")

    before, _ = decode_together(engines["off"], "mqa", rounds=2)
    engine = make_engine("eager")
    monkeypatch.setattr(StaticDecode, "_compute", broken)
    got, _ = decode_together(engine, "mqa", rounds=2)
    assert tried == [8], "tried once (6 steps in the bucket of 8), then switched off"
    assert engine.sessions._static["mqa"] is None
    assert "run as any step" in caplog.text and "made up" in caplog.text
    for r, (a_round, b_round) in enumerate(zip(got, before, strict=True)):
        for i, (a, b) in enumerate(zip(a_round, b_round, strict=True)):
            close(a, b, f"round {r} session {i}: fallen back vs off")
