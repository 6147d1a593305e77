"""Load and overload over a real channel, bounded in count and time (figures printed for
docs/RELIABILITY.md; no timing is asserted): sustained load at the measured capacity is
answered OK and counted exactly by /metrics; 4x over capacity is refused with
RESOURCE_EXHAUSTED naming the queue limit while the queue and memory stay bounded, and the
server recovers; session steps past their deadline or cancelled under load leave no batch
slot, queued request or cache block behind."""

from __future__ import annotations

import asyncio
import time

import grpc
import numpy as np
import pytest

from mha_client.api import attention_pb2 as pb
from mha_client.api import attention_pb2_grpc as pb_grpc
from mha_serve.transport.drain import GRPC_HEADROOM
from tests.helpers import ServerProcess
from tests.reliability.conftest import rss_bytes
from tests.reliability.load import (
    Outcomes,
    attend_bytes,
    closed_loop,
    open_loop,
    requests_total,
    scrape,
)

pytestmark = pytest.mark.slow

MAX_QUEUE = 64
MAX_RPCS = 128
CONFIG = f"""
[server]
grace_period_s = 30
max_concurrent_rpcs = {MAX_RPCS}  # beyond it gRPC itself refuses: bounds the bytes held
torch_threads = 1  # one core computes; the other answers the event loop (and the test client)
[[models]]
name = "mha"
embed_dim = 512
num_heads = 8
num_kv_heads = 8
seed = 1
max_queue_requests = {MAX_QUEUE}
max_batch_size = 16  # bounds a forward's memory, and so the server's
kv_cache_bytes = 33554432
"""
BATCH, SEQ_LEN = 1, 256  # one request: compute outweighs the bytes
CONCURRENCY = 16
OVERLOAD = 4
OVERLOAD_S = 3.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    directory = tmp_path_factory.mktemp("load")
    (directory / "mha.toml").write_text(CONFIG)
    proc = ServerProcess(
        "--config", str(directory / "mha.toml"), log_path=directory / "mha-serve.log"
    )
    try:
        proc.wait_serving()
        yield proc
    finally:
        assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def capacity(server):
    """Requests per second at CONCURRENCY clients, measured on this machine now."""
    payload = attend_bytes("mha", BATCH, SEQ_LEN)

    async def measure():
        await closed_loop(server.target, payload, concurrency=CONCURRENCY, requests=64)  # warm
        return await closed_loop(server.target, payload, concurrency=CONCURRENCY, requests=400)

    out, elapsed = asyncio.run(measure())
    assert out.codes == {"OK": 400}, out.summary()
    rate = out.sent / elapsed
    print(f"\ncapacity: {rate:.0f} req/s at {CONCURRENCY} clients; {out.summary()}")
    return rate


def test_sustained_load_at_capacity_is_all_ok_and_counted(server, capacity):
    payload = attend_bytes("mha", BATCH, SEQ_LEN, seed=1)
    requests = max(200, int(capacity * 6))  # about six seconds
    before = scrape(server.metrics_port)
    out, elapsed = asyncio.run(
        closed_loop(server.target, payload, concurrency=CONCURRENCY, requests=requests)
    )
    after = scrape(server.metrics_port)
    print(f"\nsustained: {elapsed:.1f} s, {out.sent / elapsed:.0f} req/s; {out.summary()}")
    assert out.codes == {"OK": requests}, out.summary()
    counted = requests_total(after, "Attend", "OK") - requests_total(before, "Attend", "OK")
    assert counted == requests
    assert after["mha_serve_requests_in_flight"] == 0


async def _overload(server, capacity: float) -> dict:
    payload = attend_bytes("mha", BATCH, SEQ_LEN, seed=2)
    rate = OVERLOAD * capacity
    depths: list[float] = []
    running = True

    async def watch_queue() -> None:  # the queue depth gauge, sampled through the run
        while running:
            samples = await asyncio.to_thread(scrape, server.metrics_port)
            depths.append(samples.get('mha_serve_queue_depth{lane="fast",model="mha"}', 0.0))
            await asyncio.sleep(0.1)

    rss_before = rss_bytes(server.proc.pid)
    watcher = asyncio.create_task(watch_queue())
    out, elapsed = await open_loop(
        server.target, payload, rate=rate, requests=int(rate * OVERLOAD_S)
    )
    running = False
    await watcher
    rss_after = rss_bytes(server.proc.pid)
    # Recovery: from the end of the overload to the first OK, then a run at normal load.
    end = time.perf_counter()
    first_ok = None
    async with grpc.aio.insecure_channel(server.target) as channel:
        attend = channel.unary_unary("/mha.v1.AttentionService/Attend")
        while first_ok is None:
            try:
                await attend(payload, timeout=30)
                first_ok = time.perf_counter() - end
            except grpc.aio.AioRpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    after, _ = await closed_loop(server.target, payload, concurrency=4, requests=100)
    return {
        "out": out,
        "elapsed": elapsed,
        "rate": rate,
        "max_depth": max(depths, default=0.0),
        "rss_growth": rss_after - rss_before,
        "first_ok_s": first_ok,
        "after": after,
    }


