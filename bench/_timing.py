"""Side-by-side timing shared by the kernel benchmarks (bench/decode_attention.py,
bench/sinks_prompt.py, bench/alibi_prompt.py): two functions timed in alternating rounds,
the fastest round of each kept, so that a load that comes and goes during a run weighs on
both alike."""

from __future__ import annotations

import time
from collections.abc import Callable


def timed(fn: Callable[[], object], calls: int) -> float:
    """Seconds per call of fn over calls calls."""
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def alternating_best(
    sides: dict[str, Callable[[], object]],
    rounds: int,
    budget_s: float,
    *,
    probe_calls: int = 1,
    min_calls: int = 1,
) -> dict[str, float]:
    """The fastest seconds per call of each side over rounds rounds, the sides taken in
    their order on even rounds and reversed on odd ones. Calls per round: as many as the
    first side's probe (probe_calls calls) fits in budget_s, at least min_calls."""
    first = next(iter(sides.values()))
    calls = max(min_calls, int(budget_s / max(timed(first, probe_calls), 1e-6)))
    best = dict.fromkeys(sides, float("inf"))
    order = list(sides.items())
    for r in range(rounds):
        for name, fn in order if r % 2 == 0 else order[::-1]:
            best[name] = min(best[name], timed(fn, calls))
    return best
