"""AnalyzeHeads (2H + 1 forwards) runs on the compute threads' analysis thread, one at a
time: on the default executor a flood of them took every thread that large calls' parsing
and encoding use (asyncio.to_thread), each with a torch thread team of its own."""

from __future__ import annotations

import asyncio
import threading

import torch

from mha_serve.engine import Engine, ModelSpec
from mha_serve.engine.threads import ComputeThreads
from mha_serve.model import AttentionConfig
from mha_serve.serving import AsyncEngine, async_engine
from tests.engine_calls import req


def test_analyses_run_one_at_a_time_on_their_own_thread(monkeypatch):
    spec = ModelSpec("m", AttentionConfig(32, 4, 2), seed=1)
    engine = Engine(
        [spec], device=torch.device("cpu"), dtype=torch.float32, max_response_bytes=1 << 24
    )
    started, gate = threading.Event(), threading.Event()
    ran: list[str] = []

    def analyze(engine, request, *, include_weights):
        ran.append(threading.current_thread().name)
        if len(ran) == 1:  # the first holds its thread until the gate opens
            started.set()
            gate.wait(60)
        return len(ran)

    monkeypatch.setattr(async_engine, "analyze_heads", analyze)

    async def main() -> list[int]:
        compute = ComputeThreads(1, 1)
        serving = AsyncEngine(engine, compute)
        loop = asyncio.get_running_loop()
        try:
            x = torch.randn(1, 3, 32)
            first = asyncio.ensure_future(serving.analyze_heads(req("m", x), False))
            assert await loop.run_in_executor(None, started.wait, 60)
            second = asyncio.ensure_future(serving.analyze_heads(req("m", x), False))
            # the default executor is free meanwhile (to_thread answers at once)
            assert await asyncio.wait_for(asyncio.to_thread(lambda: "free"), 60) == "free"
            await asyncio.sleep(0)  # (the second has been handed to the executor)
            assert len(ran) == 1  # queued behind the first, not beside it
            gate.set()
            return [await first, await second]
        finally:
            gate.set()
            await serving.close()
            compute.shutdown()

    assert asyncio.run(main()) == [1, 2]
    assert all(name.startswith("compute-analysis") for name in ran), ran
