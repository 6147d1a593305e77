"""Clients killed mid-request and mid-stream, again and again, and SIGTERM under load,
over real channels to a real `mha-serve` process."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mha_client.api import attention_pb2 as pb
from mha_client.api import attention_pb2_grpc as pb_grpc
from mha_serve.transport.drain import SHUTTING_DOWN
from tests.helpers import ServerProcess
from tests.reliability.gated_exit import EXIT_GATE_ENV, POINTS
from tests.reliability.gated_serve import GATE_ENV, GATE_LEN
from tests.reliability.load import ATTEND, Outcomes, attend_bytes, scrape

pytestmark = pytest.mark.slow

KILLS = 4  # of each kind
WAIT_S = 60.0

# A client that starts a 16 MiB Attend and says so, then waits to be killed.
MID_REQUEST = """
import sys, grpc, numpy as np
from mha_client.api import attention_pb2 as pb, attention_pb2_grpc as pb_grpc
x = np.ones((8, 512, 512), np.float32)
ch = grpc.insecure_channel(sys.argv[1], options=[("grpc.max_send_message_length", 1 << 26)])
stub = pb_grpc.AttentionServiceStub(ch)
req = pb.AttendRequest(model="mha", input=pb.Tensor(dtype=1, shape=x.shape, data=x.tobytes()))
call = stub.Attend.future(req, timeout=600)
print("sent", flush=True)
call.result()
"""

# A client that streams steps of a session: two answered, a third sent, then killed.
MID_STREAM = """
import queue, sys, grpc, numpy as np
from mha_client.api import attention_pb2 as pb, attention_pb2_grpc as pb_grpc
ch = grpc.insecure_channel(sys.argv[1])
stub = pb_grpc.AttentionServiceStub(ch)
sid = stub.CreateSession(pb.CreateSessionRequest(model="gqa"), timeout=30).session_id
x = np.ones((1, 64, 512), np.float32)
step = pb.AttendRequest(session_id=sid, input=pb.Tensor(dtype=1, shape=x.shape, data=x.tobytes()))
q = queue.Queue()
replies = stub.StreamSession(iter(q.get, None), timeout=600)
for _ in range(2):
    q.put(step)
    next(replies)
q.put(step)
print("mid", sid, flush=True)
next(replies)
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = ServerProcess(log_path=tmp_path_factory.mktemp("lifecycle") / "mha-serve.log")
    try:
        proc.wait_serving()
        yield proc
    finally:
        assert proc.stop() == 0, proc.log()


def spawn(script: str, target: str) -> tuple[subprocess.Popen, str]:
    """Starts a client and returns it with its first line, once it printed one."""
    proc = subprocess.Popen(
        [sys.executable, "-c", script, target], stdout=subprocess.PIPE, text=True
    )
    line = proc.stdout.readline()
    assert line, f"client exited {proc.wait()} before saying where it was"
    return proc, line


def until(predicate, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.05)


def test_clients_killed_mid_request_and_mid_stream_leave_the_server_unaffected(server):
    payload = pb.AttendRequest.FromString(attend_bytes("mha", 1, 16))
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.AttentionServiceStub(channel)
        reference = stub.Attend(payload, timeout=30).output.data
        sessions = []
        for _ in range(KILLS):
            for script in (MID_REQUEST, MID_STREAM):
                client, line = spawn(script, server.target)
                client.send_signal(signal.SIGKILL)
                client.wait()
                client.stdout.close()
                if line.startswith("mid"):
                    sessions.append(line.split()[1])
        assert server.proc.poll() is None  # still running
        health = health_pb2_grpc.HealthStub(channel)
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == (
            health_pb2.HealthCheckResponse.SERVING
        )
        assert stub.Attend(payload, timeout=30).output.data == reference  # answers as before
        # Each killed stream's session is usable once its last step is over: kept (3 steps)
        # or rolled back (2), never stuck busy.
        x = np.ones((1, 1, 512), np.float32)
        step = pb.AttendRequest(input=pb.Tensor(dtype=1, shape=x.shape, data=x.tobytes()))
        kept = []
        for sid in sessions:
            step.session_id = sid

            def answered() -> bool:
                try:
                    stub.Attend(step, timeout=30)
                    return True
                except grpc.RpcError as e:
                    assert e.code() == grpc.StatusCode.ABORTED, e.details()  # still stepping
                    return False

            until(answered, f"session {sid} answers a step")
            info = stub.GetSession(pb.GetSessionRequest(session_id=sid), timeout=10)
            assert info.num_tokens in (2 * 64 + 1, 3 * 64 + 1)
            kept.append(info.num_tokens == 3 * 64 + 1)
            stub.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=10)
    print(
        f"\nkilled {KILLS} clients mid-request and {KILLS} mid-stream; the killed step was "
        f"kept in {sum(kept)} sessions and rolled back in {len(kept) - sum(kept)}"
    )
    until(
        lambda: scrape(server.metrics_port)["mha_serve_requests_in_flight"] == 0,
        "no request in flight",
    )
    samples = scrape(server.metrics_port)
    assert samples['mha_serve_kv_cache_blocks{model="gqa",state="used"}'] == 0
    assert "Traceback" not in server.log()


