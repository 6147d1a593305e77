"""bench/floor_server.py answers what it stands for: a stream's steps equal overhead.BareStep
run independently on the same tokens at the same positions, an Attend (inline, and batched
with others queued) equals the module's forward, bad streams get a status that says why; and
bench/overhead_report.py renders the floor columns, or dashes for a run without them.
No timing is asserted."""

from __future__ import annotations

import asyncio
import copy
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from inprocess import load  # noqa: E402
from overhead import TARGETS, BareStep  # noqa: E402
from overhead_report import render  # noqa: E402
from served_bench import ATTEND_METHOD, OPTIONS, STEP_METHOD, free_port  # noqa: E402

from mha_client.api import attention_pb2 as pb  # noqa: E402
from mha_client.messages import build_attend_request, step_request  # noqa: E402

EMBED = 512
# Both sides run the same torch ops on one thread, in two processes: equal to the last bit
# here; the tolerance only allows another BLAS build to order a sum differently.
TOL = {"rtol": 1e-6, "atol": 1e-6}


def start_floor(tmp_path: Path, mode: str, *flags: str) -> Iterator[str]:
    port = free_port()
    log = tmp_path / f"floor-{mode}.log"
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "bench" / "floor_server.py"), "--port", str(port)]
        + ["--attend", mode, *flags],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 60
        while b"floor ready" not in log.read_bytes():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.fixture(scope="module")
def floor(tmp_path_factory) -> Iterator[str]:
    yield from start_floor(tmp_path_factory.mktemp("floor"), "inline")


@pytest.fixture(scope="module")
def floor_busy(tmp_path_factory) -> Iterator[str]:
    """The floor with its loop busy polling (overhead.py --floor-busy-poll-us)."""
    yield from start_floor(tmp_path_factory.mktemp("floor"), "inline", "--busy-poll-us=300")


@pytest.fixture(scope="module")
def floor_batched(tmp_path_factory) -> Iterator[str]:
    yield from start_floor(tmp_path_factory.mktemp("floor"), "batched")


def output(reply: bytes) -> tuple[pb.AttendResponse, np.ndarray]:
    message = pb.AttendResponse.FromString(reply)
    t = message.output
    assert t.dtype == pb.DTYPE_FLOAT32
    return message, np.frombuffer(t.data, np.float32).reshape(tuple(t.shape))


@pytest.mark.parametrize("server", ["floor", "floor_busy"])
def test_stream_steps_equal_the_bare_step(server, request):
    floor = request.getfixturevalue(server)
    model, start, ctx, steps = "gqa", 48, 64, 6
    tokens = np.random.default_rng(1).standard_normal((steps, 1, EMBED), dtype=np.float32)
    meta = (("floor-model", model), ("floor-start", str(start)), ("floor-context", str(ctx)))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the floor's step
    try:
        bare = BareStep(model, ctx)
        expected = [
            bare(torch.from_numpy(tokens[i]).view(1, 1, EMBED), start + i).numpy()
            for i in range(steps)
        ]
    finally:
        torch.set_num_threads(threads)
    with grpc.insecure_channel(floor, options=OPTIONS) as channel:
        call = channel.stream_stream(STEP_METHOD)
        for _ in range(2):  # a second stream of the same (model, context) starts over
            requests = (step_request("s1", t, {}).SerializeToString() for t in tokens)
            replies = list(call(requests, metadata=meta))
            assert len(replies) == steps
            for i, reply in enumerate(replies):
                message, y = output(reply)
                assert y.shape == (1, EMBED)  # (T, E), as the request's input
                np.testing.assert_allclose(y, expected[i].reshape(1, EMBED), **TOL)
                assert message.session.session_id == "s1"
                assert message.session.num_tokens == start + i + 1
                assert message.model == model


def test_a_spin_stream_answers_zeros_and_counts_its_positions(floor):
    model, start, ctx = "mqa", 10, 32
    tokens = np.random.default_rng(2).standard_normal((3, 1, EMBED), dtype=np.float32)
    meta = (("floor-model", model), ("floor-start", str(start)), ("floor-context", str(ctx)))
    with grpc.insecure_channel(floor, options=OPTIONS) as channel:
        call = channel.stream_stream(STEP_METHOD)
        requests = [step_request("s2", t, {}).SerializeToString() for t in tokens]
        replies = list(call(iter(requests), metadata=(*meta, ("floor-spin-us", "50"))))
        assert len(replies) == 3
        for i, reply in enumerate(replies):
            message, y = output(reply)
            assert y.shape == (1, EMBED) and not y.any()
            assert message.session.num_tokens == start + i + 1
        for bad in ("-1", "fast", "2e6"):
            with pytest.raises(grpc.RpcError) as err:
                list(call(iter(requests), metadata=(*meta, ("floor-spin-us", bad))))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "floor-spin-us" in err.value.details()


