"""Requests whose attention scores overflow are refused (INVALID_ARGUMENT) on every CPU kernel,
stateless and as session steps, where a session's cached keys count too."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from mha_serve.engine import Engine, InvalidRequest, ModelSpec
from mha_serve.model import AttentionConfig
from tests.engine_calls import attend, req, run_batch

# q = x[0:4], k = x[4:8], v = x[0:4], output = attention output: queries and keys set apart.
TINY = AttentionConfig(embed_dim=8, num_heads=1, head_dim=4, bias=False)


def tiny_engine(**options) -> Engine:
    """An engine on TINY whose weights set queries and keys apart (options: Engine's)."""
    engine = Engine(
        [ModelSpec("tiny", TINY)],
        device=torch.device("cpu"),
        dtype=torch.float32,
        max_response_bytes=2**24,
        **options,
    )
    module = engine.get("tiny").module
    with torch.no_grad():
        w = torch.zeros(12, 8)
        w[0:4, 0:4] = torch.eye(4)
        w[4:8, 4:8] = torch.eye(4)
        w[8:12, 0:4] = torch.eye(4)
        module.wqkv.weight.copy_(w)
        module.wo.weight.copy_(torch.eye(8, 4))
    return engine


@pytest.fixture
def engine() -> Engine:
    return tiny_engine()


def token(q0: float = 0.0, k0: float = 0.0) -> torch.Tensor:
    x = torch.zeros(1, 1, 8)
    x[0, 0, 0], x[0, 0, 4] = q0, k0
    return x


def step(engine: Engine, session_id: str, x: torch.Tensor):
    return attend(engine, req("tiny", x, session_id=session_id))


def test_a_query_against_a_cached_key_is_refused_and_nothing_is_kept(engine):
    """The new token's own key is 0, so only the session's bound on its cached keys can
    see that q . k = 2e38 overflows (past the limit with its margin)."""
    sid = engine.sessions.create("tiny", None, None).session_id
    first = step(engine, sid, token(k0=1e19))
    assert first.session.num_tokens == 1
    with pytest.raises(InvalidRequest, match="attention scores of this input may overflow float32"):
        step(engine, sid, token(q0=2e19))
    assert engine.sessions.table.get(sid).num_tokens == 1  # rolled back
    ok = step(engine, sid, token(q0=1e18))  # 1e37: fits
    assert ok.session.num_tokens == 2 and torch.isfinite(ok.output).all()


def test_forks_inherit_the_bound_and_an_emptied_session_drops_it(engine):
    sid = engine.sessions.create("tiny", None, None).session_id
    step(engine, sid, token(k0=1e19))
    child = engine.sessions.table.fork(sid)
    with pytest.raises(InvalidRequest, match="attention scores"):
        step(engine, child.id, token(q0=2e19))
    engine.sessions.truncate(sid, 0)
    assert step(engine, sid, token(q0=2e19)).session.num_tokens == 1


def test_a_huge_prefill_is_refused_and_a_bounded_one_is_not(engine):
    sid = engine.sessions.create("tiny", None, None).session_id
    x = torch.cat([token(k0=1e19), token(q0=2e19)], dim=1)  # (1, 2, 8)
    with pytest.raises(InvalidRequest, match="attention scores"):
        step(engine, sid, x)
    # Causal: a huge query before the huge key never meets it.
    y = torch.cat([token(q0=2e19), token(k0=1e19)], dim=1)
    assert step(engine, sid, y).session.num_tokens == 2


def test_stateless_batch_refuses_only_the_overflowing_call(engine):
    hosted = engine.get("tiny")
    bad = req("tiny", torch.cat([token(k0=1e19), token(q0=2e19)], dim=1), causal=False)
    good = req("tiny", torch.cat([token(k0=1.0), token(q0=2.0)], dim=1), causal=False)
    results = run_batch(engine, hosted, [bad, good])
    assert isinstance(results[0], InvalidRequest) and "attention scores" in str(results[0])
    alone = attend(engine, good)
    torch.testing.assert_close(results[1].output, alone.output)


def test_a_session_step_refused_in_a_batch_leaves_the_others_their_dtypes(engine):
    """A batch of session steps whose first row's scores overflow: that one is refused, and
    every later step is answered in the dtype it asked, equal to the step run alone."""
    hosted = engine.get("tiny")
    bad = engine.sessions.create("tiny", None, None).session_id
    step(engine, bad, token(k0=1e19))
    pairs = []  # (batched session, its twin stepped alone), each with a token and a dtype
    for dtype in (torch.float16, torch.bfloat16):
        twins = [engine.sessions.create("tiny", None, None).session_id for _ in range(2)]
        for sid in twins:
            step(engine, sid, token(q0=1.0, k0=2.0))
        pairs.append((twins, dtype))
    calls = [req("tiny", token(q0=2e19), session_id=bad)]
    calls += [req("tiny", token(q0=3.0), session_id=a, output_dtype=d) for (a, _), d in pairs]
    results = run_batch(engine, hosted, calls)
    assert isinstance(results[0], InvalidRequest) and "attention scores" in str(results[0])
    for got, ((_, alone_sid), dtype) in zip(results[1:], pairs, strict=True):
        alone = attend(engine, req("tiny", token(q0=3.0), session_id=alone_sid, output_dtype=dtype))
        assert got.output.dtype == alone.output.dtype == dtype
        torch.testing.assert_close(got.output, alone.output)


SCRIPT = textwrap.dedent(
    """
    import torch
    from mha_serve.config import default_models
    from mha_serve.engine import Engine, InvalidRequest
    from tests.engine_calls import attend, req
    engine = Engine(default_models(), device=torch.device("cpu"), dtype=torch.float32,
                    max_response_bytes=2**26)
    x = torch.full((1, 4, 512), 1e20)
    outcomes = []
    for call in (req("mha", x), req("gqa", x, causal=True),
                 req("mqa", x, session_id=engine.sessions.create("mqa", None, None).session_id)):
        try:
            attend(engine, call)
            outcomes.append("OK")
        except InvalidRequest as e:
            outcomes.append("refused" if "attention scores" in str(e) else str(e))
    print(torch.backends.cpu.get_cpu_capability(), *outcomes)
    """
)


# The CPU flags each of torch's kernel builds needs (a build the CPU lacks dies of SIGILL).
NEEDS = {"default": set(), "avx2": {"avx2", "fma"}, "avx512": {"avx512f", "avx512bw", "avx512vl"}}


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next(
                (set(line.split(":")[1].split()) for line in f if line.startswith("flags")), set()
            )
    except OSError:
        return set()


@pytest.mark.parametrize("capability", list(NEEDS))
def test_refused_under_every_cpu_kernel(capability):
    """torch picks its CPU kernels by ATEN_CPU_CAPABILITY: the AVX2 build of fused SDPA
    answered scores of 1e40 with zero attention, the AVX-512 one with NaN. Every kernel
    this CPU can run gets the same refusal."""
    missing = NEEDS[capability] - cpu_flags()
    if missing:
        pytest.skip(f"this CPU lacks {sorted(missing)} for torch's {capability} kernels")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    used, *outcomes = done.stdout.split()
    assert outcomes == ["refused"] * 3, f"under {used}: {outcomes}"


def test_a_validated_step_far_from_overflow_measures_nothing(engine, monkeypatch):
    """Bounds from max |input| clear an ordinary step: its tensors are never read for the
    check (the spy would raise); a step they cannot clear is measured and refused."""
    from mha_serve.engine import forward as engine_forward

    real = engine_forward.row_absmax_tensor
    measured = []

    def spy(*tensors):
        measured.append(len(tensors))
        return real(*tensors)

    monkeypatch.setattr(engine_forward, "row_absmax_tensor", spy)
    sid = engine.sessions.create("tiny", None, None).session_id
    assert step(engine, sid, token(q0=1.0, k0=2.0)).session.num_tokens == 1
    assert measured == []
    with pytest.raises(InvalidRequest, match="attention scores"):
        step(engine, sid, token(q0=1e38))
    assert measured == [3, 1]  # q, k, v; then the output, in the one read after the forward


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("size", [1, 512, 4096, 4097, (1 << 14) + 1])
@pytest.mark.parametrize("with_tensor", [False, True], ids=["numpy", "tensor"])
def test_array_absmax_is_torchs_max_abs_and_propagates_nan_and_inf(dtype, size, with_tensor):
    """Both ways of reading it (numpy's reductions; torch.aminmax on the tensor view for
    at most SMALL_INPUT_VALUES values, as prepare does): the same max |x|, NaN and inf at
    either end of the input and of the range."""
    from mha_serve.engine.checks import array_absmax
    from mha_serve.engine.types import array_of, tensor_of

    def read(t: torch.Tensor) -> float:
        a = array_of(t)
        return array_absmax(a, tensor_of(a) if with_tensor else None)

    g = torch.Generator().manual_seed(size)
    x = (torch.randn(1, 1, size, generator=g) * 100).to(dtype)
    x[0, 0, size // 2] = -1000.0  # the largest magnitude is negative
    assert read(x) == float(x.abs().max()) == 1000.0
    x[0, 0, size // 2] = 1000.0  # positive
    assert read(x) == 1000.0
    specials = ((float("inf"), "inf"), (float("-inf"), "inf"), (float("nan"), "nan"))
    for special, want in specials:
        for at in (0, -1):
            y = x.clone()
            y[0, 0, at] = special
            got = read(y)
            assert (got != got) if want == "nan" else got == float("inf"), (special, at, got)