@dataclass
class Drained:
    """What the clients of a SIGTERM under load saw."""

    before: Outcomes = field(default_factory=Outcomes)  # calls started before the signal
    after: Outcomes = field(default_factory=Outcomes)  # and after it
    statuses: list = field(default_factory=list)  # health, watched
    refused: int = 0  # UNAVAILABLE from the handler: "the server is shutting down"
    wrong: int = 0  # OK answers that differ from the one the server gave before the load
    exit_code: int | None = None
    exit_s: float = 0.0  # from the signal to the exit


async def _load_then_sigterm(proc: ServerProcess, clients: int, refusals: int) -> Drained:
    """Closed-loop load; SIGTERM once 50 calls were answered; each client stops at its
    `refusals`-th UNAVAILABLE."""
    payload = attend_bytes("mha", 1, 64)
    seen = Drained()
    answered, signalled = asyncio.Event(), asyncio.Event()
    async with grpc.aio.insecure_channel(proc.target) as channel:
        attend = channel.unary_unary(ATTEND, response_deserializer=pb.AttendResponse.FromString)
        expected = np.frombuffer((await attend(payload, timeout=WAIT_S)).output.data, np.float32)
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
        seen.statuses.append((await watch.read()).status)

        async def client() -> None:
            unavailable = 0
            while unavailable < refusals:
                out = seen.after if signalled.is_set() else seen.before
                start = time.perf_counter()
                try:
                    reply = await attend(payload, timeout=WAIT_S)
                    out.add(grpc.StatusCode.OK, (time.perf_counter() - start) * 1e3)
                    output = np.frombuffer(reply.output.data, np.float32)
                    # Batched with other calls or not: the same answer (to float32 rounding).
                    if output.shape != expected.shape or not np.allclose(
                        output, expected, rtol=1e-5, atol=1e-6
                    ):
                        seen.wrong += 1
                except grpc.aio.AioRpcError as e:
                    out.add(e.code(), (time.perf_counter() - start) * 1e3, e.details() or "")
                    unavailable += e.code() == grpc.StatusCode.UNAVAILABLE
                    seen.refused += e.details() == SHUTTING_DOWN
                if seen.before.codes["OK"] >= 50:
                    answered.set()

        tasks = [asyncio.create_task(client()) for _ in range(clients)]
        await answered.wait()
        proc.proc.send_signal(signal.SIGTERM)
        signal_at = time.perf_counter()
        signalled.set()
        seen.statuses.append((await watch.read()).status)  # NOT_SERVING, at once
        watch.cancel()  # (an open watch would hold the port's closing for CLOSE_GRACE_S)
        await asyncio.gather(*tasks)
    seen.exit_code = await asyncio.to_thread(proc.proc.wait, WAIT_S)
    seen.exit_s = time.perf_counter() - signal_at
    return seen


