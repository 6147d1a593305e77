"""`mha-client load` sends what every command sends: its load requests carry the CLI's
metadata (--application) as its model lookup does (the numpy echo servicer, no torch)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent import futures

import grpc
import pytest

from mha_client.api import attention_pb2_grpc as pb_grpc
from mha_client.cli import main
from tests.client.test_sdk_fake import EchoServicer


class MetadataEcho(EchoServicer):
    """The echo servicer, remembering each call's application metadata."""

    def __init__(self) -> None:
        super().__init__()
        self.applications: list[tuple[str, str | None]] = []
        self.peers: list[str] = []  # each Attend's client address and port: its connection

    def _note(self, method: str, context) -> None:
        metadata = dict(context.invocation_metadata())
        self.applications.append((method, metadata.get("application")))

    def GetModelInfo(self, request, context):
        self._note("GetModelInfo", context)
        return super().GetModelInfo(request, context)

    def Attend(self, request, context):
        self._note("Attend", context)
        self.peers.append(context.peer())
        return super().Attend(request, context)


@contextlib.contextmanager
def echo_server(servicer: MetadataEcho | None = None):
    """A MetadataEcho (or servicer) on 127.0.0.1: (servicer, port), stopped at the end."""
    servicer = servicer or MetadataEcho()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_AttentionServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield servicer, port
    finally:
        server.stop(grace=None)


def test_load_requests_carry_the_application_metadata(tmp_path, capsys):
    out = tmp_path / "load.json"
    with echo_server() as (servicer, port):
        argv = ["--application", "mha", "load", "echo", "--target", f"127.0.0.1:{port}"]
        argv += ["--requests", "4", "--warmup", "1", "--seq-len", "2", "--json-out", str(out)]
        assert main(argv) == 0, capsys.readouterr().err
    assert json.loads(out.read_text())["ok"] == 4
    assert servicer.applications[0] == ("GetModelInfo", "mha")
    assert servicer.applications[1:] == [("Attend", "mha")] * 5  # warm-up included


def test_load_spreads_its_calls_over_the_channels_asked(tmp_path, capsys):
    """--channels N: N connections (what spreads load over a server's frontend workers)."""
    with echo_server() as (servicer, port):
        argv = ["load", "echo", "--target", f"127.0.0.1:{port}", "--channels", "3"]
        argv += ["--requests", "9", "--warmup", "0", "--seq-len", "2", "--concurrency", "3"]
        assert main(argv) == 0, capsys.readouterr().err
    assert len(set(servicer.peers[:9])) == 3  # calls taken in turn over 3 connections
    capsys.readouterr()
    assert main(["load", "echo", "--channels", "0"]) == 2  # argparse's exit, with the reason
    assert "'0' is not a positive integer" in capsys.readouterr().err


def test_load_cores_are_its_cpu_seconds_over_the_wall_seconds_they_took(tmp_path, capsys):
    """A short run printed "client cpu 0.0 s (2.61 cores)" on 2 cores: CPU of the whole run
    (warm-up included) over the measured window alone, and its seconds rounded to 0.0."""
    out = tmp_path / "load.json"
    with echo_server() as (_, port):
        argv = ["load", "echo", "--target", f"127.0.0.1:{port}", "--requests", "3"]
        argv += ["--warmup", "20", "--seq-len", "2", "--json-out", str(out)]
        assert main(argv) == 0, capsys.readouterr().err
    data = json.loads(out.read_text())
    cpu_s, wall_s = data["client_cpu_s"], data["client_wall_s"]
    assert wall_s >= data["elapsed_s"] > 0  # the whole run holds the measured window
    line = re.search(
        r"client cpu +(\d+\.\d{3}) s in (\d+\.\d{3}) s, warm-up included \((\d+\.\d\d) cores\)",
        capsys.readouterr().out,
    )
    assert line, "no client cpu line"
    shown_cpu, shown_wall, shown_cores = map(float, line.groups())
    assert shown_cpu == pytest.approx(cpu_s, abs=5e-4)
    assert shown_wall == pytest.approx(wall_s, abs=5e-4)
    assert shown_cores == pytest.approx(cpu_s / wall_s, abs=5e-3)
    assert shown_cores <= (os.cpu_count() or 1) + 0.05  # a process cannot use more cores


class Refusing(MetadataEcho):
    """Refuses every Attend, saying why, as mha-serve does for a request over a limit."""

    def Attend(self, request, context):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, "seq_len 2 exceeds max_seq_len 1")


def test_load_says_what_its_refusals_said(tmp_path, capsys):
    """Every request refused printed "errors INVALID_ARGUMENT 3" and nothing of the reason
    (a --seq-len over the model's max_seq_len, weights over their limit), which the server
    had sent with each refusal."""
    out = tmp_path / "load.json"
    with echo_server(Refusing()) as (_, port):
        argv = ["load", "echo", "--target", f"127.0.0.1:{port}", "--requests", "3"]
        argv += ["--warmup", "0", "--seq-len", "2", "--json-out", str(out)]
        assert main(argv) == 1  # nothing answered OK
    text = capsys.readouterr().out
    assert "INVALID_ARGUMENT 3" in text
    assert "first INVALID_ARGUMENT: seq_len 2 exceeds max_seq_len 1" in text
    data = json.loads(out.read_text())
    assert data["error_messages"] == {"INVALID_ARGUMENT": "seq_len 2 exceeds max_seq_len 1"}


