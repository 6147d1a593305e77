"""Durable sessions over a real server (issue 24): a full cache spills and brings sessions
back while several clients step them, each step equal to the full causal recompute; the
full spill tier expires its oldest, saying so; SIGTERM writes every session out and a new
server on the directory answers their next steps bit for bit, a stream cut by the signal
included; /metrics counts it all."""

from __future__ import annotations

import random
import signal
import threading
import urllib.request

import grpc
import numpy as np
import pytest

from mha_client.errors import MhaServeError
from mha_client.sdk import Client
from tests.helpers import ServerProcess

pytestmark = pytest.mark.slow

ATOL = 1e-5
E = 64
BLOCK = 16
BLOCKS = 8  # the cache of the small model holds 8 blocks of 16 tokens


def rows(n: int, seed: int, embed: int = E) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, embed), dtype=np.float32)


def metric_sum(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


@pytest.fixture
def small_server(tmp_path):
    bytes_per_block = 2 * 2 * 16 * BLOCK * 4  # K and V, 2 KV heads x 16 dims, float32
    config = tmp_path / "small.toml"
    config.write_text(
        f'[[models]]\nname = "m"\nembed_dim = {E}\nnum_heads = 4\nnum_kv_heads = 2\n'
        f"seed = 4\nkv_cache_bytes = {BLOCKS * bytes_per_block}\nkv_block_size = {BLOCK}\n"
    )
    proc = ServerProcess(
        "--config",
        str(config),
        "--session-spill-dir",
        str(tmp_path / "spill"),
        "--session-spill-bytes",
        str(120_000),  # about fifteen sessions of 40 tokens
        log_path=tmp_path / "server.log",
    )
    try:
        proc.wait_serving()
        yield proc
    finally:
        assert proc.stop() == 0, proc.log()


def test_three_times_what_the_cache_holds_from_several_clients(small_server):
    """12 sessions of up to 40 tokens (3 blocks) over a cache of 8 blocks, stepped in random
    order from 4 clients: nothing refused, every step equal to the full causal recompute,
    sessions spilled and brought back on the way (the replies' timing says so)."""
    target = small_server.target
    histories: dict[str, np.ndarray] = {}
    restored, errors = [], []

    def client(index: int) -> None:
        rng = random.Random(index)
        with Client(target) as c:
            mine = [c.create_session("m") for _ in range(3)]
            for s in mine:
                histories[s.id] = np.zeros((0, E), np.float32)
            for i in range(30):
                s = rng.choice(mine)
                n = rng.randint(1, 4)
                if histories[s.id].shape[0] + n > 40:
                    continue
                x = rows(n, seed=1000 * index + i)
                try:
                    got = s.step(x)
                except MhaServeError as e:  # (refused: not kept, so not in its history)
                    errors.append(e)
                    continue
                histories[s.id] = np.concatenate([histories[s.id], x])
                restored.append(got.timing.restore_ms > 0)
                whole = c.attend("m", histories[s.id], causal=True).output
                diff = np.abs(got.output - whole[-n:]).max()
                if not diff < ATOL:
                    errors.append(AssertionError(f"{s.id} step {i}: max diff {diff:.3e}"))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[:3]
    assert sum(restored) > 5, "no session came back from the spill tier"
    port = small_server.metrics_port
    assert metric_sum(port, "mha_serve_sessions_spilled_total") > 0
    assert metric_sum(port, "mha_serve_session_restores_total") == sum(restored)


def test_past_the_spill_budget_the_oldest_expire_saying_so(small_server):
    with Client(small_server.target) as c:
        sessions = [c.create_session("m") for _ in range(24)]
        for i, s in enumerate(sessions):  # 40 tokens each: 3 blocks, 2 fit in the cache
            s.step(rows(40, seed=i))  # never refused: the tier makes room
        with pytest.raises(MhaServeError) as gone:
            sessions[0].refresh()
        assert gone.value.code == grpc.StatusCode.NOT_FOUND
        assert "expired from the full spill tier" in gone.value.details
        assert sessions[-1].refresh().num_tokens == 40
    assert (
        metric_sum(small_server.metrics_port, 'mha_serve_sessions_lost_total{reason="spill_full"}')
        > 0
    )


def test_sessions_survive_sigterm_and_a_restart_bit_for_bit(tmp_path):
    """Sessions of the three built-in models, some forked, some truncated, one in a stream
    at the signal: after SIGTERM and a new server on the same directory, each one's next
    step equals, bit for bit, what a fork of it answered for the same token before."""
    spill = ["--session-spill-dir", str(tmp_path / "spill"), "--session-spill-bytes", str(1 << 28)]
    first = ServerProcess(*spill, log_path=tmp_path / "first.log")
    first.wait_serving()
    token = rows(1, seed=99, embed=512)
    sessions, expected = [], {}
    with Client(first.target) as c:
        for m, model in enumerate(("mha", "gqa", "mqa")):
            s = c.create_session(model)
            s.step(rows(20, seed=m, embed=512))
            child = s.fork()
            child.step(rows(3, seed=10 + m, embed=512))
            cut = c.create_session(model)
            cut.step(rows(30, seed=20 + m, embed=512))
            cut.truncate(11)
            sessions += [s, child, cut]
        streamed = c.create_session("gqa")
        stream = streamed.stream(timeout=120).__enter__()
        for t in range(4):
            stream.step(rows(1, seed=40 + t, embed=512))
        sessions.append(streamed)
        for s in sessions:  # the reference: a fork of each answers the next token
            probe = s.fork()
            expected[s.id] = probe.step(token).output
            probe.close()
        first.proc.send_signal(signal.SIGTERM)  # the stream still open
        assert first.proc.wait(60) == 0, first.log()
        with pytest.raises(MhaServeError):  # the stream ends: the server is gone
            stream.step(rows(1, seed=50, embed=512))
    first.stop()
    assert f"wrote {len(sessions)} session(s) to the spill directory" in first.log()

    second = ServerProcess(*spill, log_path=tmp_path / "second.log")
    try:
        second.wait_serving()
        with Client(second.target) as c:
            for s in sessions:
                got = c.session(s.id).step(token)
                assert np.array_equal(got.output, expected[s.id]), s.id
                assert got.timing.restore_ms > 0
        assert metric_sum(second.metrics_port, "mha_serve_sessions_adopted_total") == len(sessions)
    finally:
        assert second.stop() == 0, second.log()


def test_a_triton_sequence_goes_on_after_a_restart(tmp_path):
    """A Triton sequence (Open Inference Protocol) started on one server steps on after
    SIGTERM and a new server on the same directory, without a new START: the link from its
    sequence id to its session is written with the session (it lived in memory only, and
    the sequence's next request was refused with the START-flag message). Its next step
    equals, bit for bit, what a fork of its session answered for the same token before."""
    from mha_client.api.inference import grpc_service_pb2_grpc as ip_grpc
    from tests.transport.test_inference import infer_request, output

    spill = ["--session-spill-dir", str(tmp_path / "spill"), "--session-spill-bytes", str(1 << 26)]
    first = ServerProcess(*spill, log_path=tmp_path / "first.log")
    first.wait_serving()
    token = rows(1, seed=7, embed=512)[None]
    sequences = {42: None, "chat-7": None}  # id -> (session id, expected next output)
    try:
        with grpc.insecure_channel(first.target) as channel:
            oip = ip_grpc.GRPCInferenceServiceStub(channel)
            for n, seq_id in enumerate(sequences):
                for t in range(3):
                    x = rows(4 if t == 0 else 1, seed=10 * n + t, embed=512)[None]
                    reply = oip.ModelInfer(
                        infer_request(x, model="gqa", sequence_id=seq_id, sequence_start=t == 0)
                    )
                session_id = reply.parameters["session_id"].string_param
                with Client(first.target) as c:
                    probe = c.session(session_id).fork()
                    sequences[seq_id] = (session_id, probe.step(token[0]).output)
                    probe.close()
        first.proc.send_signal(signal.SIGTERM)
        assert first.proc.wait(60) == 0, first.log()
    finally:
        first.stop()

    second = ServerProcess(*spill, log_path=tmp_path / "second.log")
    try:
        second.wait_serving()
        with grpc.insecure_channel(second.target) as channel:
            oip = ip_grpc.GRPCInferenceServiceStub(channel)
            for seq_id, (session_id, expected) in sequences.items():
                reply = oip.ModelInfer(
                    infer_request(token, model="gqa", sequence_id=seq_id, sequence_end=True)
                )
                assert reply.parameters["session_id"].string_param == session_id
                assert np.array_equal(output(reply, "OUTPUT")[0], expected), seq_id
            # ended: the next request of either is refused, as any sequence's after its end
            with pytest.raises(grpc.RpcError) as err:
                oip.ModelInfer(infer_request(token, model="gqa", sequence_id=42))
            assert "START flag" in err.value.details()
    finally:
        assert second.stop() == 0, second.log()