def test_a_stream_without_its_setup_or_past_its_context_is_refused(floor):
    token = np.zeros((1, EMBED), np.float32)
    with grpc.insecure_channel(floor, options=OPTIONS) as channel:
        call = channel.stream_stream(STEP_METHOD)
        with pytest.raises(grpc.RpcError) as err:
            list(call(iter([step_request("s", token, {}).SerializeToString()])))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "floor-model" in err.value.details()
        meta = (("floor-model", "mha"), ("floor-start", "7"), ("floor-context", "8"))
        requests = [step_request("s", token, {}).SerializeToString()] * 2
        with pytest.raises(grpc.RpcError) as err:
            list(call(iter(requests), metadata=meta))
        assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE
        two = np.zeros((2, EMBED), np.float32)  # two tokens: a step is one
        with pytest.raises(grpc.RpcError) as err:
            list(call(iter([step_request("s", two, {}).SerializeToString()]), metadata=meta))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def forward(model: str, x: np.ndarray) -> np.ndarray:
    with torch.inference_mode():
        return load(model)(torch.from_numpy(x)).output.numpy()


def test_attend_equals_the_forward_inline(floor):
    x = np.random.default_rng(2).standard_normal((2, 16, EMBED), dtype=np.float32)
    with grpc.insecure_channel(floor, options=OPTIONS) as channel:
        reply = channel.unary_unary(ATTEND_METHOD)(
            build_attend_request("mha", x).SerializeToString()
        )
        with pytest.raises(grpc.RpcError) as err:
            channel.unary_unary(ATTEND_METHOD)(build_attend_request("nope", x).SerializeToString())
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
    _, y = output(reply)
    np.testing.assert_allclose(y, forward("mha", x), rtol=1e-5, atol=1e-5)


def test_attend_batched_answers_each_request_with_its_own_rows(floor_batched):
    # Concurrent requests are stacked into one forward: each must get its rows back.
    # (Batched GEMMs may sum in another order than one request's: 1e-5.)
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal((1, 16, EMBED), dtype=np.float32) for _ in range(8)]
    xs.append(rng.standard_normal((1, 8, EMBED), dtype=np.float32))  # another shape

    async def send_all() -> list[bytes]:
        async with grpc.aio.insecure_channel(floor_batched, options=OPTIONS) as channel:
            call = channel.unary_unary(ATTEND_METHOD)
            return await asyncio.gather(
                *(call(build_attend_request("mqa", x).SerializeToString()) for x in xs)
            )

    for x, reply in zip(xs, asyncio.run(send_all()), strict=True):
        _, y = output(reply)
        np.testing.assert_allclose(y, forward("mqa", x), rtol=1e-5, atol=1e-5)


def test_one_forward_answers_everything_queued_with_its_own_rows():
    # In process, gated: the worker cannot take the queue while the test holds its lock, so
    # the requests below are one batch (two forwards: one per shape).
    from floor_server import BatchWorker

    rng = np.random.default_rng(4)
    xs = [rng.standard_normal((b, 16, EMBED), dtype=np.float32) for b in (1, 3, 2)]
    xs.append(rng.standard_normal((1, 4, EMBED), dtype=np.float32))
    module = load("mha")

    async def queue_all() -> list[bytes]:
        worker = BatchWorker(asyncio.get_running_loop())
        with worker.ready:
            answers = [
                worker.submit(build_attend_request("mha", x), module, torch.from_numpy(x), 0.0)
                for x in xs
            ]
        return await asyncio.gather(*answers)

    replies = asyncio.run(queue_all())
    for x, reply in zip(xs, replies, strict=True):
        message, y = output(reply)
        np.testing.assert_allclose(y, forward("mha", x), rtol=1e-5, atol=1e-5)
        assert message.timing.batch_size == (6 if x.shape[1] == 16 else 1)


FLOOR_KEYS = ("floor", "spin", "served_over_floor")


def test_report_renders_the_floor_and_dashes_without_it():
    old = json.loads((ROOT / "bench" / "results" / "overhead.json").read_text())
    for row in old["decode"] + old["small"]:  # as a run before the floor server
        for k in [k for k in row if k.startswith(FLOOR_KEYS)]:
            del row[k]
    page = render(old, TARGETS, notes=False)
    assert "| floor | floor/limit | served/floor |" in page
    assert f"**{old['decode'][0]['ratio']:.2f}** | - | - | - |" in page  # its first row: dashes
    assert "did not measure it" in page
    assert "| waiting | the step in a server |" not in page  # no spin side: no split

    new = copy.deepcopy(old)
    for row in new["decode"]:
        row.update(floor_ms=0.5, floor_ratio=0.5 / row["limit_ms"])
        row["served_over_floor"] = row["served_ms"] / 0.5
    for row in new["small"]:
        row.update(floor_seq_per_s=1234.0, floor_inline_seq_per_s=1000.0)
        row.update(floor_batched_seq_per_s=1234.0, floor_best="batched")
        row.update(floor_ratio=0.87, served_over_floor=0.66)
    page = render(new, TARGETS, notes=False)
    first = new["decode"][0]
    assert (
        f"**{first['ratio']:.2f}** | 0.500 | {first['floor_ratio']:.2f} "
        f"| {first['served_over_floor']:.2f} |" in page
    )
    assert "| 1234 (1000, 1234) | 0.87 | 0.66 |" in page
    assert "did not measure it" not in page
    assert "| waiting | the step in a server |" not in page  # no spin side: no split