def test_four_times_capacity_is_refused_fast_bounded_and_recovers(server, capacity):
    before = scrape(server.metrics_port)
    r = asyncio.run(_overload(server, capacity))
    samples = scrape(server.metrics_port)
    out: Outcomes = r["out"]
    print(
        f"\noverload {OVERLOAD}x: {r['rate']:.0f} req/s offered for {r['elapsed']:.1f} s; "
        f"{out.summary()}; max queue depth {r['max_depth']:.0f} (limit {MAX_QUEUE}); "
        f"RSS growth {r['rss_growth'] / 2**20:.1f} MiB; first OK {r['first_ok_s'] * 1e3:.0f} ms "
        f"after; then {r['after'].summary()}"
    )
    assert set(out.codes) <= {"OK", "RESOURCE_EXHAUSTED"}, out.summary()
    assert out.codes["RESOURCE_EXHAUSTED"] > 0 and out.codes["OK"] > 0
    # Refused by the batch queue or by max_concurrent_rpcs (each limit named), or by gRPC's
    # own limit GRPC_HEADROOM above it.
    messages = out.details["RESOURCE_EXHAUSTED"]
    print("RESOURCE_EXHAUSTED messages:", messages)
    assert all(
        f"queued (limit {MAX_QUEUE})" in m
        or f"{MAX_RPCS} calls at once" in m
        or "Concurrent RPC limit exceeded" in m
        for m in messages
    ), messages
    assert r["max_depth"] <= MAX_QUEUE
    # Bounded by what may be held at once: gRPC's limit of requests (a few copies each:
    # gRPC's buffer, the message, the batch) and one batch's forward.
    request_bytes = BATCH * SEQ_LEN * 512 * 4
    assert r["rss_growth"] < 3 * (MAX_RPCS + GRPC_HEADROOM) * request_bytes + 128 * 2**20
    assert r["after"].codes == {"OK": 100}, r["after"].summary()  # full recovery
    for code in ("OK", "RESOURCE_EXHAUSTED"):
        counted = requests_total(samples, "Attend", code) - requests_total(before, "Attend", code)
        assert counted >= out.codes[code]  # (the recovery probes add to OK)
    assert samples["mha_serve_requests_in_flight"] == 0
    assert samples['mha_serve_queue_depth{lane="fast",model="mha"}'] == 0


def test_deadlines_and_cancellation_under_load_free_slots_and_blocks(server, capacity):
    async def run() -> tuple[Outcomes, list[int], list[pb.SessionInfo], pb.ModelInfo]:
        async with grpc.aio.insecure_channel(server.target) as channel:
            stub = pb_grpc.AttentionServiceStub(channel)
            sessions = [
                (await stub.CreateSession(pb.CreateSessionRequest(model="mha"))).session_id
                for _ in range(16)
            ]
            kept = [0] * len(sessions)
            steps = Outcomes()
            x = np.random.default_rng(3).standard_normal((1, 8, 512), dtype=np.float32)
            tensor = pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=x.shape, data=x.tobytes())

            async def stepper(i: int) -> None:  # tight deadlines, some calls cancelled
                for n in range(12):
                    start = time.perf_counter()
                    call = stub.Attend(
                        pb.AttendRequest(session_id=sessions[i], input=tensor),
                        timeout=0.05 + 0.05 * (n % 4),
                    )
                    if n % 5 == 4:
                        await asyncio.sleep(0.005 * (i % 3))
                        call.cancel()
                    try:
                        await call
                        steps.add(grpc.StatusCode.OK, (time.perf_counter() - start) * 1e3)
                        kept[i] += 8
                    except asyncio.CancelledError:
                        steps.add(grpc.StatusCode.CANCELLED, (time.perf_counter() - start) * 1e3)
                    except grpc.aio.AioRpcError as e:
                        steps.add(e.code(), (time.perf_counter() - start) * 1e3)

            payload = attend_bytes("mha", BATCH, SEQ_LEN, seed=4)
            load = asyncio.create_task(
                open_loop(server.target, payload, rate=2 * capacity, requests=int(capacity * 3))
            )
            await asyncio.gather(*(stepper(i) for i in range(len(sessions))))
            await load
            infos = [await stub.GetSession(pb.GetSessionRequest(session_id=s)) for s in sessions]
            model = await stub.GetModelInfo(pb.GetModelInfoRequest(name="mha"))
            for s in sessions:
                await stub.CloseSession(pb.CloseSessionRequest(session_id=s))
            return steps, kept, infos, model

    steps, kept, infos, model = asyncio.run(run())
    samples = scrape(server.metrics_port)
    print(
        f"\nsession steps under 2x load with 50-200 ms deadlines, some cancelled: {steps.summary()}"
    )
    allowed = {"OK", "DEADLINE_EXCEEDED", "CANCELLED", "RESOURCE_EXHAUSTED"}
    assert set(steps.codes) <= allowed, steps.summary()
    assert steps.codes["DEADLINE_EXCEEDED"] + steps.codes["CANCELLED"] > 0
    # A step that was not answered OK may still have been kept when its answer was lost
    # on the way (cancelled after commit): a session holds at least its OK steps' tokens.
    for info, tokens in zip(infos, kept, strict=True):
        assert info.num_tokens >= tokens and info.num_tokens % 8 == 0
    assert model.kv_cache.num_blocks_used == sum(i.num_blocks for i in infos)
    after = scrape(server.metrics_port)
    assert after['mha_serve_kv_cache_blocks{model="mha",state="used"}'] == 0  # all closed
    assert samples["mha_serve_requests_in_flight"] == 0
    assert samples['mha_serve_queue_depth{lane="fast",model="mha"}'] == 0