@pytest.mark.parametrize(
    ("drain_delay_s", "clients", "refusals"),
    [
        (2, 8, 1),  # clients that stop at their first refusal
        (0, 16, 20),  # clients that retry this server at once, until refused 20 times each
    ],
    ids=["stop-at-refusal", "retry-at-once"],
)
def test_sigterm_under_load_drains_and_exits_zero(tmp_path, drain_delay_s, clients, refusals):
    proc = ServerProcess(
        "--drain-delay-s",
        str(drain_delay_s),
        "--grace-period-s",
        "30",
        log_path=tmp_path / "mha-serve.log",
    )
    try:
        proc.wait_serving()
        seen = asyncio.run(_load_then_sigterm(proc, clients, refusals))
    finally:
        proc.stop()
    before, after = seen.before, seen.after
    print(
        f"\nSIGTERM under load ({clients} clients, --drain-delay-s {drain_delay_s}): before "
        f"the signal {before.summary()}; after {after.summary()}; {seen.refused} refused "
        f"{SHUTTING_DOWN!r}; {seen.wrong} wrong answers; exit code {seen.exit_code} "
        f"{seen.exit_s:.1f} s after the signal"
    )
    assert seen.statuses == [
        health_pb2.HealthCheckResponse.SERVING,
        health_pb2.HealthCheckResponse.NOT_SERVING,
    ]
    # Only answers and refusals, never CANCELLED: a call in its handler when draining began
    # was answered, any later one refused UNAVAILABLE by the handler without running (the
    # port stays open until the calls stop coming). With --drain-delay-s, every call sent
    # before the signal was answered; without, one sent just before it may reach its handler
    # after draining began, and is refused.
    allowed_before = {"OK"} if drain_delay_s else {"OK", "UNAVAILABLE"}
    assert set(before.codes) <= allowed_before, before.summary()
    assert set(after.codes) <= {"OK", "UNAVAILABLE"}, after.summary()
    assert before.codes["UNAVAILABLE"] + after.codes["UNAVAILABLE"] == clients * refusals
    assert seen.refused >= 1, after.details["UNAVAILABLE"]
    assert seen.wrong == 0  # every OK answer is the right one
    assert seen.exit_code == 0, proc.log()
    assert "stopped" in proc.log()


def _children(pid: int) -> list[int]:
    """The live child processes of pid (from /proc: no psutil)."""
    from pathlib import Path

    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return found


@pytest.mark.slow
def test_sigterm_while_the_frontends_start_exits_zero(tmp_path):
    """SIGTERM at the moment the frontend workers exist but have not started (the engine
    loading, the frontends importing): the engine passes it on, a frontend gets it once its
    handlers are in place (it starts with the signals blocked), and the server exits 0.
    Each frontend is also signalled directly at once, the earliest a signal can come."""
    proc = ServerProcess("--frontend-workers", "2", log_path=tmp_path / "server.log")
    deadline = time.monotonic() + 60
    children: list[int] = []
    while len(children) < 2 and time.monotonic() < deadline and proc.proc.poll() is None:
        children = _children(proc.proc.pid)
    assert len(children) >= 2, proc.log()
    for child in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGTERM)
    proc.proc.send_signal(signal.SIGTERM)
    code = proc.proc.wait(60)
    proc.stop()
    log = proc.log()
    assert code == 0, log
    assert "exited with -15" not in log and "stopping:" not in log, log
    assert proc.left_behind == [], log  # its run and metrics directories removed


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_second_stop_signal_ends_the_drain_at_once(tmp_path, workers):
    """SIGTERM starts the drain (here a 600 s --drain-delay-s: health NOT_SERVING, calls still
    answered); a second SIGTERM, sent once the drain has begun, stops the server at once and
    it exits 0. Without the second signal the process would run out the delay, far past this
    test's wait. With frontend workers the engine passes the second on to them."""
    proc = ServerProcess(
        "--drain-delay-s", "600", "--frontend-workers", workers, log_path=tmp_path / "server.log"
    )
    try:
        proc.wait_serving()
        proc.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + WAIT_S
        while "draining: NOT_SERVING for 600.0 s" not in proc.log():  # the gate: draining
            assert time.monotonic() < deadline and proc.proc.poll() is None, proc.log()
            time.sleep(0.05)
        with grpc.insecure_channel(proc.target) as channel:  # still answering meanwhile
            stub = health_pb2_grpc.HealthStub(channel)
            status = stub.Check(health_pb2.HealthCheckRequest(), timeout=10).status
            assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        proc.proc.send_signal(signal.SIGTERM)
        code = proc.proc.wait(WAIT_S)
    finally:
        proc.stop()
    log = proc.log()
    assert code == 0, log
    assert "second stop signal" in log, log


