"""`mha-serve --frontend-workers 2` (transport/workers.py): two gRPC frontend processes on
one port before one engine process. The SDK's and the raw stubs' session, stream, error and
attend tests run here again, unchanged, against it; then what only this mode has: channels
on different frontends stepping one session, /metrics summing every process, a killed
frontend started again with no session lost, and exit code 0 on SIGTERM (serving_process)."""

from __future__ import annotations

import os
import re
import signal
import time
import urllib.request

import grpc
import numpy as np
import pytest

from mha_client.api import attention_pb2 as pb
from mha_client.api import attention_pb2_grpc as pb_grpc
from mha_client.api.inference import grpc_service_pb2 as ip
from mha_client.api.inference import grpc_service_pb2_grpc as ip_grpc
from tests.e2e import test_client as _client_tests
from tests.e2e import test_client_sessions as _sdk_session_tests
from tests.e2e import test_errors as _error_tests
from tests.e2e import test_sessions as _session_tests
from tests.e2e.conftest import attention_stub
from tests.helpers import serving_process

pytestmark = pytest.mark.slow

WORKERS = 2
MAX_CHANNELS = 64  # opened until both frontends hold a connection (the kernel picks)
RESTART_TIMEOUT_S = 120.0
ATOL = 1e-5

# The same tests, collected here: their `server` and `stub` are this module's fixtures.
for _module in (_client_tests, _sdk_session_tests, _error_tests, _session_tests):
    for _name, _obj in vars(_module).items():
        if (
            _name.startswith("test_")
            or hasattr(_obj, "_pytestfixturefunction")
            or type(_obj).__name__ == "FixtureFunctionDefinition"
        ):
            globals()[_name] = _obj


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("workers")
    with serving_process(log_dir, "--frontend-workers", str(WORKERS)) as proc:
        yield proc


@pytest.fixture(scope="module")
def stub(server):
    with attention_stub(server.target) as s:
        yield s


# --- helpers -------------------------------------------------------------------------------


def frontend_pids(server) -> dict[int, int]:
    """index -> pid of each frontend, the latest start of each (from the engine's log)."""
    found = re.findall(r"frontend worker (\d+) \(pid (\d+)\) listening", server.log())
    return {int(i): int(p) for i, p in found}


def _tcp_rows():
    """(local port, remote port, inode) of every established TCP connection (/proc, Linux)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "01":
                    local, remote = (int(a.rsplit(":", 1)[1], 16) for a in fields[1:3])
                    yield local, remote, int(fields[9])


def _sockets(pid: int) -> set[int]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(int(link[8:-1]))
    return inodes


def my_client_ports(port: int) -> set[int]:
    """Local ports of this process's connections to `port`."""
    mine = _sockets(os.getpid())
    return {local for local, remote, inode in _tcp_rows() if remote == port and inode in mine}


def frontend_of(client_port: int, port: int, pids) -> int | None:
    """The pid of the frontend holding the server end of the connection from client_port."""
    owner = {inode: pid for pid in pids for inode in _sockets(pid)}
    for local, remote, inode in _tcp_rows():
        if local == port and remote == client_port and inode in owner:
            return owner[inode]
    return None


def own_channel(target: str) -> grpc.Channel:
    """A channel with a connection of its own (gRPC shares them across channels otherwise)."""
    return grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])


def tensor(x: np.ndarray) -> pb.Tensor:
    return pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=list(x.shape), data=x.tobytes())


def array(t: pb.Tensor) -> np.ndarray:
    return np.frombuffer(t.data, np.float32).reshape(list(t.shape))


def channels_on_every_frontend(server) -> list[grpc.Channel]:
    """Channels, each with its own connection, until every frontend holds one of them."""
    pids = list(frontend_pids(server).values())
    assert len(pids) == WORKERS, server.log()
    channels, reached = [], set()
    for _ in range(MAX_CHANNELS):
        before = my_client_ports(server.port)
        channel = own_channel(server.target)
        pb_grpc.AttentionServiceStub(channel).ListModels(pb.ListModelsRequest(), timeout=10)
        channels.append(channel)
        for client_port in my_client_ports(server.port) - before:
            reached.add(frontend_of(client_port, server.port, pids))
        if reached >= set(pids):
            return channels
    for channel in channels:
        channel.close()
    pytest.fail(f"{MAX_CHANNELS} connections reached {reached}, not each of {pids}")


