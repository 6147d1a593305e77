"""A frontend worker's gRPC server (transport/frontend.py) in this process, in front of the
engine process's half (serving/host.py: EngineHost over the real AsyncEngine) on a real
Unix socket, as `mha-serve --frontend-workers N` runs them in two processes. The lane's
compute is held by a gate (tests/transport/test_batching_server.py), so a call stays in
flight for as long as a test needs."""

from __future__ import annotations

import asyncio
import contextlib
import os

import grpc
import pytest

from mha_client.api import attention_pb2 as pb
from mha_client.api import attention_pb2_grpc as pb_grpc
from mha_serve.config import ServerConfig
from mha_serve.engine import ModelSpec
from mha_serve.engine.threads import ComputeThreads
from mha_serve.model import AttentionConfig
from mha_serve.serving import AsyncEngine
from mha_serve.serving.host import EngineHost
from mha_serve.transport.frontend import FrontendServer
from mha_serve.transport.server import load_engine
from tests.helpers import free_port
from tests.transport.test_batching_server import (
    DEADLINE_S,
    WAIT_S,
    Gate,
    attend_counted,
    request,
    until_counted,
)

INDEX = 1  # this frontend's, of WORKERS
WORKERS = 2


@contextlib.asynccontextmanager
async def frontend(tmp_path, **server_kw):
    """(frontend server, gate on the engine's lane, stub to the frontend)."""
    spec = ModelSpec("small", AttentionConfig(32, 4, 2), max_queue_delay_ms=0)
    cfg = ServerConfig(
        host="127.0.0.1",
        port=free_port(),
        metrics_port=0,
        models=[spec],
        frontend_workers=WORKERS,
        **server_kw,
    )
    compute = ComputeThreads(1, 1)
    serving = AsyncEngine(load_engine(cfg), compute, inline=False)  # (never on the loop)
    serving.start()
    lane = serving.lanes["small"].fast
    gate = Gate(lane._run_batch)  # noqa: SLF001 - the test's hold on the compute thread
    lane._run_batch = gate  # noqa: SLF001
    host = EngineHost(tmp_path / "engine.sock")
    await host.start()
    host.ready(serving)
    server = FrontendServer(cfg, str(tmp_path / "engine.sock"), os.getpid(), INDEX)
    try:
        await server.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            yield server, gate, pb_grpc.AttentionServiceStub(channel)
    finally:
        gate.open.set()
        await server.stop()
        await host.close()
        await serving.close()
        compute.shutdown()


async def test_past_max_concurrent_rpcs_the_refusal_names_the_frontend_worker(tmp_path):
    async with frontend(tmp_path, max_concurrent_rpcs=1) as (_, gate, stub):
        held = asyncio.ensure_future(stub.Attend(request(1), timeout=WAIT_S))
        assert await asyncio.to_thread(gate.entered.wait, WAIT_S)  # the limit's one call
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.GetModelInfo(pb.GetModelInfoRequest(name="small"), timeout=WAIT_S)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        details = err.value.details()
        assert f"frontend worker {INDEX} of {WORKERS} is handling 1 calls at once" in details
        assert "per frontend worker" in details, details
        gate.open.set()
        assert list((await held).output.shape) == [1, 1, 32]


async def test_a_deadline_that_passes_while_the_call_computes_is_counted_deadline_exceeded(
    tmp_path,
):
    async with frontend(tmp_path) as (_, gate, stub):
        before = {code: attend_counted(code) for code in ("DEADLINE_EXCEEDED", "CANCELLED")}
        call = asyncio.ensure_future(stub.Attend(request(1), timeout=DEADLINE_S))
        assert await asyncio.to_thread(gate.entered.wait, WAIT_S)  # computing, held
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await until_counted(before)
        assert attend_counted("DEADLINE_EXCEEDED") == before["DEADLINE_EXCEEDED"] + 1
        assert attend_counted("CANCELLED") == before["CANCELLED"]