def test_report_renders_the_busy_floor_and_each_variant_over_it():
    results = json.loads((ROOT / "bench" / "results" / "overhead.json").read_text())
    unmeasured = copy.deepcopy(results)
    unmeasured.pop("floor_busy_poll_us", None)  # as a run without --floor-busy-poll-us
    for row in unmeasured["decode"]:
        row.pop("floor_busy_ms", None)
    assert "| floor busy |" not in render(unmeasured, TARGETS, notes=False)
    results.update(variants={"busy300": ["--busy-poll-us=300"]}, floor_busy_poll_us=300)
    results["baseline_tree"] = None  # (its columns: the variant's only)
    for row in results["decode"]:
        row.update(busy300_ms=0.6, busy300_ratio=0.6 / row["limit_ms"])
        row.update(floor_busy_ms=0.5, floor_busy_ratio=0.5 / row["limit_ms"])
    for row in results["small"]:
        row.update(busy300_seq_per_s=1000.0, busy300_ratio=0.5)
    del results["decode"][-1]["floor_busy_ms"]  # a row without it: dashes
    page = render(results, TARGETS, notes=False)
    assert "| floor busy | floor busy/limit | busy300/floor busy |" in page
    assert "polling 300 us for its next event" in page
    first, last = results["decode"][0], results["decode"][-1]
    assert (
        f"| 0.600 | {first['busy300_ratio']:.2f} | 0.500 | {first['floor_busy_ratio']:.2f} | 1.20 |"
        in page
    )
    assert (
        f"| 0.600 | {last['busy300_ratio']:.2f} | - | {last['floor_busy_ratio']:.2f} | - |" in page
    )


def test_report_splits_the_served_step_by_the_spin_side():
    results = json.loads((ROOT / "bench" / "results" / "overhead.json").read_text())
    row = results["decode"][0]
    row.update(served_ms=1.0, inprocess_ms=0.2, echo_ms=0.3, limit_ms=0.5, spin_us=190.0)
    row.update(spin_ms=0.55, floor_ms=0.8, floor_ratio=1.6, served_over_floor=1.25)
    page = render(results, TARGETS, notes=False)
    # waiting 550 - 300 - 190 = +60; the step 800 - 550 + 190 - 200 = +240; own +200
    assert f"| {row['model']} | {row['context']} | 500 | +60 | +240 | +200 | 1000 |" in page
    others = [r for r in results["decode"][1:] if "spin_ms" in r]
    table = page.split("| waiting | the step in a server |")[1].split("\n\n")[0]
    assert table.count("\n| ") == 2 + len(others)  # the divider, this row, any others


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="CPU affinity is Linux-only")
def test_pin_puts_the_floor_servers_event_loop_on_its_cpu(tmp_path):
    """overhead.py --pin: the echo's and the floor's event loop (serve_methods, PIN_ENV) on
    the CPU given, as mha-serve's --event-loop-cpu; the floor's batch worker, started before
    it, keeps every CPU."""
    from overhead import PIN_ENV
    from served_bench import start

    cpu = max(os.sched_getaffinity(0))
    log = tmp_path / "floor.log"
    proc = start(
        [sys.executable, str(ROOT / "bench" / "floor_server.py"), "--attend", "batched"]
        + ["--port", str(free_port())],
        log,
        {PIN_ENV: str(cpu)},
    )
    try:
        deadline = time.monotonic() + 60
        while b"floor ready" not in log.read_bytes():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        lists = {}
        for tid in os.listdir(f"/proc/{proc.pid}/task"):
            status = Path(f"/proc/{proc.pid}/task/{tid}/status").read_text()
            lists[int(tid)] = next(
                line.split()[1]
                for line in status.splitlines()
                if line.startswith("Cpus_allowed") and "list" in line
            )
        assert lists[proc.pid] == str(cpu)  # the main thread: the event loop
        assert len(os.sched_getaffinity(0)) == 1 or len(set(lists.values())) == 2
    finally:
        proc.terminate()
        proc.wait(30)