def metric(server, name: str, **labels: str) -> float:
    """The sum of a metric's samples whose labels include `labels`, from /metrics."""
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    total = 0.0
    for line in text.splitlines():
        match = re.fullmatch(rf"{name}(\{{.*\}})? (\S+)", line)
        if match and all(f'{k}="{v}"' in (match.group(1) or "") for k, v in labels.items()):
            total += float(match.group(2))
    return total


# --- what only frontend workers have ---------------------------------------------------------


def test_one_session_stepped_through_every_frontend_equals_one_causal_attend(server):
    channels = channels_on_every_frontend(server)
    try:
        stubs = [pb_grpc.AttentionServiceStub(c) for c in channels]
        x = np.random.default_rng(11).standard_normal((3 * len(stubs) + 4, 512), np.float32)
        ref = array(
            stubs[0]
            .Attend(pb.AttendRequest(model="gqa", input=tensor(x), causal=True), timeout=30)
            .output
        )
        sid = stubs[-1].CreateSession(pb.CreateSessionRequest(model="gqa"), timeout=10).session_id
        outs, t = [], 0
        for i, s in enumerate(stubs):  # unary steps, each channel in turn: both frontends
            size = 1 + i % 3
            reply = s.Attend(pb.AttendRequest(session_id=sid, input=tensor(x[t : t + size])))
            outs.append(array(reply.output))
            t += size
        stream = iter(
            stubs[0].StreamSession(
                iter(
                    [
                        pb.AttendRequest(session_id=sid, input=tensor(x[i : i + 1]))
                        for i in range(t, len(x))
                    ]
                ),
                timeout=30,
            )
        )
        outs += [array(r.output) for r in stream]
        np.testing.assert_allclose(np.concatenate(outs), ref, atol=ATOL)
        for s in stubs:  # every frontend sees the same session
            info = s.GetSession(pb.GetSessionRequest(session_id=sid), timeout=10)
            assert info.num_tokens == len(x) and info.model == "gqa"
        stubs[1].CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=10)
        with pytest.raises(grpc.RpcError) as err:
            stubs[0].GetSession(pb.GetSessionRequest(session_id=sid), timeout=10)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        for channel in channels:
            channel.close()


def test_metrics_sum_every_process(server):
    channels = channels_on_every_frontend(server)
    try:
        before = metric(server, "mha_serve_requests_total", method="Attend", model="mqa")
        tokens_before = metric(server, "mha_serve_tokens_total", model="mqa")
        x = np.ones((5, 512), np.float32)
        sent = 0
        for channel in channels:
            for _ in range(3):
                pb_grpc.AttentionServiceStub(channel).Attend(
                    pb.AttendRequest(model="mqa", input=tensor(x)), timeout=30
                )
                sent += 1
        after = metric(server, "mha_serve_requests_total", method="Attend", model="mqa")
        assert after - before == sent  # counted in both frontends, summed
        assert metric(server, "mha_serve_tokens_total", model="mqa") - tokens_before == 5 * sent
        open_before = metric(server, "mha_serve_sessions", model="mha")  # earlier tests' too
        sid = (
            pb_grpc.AttentionServiceStub(channels[0])
            .CreateSession(pb.CreateSessionRequest(model="mha"), timeout=10)
            .session_id
        )
        # the engine's gauge, read live
        assert metric(server, "mha_serve_sessions", model="mha") == open_before + 1
        pb_grpc.AttentionServiceStub(channels[0]).CloseSession(
            pb.CloseSessionRequest(session_id=sid), timeout=10
        )
        assert metric(server, "mha_serve_sessions", model="mha") == open_before
        assert metric(server, "mha_serve_ready") == 1
        assert metric(server, "mha_serve_requests_in_flight") == 0
        assert metric(server, "mha_serve_batch_size_count", model="mqa") >= 1  # engine's
        assert metric(server, "process_cpu_seconds_total") > 0
    finally:
        for channel in channels:
            channel.close()


def test_a_killed_frontend_is_started_again_and_no_session_is_lost(server):
    stub = pb_grpc.AttentionServiceStub(own_channel(server.target))
    x = np.random.default_rng(12).standard_normal((9, 512), np.float32)
    sid = stub.CreateSession(pb.CreateSessionRequest(model="mha"), timeout=10).session_id
    first = array(stub.Attend(pb.AttendRequest(session_id=sid, input=tensor(x[:5]))).output)
    before = frontend_pids(server)
    cpu_before = metric(server, "process_cpu_seconds_total")
    os.kill(before[0], signal.SIGKILL)
    deadline = time.monotonic() + RESTART_TIMEOUT_S
    while frontend_pids(server)[0] == before[0]:  # bounded: the restart is logged
        assert time.monotonic() < deadline, f"frontend 0 not started again:\n{server.log()}"
        time.sleep(0.2)
    assert f"frontend worker 0 (pid {before[0]}) exited" in server.log()
    # a counter: the dead frontend's CPU seconds stay in the sum (metrics/exposition.py)
    assert metric(server, "process_cpu_seconds_total") >= cpu_before
    fresh = pb_grpc.AttentionServiceStub(own_channel(server.target))
    rest = array(fresh.Attend(pb.AttendRequest(session_id=sid, input=tensor(x[5:]))).output)
    ref = array(fresh.Attend(pb.AttendRequest(model="mha", input=tensor(x), causal=True)).output)
    np.testing.assert_allclose(np.concatenate([first, rest]), ref, atol=ATOL)
    fresh.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=10)


