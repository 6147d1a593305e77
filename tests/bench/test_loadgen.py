"""The load generator (stats, bounds, both loops) against fakes and a real mha-serve, and the
bench's naive baseline server answering exactly as mha-serve does."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from mha_client import cli, loadgen
from mha_client.load_result import LoadResult, latency_stats
from mha_client.loadgen import (
    GrpcTarget,
    LoadSpec,
    Payloads,
    TargetError,
    Workload,
    parse_seq_lens,
    run_load,
    run_load_sync,
)
from mha_client.sdk import Client
from tests.helpers import ServerProcess

ROOT = Path(__file__).resolve().parents[2]
RESULT_FIELDS = {f.name for f in dataclasses.fields(LoadResult)}
LATENCY_FIELDS = {"count", "mean_ms", "p50_ms", "p95_ms", "p99_ms", "max_ms"}


class FakeTarget:
    """Answers after delay_s; every fail_every-th request is refused with UNAVAILABLE."""

    def __init__(self, delay_s: float = 0.001, fail_every: int = 0) -> None:
        self.delay_s, self.fail_every = delay_s, fail_every
        self.calls = self.in_flight = self.peak = 0

    async def send(self, payload: bytes, timeout: float | None) -> bytes:
        self.calls += 1
        number = self.calls
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            await asyncio.sleep(self.delay_s)
            if self.fail_every and number % self.fail_every == 0:
                raise TargetError("UNAVAILABLE", "fake refusal")
            return b"ok"
        finally:
            self.in_flight -= 1

    async def close(self) -> None:
        pass


WORKLOAD = Workload("mha", parse_seq_lens("16"), embed_dim=8)


def test_latency_stats_on_known_inputs():
    s = latency_stats(list(range(1, 101)))  # 1..100 ms
    assert s.count == 100 and s.max_ms == 100 and s.mean_ms == pytest.approx(50.5)
    # Linear interpolation between order statistics: rank p/100 * (n - 1).
    assert (s.p50_ms, s.p95_ms, s.p99_ms) == pytest.approx((50.5, 95.05, 99.01))
    one = latency_stats([7.0])
    assert one.p50_ms == one.p99_ms == one.max_ms == 7.0
    empty = latency_stats([])
    assert empty.count == 0 and math.isnan(empty.p99_ms)


def test_seq_len_distributions():
    rng = np.random.default_rng(0)
    fixed, uniform, listed = (parse_seq_lens(t) for t in ("16", "8..64", "16,32,128"))
    assert set(fixed.sample(rng, 50)) == {16}
    drawn = uniform.sample(rng, 2000)
    assert drawn.min() == 8 and drawn.max() == 64 and uniform.max == 64
    assert set(listed.sample(rng, 200)) == {16, 32, 128}
    assert [str(d) for d in (fixed, uniform, listed)] == ["16", "8..64", "16,32,128"]
    for bad in ("x", "64..8", "0", "8..", "16,,32"):
        with pytest.raises(ValueError):
            parse_seq_lens(bad)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"requests": 5}, "exactly one of concurrency"),
        ({"concurrency": 2, "rate": 5.0, "requests": 5}, "exactly one of concurrency"),
        ({"concurrency": 2}, "unbounded"),
        ({"rate": 5.0, "arrivals": "bursty", "requests": 5}, "poisson or uniform"),
    ],
)
def test_load_spec_refuses_what_cannot_work(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LoadSpec(**kwargs)


def test_closed_loop_counts_and_error_codes():
    target = FakeTarget(fail_every=10)
    spec = LoadSpec(concurrency=4, requests=50, warmup=10)
    result = asyncio.run(run_load(target, WORKLOAD, spec))
    assert target.calls == 60 and target.peak == 4  # warm-up sent, never more than N at once
    measured_failures = 5  # calls 20, 30, .., 60; call 10 was the last warm-up request
    assert result.ok + sum(result.errors.values()) == 50
    assert result.errors == {"UNAVAILABLE": measured_failures}
    assert result.latency.count == result.ok and result.latency.p50_ms >= 1.0
    assert result.tokens_per_s == pytest.approx(result.requests_per_s * 16)


def test_closed_loop_stops_at_its_duration():
    start = time.monotonic()
    result = asyncio.run(run_load(FakeTarget(), WORKLOAD, LoadSpec(concurrency=2, duration_s=0.3)))
    # (a lower bound only: the run waits out its duration; how much longer is the machine's)
    assert time.monotonic() - start >= 0.3 and result.ok > 10 and not result.errors


@pytest.mark.parametrize("arrivals", ["poisson", "uniform"])
def test_open_loop_sends_at_the_rate_without_waiting(arrivals):
    target = FakeTarget(delay_s=0.05)  # slower than the gap between arrivals
    spec = LoadSpec(rate=400.0, arrivals=arrivals, requests=60, warmup=5)
    result = asyncio.run(run_load(target, WORKLOAD, spec))
    assert result.ok == 60 and result.mode == "open" and not result.errors
    assert target.peak > 5  # requests overlapped: arrivals did not wait for replies
    assert (
        result.elapsed_s >= 0.1
    )  # paced at the rate (seeded gaps sum to 0.15-0.17 s), not sent at once


def test_every_request_is_encoded_before_the_clock_and_kept_within_its_budget(monkeypatch):
    """--seq-len 1..4096 encoded only its 256 shortest lengths before the clock: the others
    were encoded as they were first sent, inside their measured latency (p99 23 ms against a
    target that answers at once), and kept, ~10 GiB of requests at embed_dim 512."""
    monkeypatch.setattr(loadgen, "PAYLOAD_BUDGET_BYTES", 8 << 20, raising=False)
    sending, late, kept = [False], [], {}
    encode = Payloads.get

    def get(self: Payloads, length: int) -> bytes:
        if sending[0] and length not in self._cache:
            late.append(length)
        kept.update(self._cache)
        return encode(self, length)

    class Sending(FakeTarget):
        async def send(self, payload: bytes, timeout: float | None) -> bytes:
            sending[0] = True
            return await super().send(payload, timeout)

    monkeypatch.setattr(Payloads, "get", get)
    wide = Workload("mha", parse_seq_lens("1..4096"), embed_dim=64)  # 256 bytes a token
    result = asyncio.run(run_load(Sending(0.0), wide, LoadSpec(concurrency=1, requests=300)))
    assert result.ok == 300 and late == []  # none encoded once the clock ran
    assert 8 << 19 < sum(map(len, kept.values())) <= (8 << 20) * 1.01  # requests' headers


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = ServerProcess(log_path=tmp_path_factory.mktemp("bench") / "mha-serve.log")
    try:
        proc.wait_serving()
        yield proc
    finally:
        proc.stop()


def test_closed_and_open_loop_against_mha_serve(server):
    workload = Workload("mha", parse_seq_lens("4,9"), embed_dim=512, batch=2)
    closed = run_load_sync(
        lambda: GrpcTarget(server.target), workload, LoadSpec(concurrency=8, requests=50, warmup=5)
    )
    assert (
        closed.ok == 50
        and closed.errors == {}
        and closed.sequences_per_s == 2 * closed.requests_per_s
    )
    opened = run_load_sync(
        lambda: GrpcTarget(server.target), workload, LoadSpec(rate=200.0, requests=30, warmup=5)
    )
    assert opened.ok == 30 and opened.errors == {} and opened.latency.count == 30


def test_errors_are_counted_by_status_code(server):
    unknown = Workload("no-such-model", parse_seq_lens("4"), embed_dim=512)
    result = run_load_sync(
        lambda: GrpcTarget(server.target), unknown, LoadSpec(concurrency=2, requests=6)
    )
    assert result.ok == 0 and result.errors == {"NOT_FOUND": 6}


def test_cli_load_writes_json(server, tmp_path, capsys):
    out = tmp_path / "load.json"
    argv = [
        "load",
        "mha",
        "--target",
        server.target,
        "--concurrency",
        "4",
        "--requests",
        "40",
        "--warmup",
        "4",
        "--seq-len",
        "8..16",
        "--json-out",
        str(out),
    ]
    assert cli.main(argv) == 0
    data = json.loads(out.read_text())
    assert set(data) >= RESULT_FIELDS and set(data["latency"]) >= LATENCY_FIELDS
    assert data["ok"] == 40 and data["seq_lens"] == "8..16" and data["concurrency"] == 4
    assert "throughput" in capsys.readouterr().out


def test_naive_server_answers_as_mha_serve(server):
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "bench" / "naive_server.py"), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        address = re.search(r"listening on (\S+)", line)
        assert address, (
            f"naive server did not start: {line}{proc.stdout.read() if proc.poll() else ''}"
        )
        x = np.random.default_rng(3).standard_normal((3, 12, 512), dtype=np.float32)
        for model in ("mha", "gqa"):
            with Client(server.target) as ours, Client(address.group(1)) as naive:
                want = ours.attend(model, x, lengths=[12, 5, 9]).output
                got = naive.attend(model, x, lengths=[12, 5, 9]).output
                single = naive.attend(model, x[0]).output
            diff = np.abs(got - want)
            assert diff.max() <= 1e-5, f"{model}: max diff {diff.max():.2e}, mean {diff.mean():.2e}"
            np.testing.assert_allclose(single, want[0], atol=1e-5)
    finally:
        proc.terminate()
        proc.wait(30)


def test_the_progress_line_counts_what_the_report_counts():
    """The live req/s counted failures too, the report successful requests only: a run whose
    every request failed showed hundreds of req/s live, then 0.0."""
    run = loadgen._Run(LoadSpec(concurrency=1, requests=10, warmup=0), np.array([16]), 1)
    run.next_ticket(0.0)  # the first measured ticket starts the window
    run.measure_start = time.perf_counter() - 1.0
    for ticket in range(4):
        run.record(ticket, run.measure_start, None if ticket == 0 else "INVALID_ARGUMENT", 16)
    line = loadgen._progress_line(run, run.measure_start)
    assert "ok 1" in line and "errors 3" in line
    (rate,) = re.findall(r"([\d.]+) req/s", line)
    assert 0.5 < float(rate) < 1.5  # one ok in about a second, not four