class HalfRefusing(MetadataEcho):
    """Refuses every other Attend (a server shedding load), answers the rest."""

    def Attend(self, request, context):
        super()._note("Attend", context)
        if len(self.applications) % 2:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "the server is over its limit")
        return EchoServicer.Attend(self, request, context)


@pytest.mark.parametrize(
    ("flags", "code"), [([], 1), (["--max-error-rate", "0.4"], 1), (["--max-error-rate", "0.5"], 0)]
)
def test_load_exits_1_when_more_requests_failed_than_allowed(flags, code, capsys):
    """A run where half the requests failed exited 0 (any answer counted as success): a CI
    job or script running `load` saw nothing wrong. Now any failure is exit 1, unless
    --max-error-rate allows that fraction (the failures are still reported either way)."""
    with echo_server(HalfRefusing()) as (_, port):
        argv = ["load", "echo", "--target", f"127.0.0.1:{port}", "--requests", "8"]
        argv += ["--warmup", "0", "--seq-len", "2", *flags]
        assert main(argv) == code
    out, err = capsys.readouterr()
    assert "RESOURCE_EXHAUSTED 4" in out
    said = "4 of 8 measured requests failed (50.0%), over --max-error-rate"
    assert (said in err) == (code == 1)


def test_load_refuses_an_error_rate_that_is_not_a_fraction(capsys):
    assert main(["load", "echo", "--max-error-rate", "1.5"]) == 2
    assert "'1.5' is not a fraction from 0 to 1" in capsys.readouterr().err


def test_load_json_of_a_run_with_no_answer_is_strict_json(tmp_path, capsys):
    """--json-out wrote "p50_ms": NaN when no request answered OK: Python reads it, but it is
    not JSON (jq, JavaScript's JSON.parse and Go refuse the file). No answer: null."""

    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    out = tmp_path / "load.json"
    with echo_server(Refusing()) as (_, port):
        argv = ["load", "echo", "--target", f"127.0.0.1:{port}", "--requests", "2"]
        argv += ["--warmup", "0", "--seq-len", "2", "--json-out", str(out)]
        assert main(argv) == 1
    data = json.loads(out.read_text(), parse_constant=refuse)
    assert data["latency"] == dict.fromkeys(
        ("mean_ms", "p50_ms", "p95_ms", "p99_ms", "max_ms"), None
    ) | {"count": 0}
    assert "p50 nan" in capsys.readouterr().out  # the text report is unchanged


class Slow(MetadataEcho):
    """Answers each Attend after 20 ms: a load that runs until it is stopped."""

    def Attend(self, request, context):
        time.sleep(0.02)
        return super().Attend(request, context)


def test_ctrl_c_stops_the_load_and_prints_what_it_measured(tmp_path):
    """Ctrl-C in a --duration run printed a KeyboardInterrupt traceback and nothing it had
    measured. Now it cancels what is in flight, prints the report of what answered by then
    (and writes --json-out) and exits 130."""
    out = tmp_path / "load.json"
    with echo_server(Slow()) as (servicer, port):
        argv = ["load", "echo", "--target", f"127.0.0.1:{port}", "--duration", "60"]
        argv += ["--warmup", "0", "--seq-len", "2", "--concurrency", "2", "--json-out", str(out)]
        proc = subprocess.Popen(
            [sys.executable, "-m", "mha_client.cli", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            deadline = time.monotonic() + 30
            while len(servicer.peers) < 10 and time.monotonic() < deadline:
                time.sleep(0.05)
            proc.send_signal(signal.SIGINT)
            stdout, stderr = proc.communicate(timeout=30)
        finally:
            proc.kill()
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    assert "stopped by Ctrl-C" in stdout and "latency ms" in stdout
    data = json.loads(out.read_text())
    assert data["interrupted"] is True and data["ok"] >= 8 and data["errors"] == {}
    assert 0 < data["elapsed_s"] < 30


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--batch", "0", "'0' is not a positive integer"),
        ("--batch", "-1", "'-1' is not a positive integer"),
        ("--duration", "0", "'0' is not a positive number of seconds"),
        ("--rate", "0", "'0' is not a positive number of requests/s"),
        ("--rate", "inf", "'inf' is not a positive number of requests/s"),
    ],
)
def test_load_refuses_a_number_that_cannot_work_as_a_usage_error(flag, value, message, capsys):
    """--batch 0 sent empty requests (every one INVALID_ARGUMENT), --batch -1 failed with
    "error: negative dimensions are not allowed" and --duration 0 or --rate 0 with
    "error: duration_s must be > 0": exit 1, as if the server had failed, naming no flag."""
    with echo_server() as (servicer, port):
        argv = ["load", "echo", "--target", f"127.0.0.1:{port}", "--requests", "2", flag, value]
        assert main(argv) == 2
    assert message in capsys.readouterr().err and servicer.applications == []  # nothing sent