def test_a_triton_sequence_steps_through_every_frontend(server):
    """A sequence lives beside the engine: started on one frontend, stepped and ended on the
    others, it equals the same steps through mha.v1."""
    channels = channels_on_every_frontend(server)
    try:
        oips = [ip_grpc.GRPCInferenceServiceStub(c) for c in channels]
        v1 = pb_grpc.AttentionServiceStub(channels[0])
        steps = [
            np.random.default_rng(n).standard_normal((1, n, 512), np.float32) for n in (4, 1, 2)
        ]
        steps += [steps[1]] * (len(oips) - 1)
        sid = v1.CreateSession(pb.CreateSessionRequest(model="mqa"), timeout=10).session_id
        want = [
            array(v1.Attend(pb.AttendRequest(session_id=sid, input=tensor(x))).output)
            for x in steps
        ]
        v1.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=10)
        got = []
        for i, x in enumerate(steps):
            request = ip.ModelInferRequest(
                model_name="mqa",
                inputs=[
                    ip.ModelInferRequest.InferInputTensor(
                        name="INPUT", datatype="FP32", shape=x.shape
                    )
                ],
                raw_input_contents=[x.tobytes()],
            )
            request.parameters["sequence_id"].string_param = "chat-1"
            request.parameters["sequence_start"].bool_param = i == 0
            request.parameters["sequence_end"].bool_param = i == len(steps) - 1
            reply = oips[(len(oips) - 1 - i) % len(oips)].ModelInfer(request, timeout=30)
            shape = list(reply.outputs[0].shape)
            got.append(np.frombuffer(reply.raw_output_contents[0], np.float32).reshape(shape))
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g.reshape(w.shape), w, atol=1e-6)
        with pytest.raises(grpc.RpcError) as err:  # ended, on every frontend
            oips[0].ModelInfer(request, timeout=30)
        assert "must specify the START flag" in err.value.details()
    finally:
        for channel in channels:
            channel.close()


def test_head_analysis_crosses_to_the_engine_and_back(stub):
    """AnalyzeHeads runs in the engine process; its analysis (tensors included) comes back
    whole: the same figures as the engine computes in this process."""
    import torch

    from mha_serve.config import default_models
    from mha_serve.engine import Array, AttendRequest, Engine
    from mha_serve.engine.heads import analyze

    x = np.random.default_rng(13).standard_normal((1, 12, 512), np.float32)
    reply = stub.AnalyzeHeads(
        pb.AnalyzeHeadsRequest(
            attend=pb.AttendRequest(model="gqa", input=tensor(x)), include_weights=True
        ),
        timeout=60,
    )
    engine = Engine(
        default_models(), device=torch.device("cpu"), dtype=torch.float32, max_response_bytes=2**28
    )
    want = analyze(engine, AttendRequest("gqa", Array(x, "float32")), include_weights=True)
    assert reply.model == "gqa" and [h.head for h in reply.heads] == list(range(8))
    np.testing.assert_allclose([h.mean_entropy for h in reply.heads], want.mean_entropy, atol=1e-5)
    np.testing.assert_allclose([h.importance for h in reply.heads], want.importance, atol=1e-5)
    np.testing.assert_allclose(array(reply.attention_weights), want.weights.data, atol=1e-6)


def _maps(pid: int) -> str:
    with open(f"/proc/{pid}/maps") as f:
        return f.read()


def test_frontends_load_no_torch_and_the_engine_does(server):
    """A frontend runs gRPC, protobuf and the codec over Arrays: libtorch is never mapped in
    it (each held ~240 MiB it never used before); the engine process computes with it."""
    pids = frontend_pids(server)
    assert len(pids) == WORKERS
    for pid in pids.values():
        assert "libtorch" not in _maps(pid), f"frontend pid {pid} mapped libtorch"
    assert "libtorch" in _maps(server.proc.pid)