@pytest.mark.parametrize("workers", ["1", "2"])
def test_ctrl_c_to_the_process_group_drains_a_call_in_flight(tmp_path, workers):
    """A terminal's Ctrl-C sends SIGINT to every process of the group: with frontend workers,
    to the engine process and to each frontend. It drains once, as SIGTERM does: a call held
    in flight (by a gate in the engine's compute thread) is answered OK, and the server exits
    0. (The engine told its frontends to drain with SIGTERM, which a frontend that had the
    terminal's SIGINT took for a second stop signal: it cancelled its calls in flight.)"""
    gate = tmp_path / "gate"
    gate.mkdir()
    proc = ServerProcess(
        "--frontend-workers",
        workers,
        "--drain-delay-s",
        "0",
        "--grace-period-s",
        "120",
        "--inline-lone-requests",
        "false",
        env={GATE_ENV: str(gate)},
        log_path=tmp_path / "server.log",
        module="tests.reliability.gated_serve",
        process_group=True,
    )
    try:
        proc.wait_serving()
        with grpc.insecure_channel(proc.target) as channel:
            x = np.ones((1, GATE_LEN, 512), np.float32)
            request = pb.AttendRequest(
                model="mha", input=pb.Tensor(dtype=1, shape=x.shape, data=x.tobytes())
            )
            call = pb_grpc.AttentionServiceStub(channel).Attend.future(request, timeout=WAIT_S)
            until(lambda: (gate / "entered").exists(), "the call is held in the engine")
            os.killpg(proc.proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C

            def every_signal_handled() -> bool:
                log = proc.log()
                if workers == "1":
                    return "draining: new calls refused" in log
                # each frontend has had the engine's word: to drain, or (before) to hurry
                told = log.count("asks this frontend to drain") + log.count("stopping now")
                return told >= int(workers)

            until(every_signal_handled, "every frontend handled the stop signals")
            (gate / "open").touch()
            reply = call.result(timeout=WAIT_S)
        assert list(reply.output.shape) == [1, GATE_LEN, 512]
        code = proc.proc.wait(WAIT_S)
    finally:
        (gate / "open").touch()
        proc.stop()
    log = proc.log()
    assert code == 0, log
    assert "stopping now" not in log and "cancelling" not in log, log


def _caught(pid: int) -> int:
    """The signals a process has handlers for (SigCgt in /proc/PID/status), as a bit mask."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return int(line.split()[1], 16)
    raise AssertionError(f"no SigCgt for pid {pid}")


@pytest.mark.parametrize("workers", ["1", "2"])
def test_sigterm_while_torch_imports_exits_zero(tmp_path, workers):
    """SIGTERM while `mha-serve` is still importing torch (its first second or so, before
    its event loop exists) is handled already (early_stop.py): the process stops with exit
    0, nothing having served, instead of being killed (-15). The gate: libtorch mapped in
    the process, which torch's import does early on."""
    proc = ServerProcess("--frontend-workers", workers, log_path=tmp_path / "server.log")
    pid = proc.proc.pid
    try:
        deadline = time.monotonic() + WAIT_S
        while "libtorch" not in Path(f"/proc/{pid}/maps").read_text():
            assert time.monotonic() < deadline and proc.proc.poll() is None, proc.log()
        assert _caught(pid) & (1 << (signal.SIGTERM - 1)), "SIGTERM not handled yet"
        proc.proc.send_signal(signal.SIGTERM)
        code = proc.proc.wait(WAIT_S)
    finally:
        proc.stop()
    log = proc.log()
    assert code == 0, log
    assert "Traceback" not in log and "SERVING" not in log, log
    # (with frontend workers its metrics directory, made before torch, was left in $TMPDIR)
    assert proc.left_behind == [], log


@pytest.mark.parametrize(
    ("workers", "sig"),
    [("1", signal.SIGTERM), ("2", signal.SIGTERM), ("2", signal.SIGINT)],
    ids=["one-process-sigterm", "workers-sigterm", "workers-sigint"],
)
def test_a_stop_signal_while_the_server_exits_leaves_exit_zero(tmp_path, workers, sig):
    """A stop signal that comes once the server has stopped, while the process still ends,
    is ignored: exit 0 as from the graceful stop. Sent at two moments, each held by a gate
    (tests/reliability/gated_exit.py): after the event loop has ended (its close gave SIGTERM
    its default action back, -15, and SIGINT a KeyboardInterrupt; the frontends already
    ignored theirs), and after mha-serve's main() has returned (its early-stop handlers
    were put back as they were before it: the default action again)."""
    gate = tmp_path / "gate"
    gate.mkdir()
    proc = ServerProcess(
        "--frontend-workers",
        workers,
        env={EXIT_GATE_ENV: str(gate)},
        log_path=tmp_path / "server.log",
        module="tests.reliability.gated_exit",
    )
    try:
        proc.wait_serving()
        proc.proc.send_signal(sig)
        for point in POINTS:
            until(lambda p=point: (gate / p).exists() or proc.proc.poll() is not None, point)
            assert (gate / point).exists(), proc.log()  # held there, still running
            proc.proc.send_signal(sig)  # (pending, or ignored, once send_signal returns)
            (gate / f"open-{point}").touch()
        code = proc.proc.wait(WAIT_S)
    finally:
        for point in POINTS:
            (gate / f"open-{point}").touch()
        proc.stop()
    log = proc.log()
    assert code == 0, log
    assert "Traceback" not in log and "stopped" in log, log
    assert proc.left_behind == [], log
