"""Client, AsyncClient and the CLI over a real loopback gRPC server with a numpy echo servicer.

The servicer returns the input as output and uniform weights over each sequence's real keys,
so every number the client shows can be checked exactly, without torch or mha_serve.
"""

from __future__ import annotations

import asyncio
import json
import math
import warnings
from concurrent import futures

import grpc
import numpy as np
import pytest

from mha_client.api import attention_pb2 as pb
from mha_client.api import attention_pb2_grpc as pb_grpc
from mha_client.cli import main
from mha_client.errors import ClosedError, InvalidArgumentError, MhaServeError, ReplyError
from mha_client.sdk import AsyncClient, Client, KVCacheInfo, ModelInfo, SessionInfo
from mha_client.tensors import dtype_name, from_proto, to_proto

try:
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
except ImportError:  # optional for the client; only the health tests need it
    health = None

needs_health = pytest.mark.skipif(health is None, reason="grpcio-health-checking not installed")

MODEL = pb.ModelInfo(
    name="echo",
    variant=pb.VARIANT_GQA,
    embed_dim=8,
    num_heads=4,
    num_kv_heads=2,
    head_dim=2,
    bias=True,
    causal_default=True,
    dtype=pb.DTYPE_FLOAT32,
    device="cpu",
    limits=pb.ModelLimits(
        max_seq_len=64,
        max_batch_size=4,
        max_weights_bytes=2**20,
        max_request_bytes=2**22,
        max_response_bytes=2**22,
    ),
    num_parameters=288,
    kv_cache=pb.KVCacheInfo(
        budget_bytes=2**20,
        block_size=16,
        bytes_per_token=16,  # 2 x 2 KV heads x 2 dims x 2 bytes (bfloat16)
        num_blocks=4096,
        num_blocks_used=3,
        num_sessions=1,
        evict_idle_sessions=True,
        dtype=pb.DTYPE_BFLOAT16,
    ),
)


class EchoServicer(pb_grpc.AttentionServiceServicer):
    """output = input; weights uniform over real keys; remembers every Attend request."""

    def __init__(self) -> None:
        self.requests: list[pb.AttendRequest] = []

    def ListModels(self, request, context):
        return pb.ListModelsResponse(models=[MODEL])

    def GetModelInfo(self, request, context):
        if request.name != MODEL.name:
            context.abort(grpc.StatusCode.NOT_FOUND, f"model {request.name!r} is not hosted")
        return MODEL

    def Attend(self, request, context):
        self.requests.append(request)
        if request.model == "garbled":  # a reply whose tensor does not match its own shape
            bad = pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[2, 8], data=b"\0" * 12)
            return pb.AttendResponse(model="garbled", output=bad)
        if request.model != MODEL.name:
            context.abort(grpc.StatusCode.NOT_FOUND, f"model {request.model!r} is not hosted")
        x = from_proto(request.input)
        if x.shape[-1] != MODEL.embed_dim:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"input embed_dim {x.shape[-1]} does not match model embed_dim {MODEL.embed_dim}",
            )
        x3 = x if x.ndim == 3 else x[None]  # (B, L, E)
        batch, seq_len, _ = x3.shape
        lengths = list(request.lengths) or [seq_len] * batch
        out_dtype = request.output_dtype or request.input.dtype
        resp = pb.AttendResponse(
            model=MODEL.name,
            output=to_proto(x, dtype_name(out_dtype)),
            timing=pb.Timing(queue_ms=0.25, compute_ms=1.5, total_ms=2.0, batch_size=batch),
        )
        if request.weights.enabled:
            heads = list(request.weights.heads) or list(range(MODEL.num_heads))
            start = request.weights.query_start
            end = request.weights.query_end or seq_len
            w = np.zeros((batch, len(heads), end - start, seq_len), dtype=np.float32)
            for b, n in enumerate(lengths):
                w[b, :, :, :n] = 1.0 / n
            wire = dtype_name(request.weights.dtype) if request.weights.dtype else "float32"
            resp.attention_weights.CopyFrom(to_proto(w, wire))
            resp.weight_heads.extend(heads)
            resp.weight_query_start = start
        return resp

    def StreamSession(self, request_iterator, context):
        for _ in request_iterator:  # every step's reply garbled, as Attend's for "garbled"
            yield self.Attend(pb.AttendRequest(model="garbled"), context)


@pytest.fixture(scope="module")
def fake():
    servicer = EchoServicer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_AttentionServiceServicer_to_server(servicer, server)
    health_servicer = None
    if health is not None:
        health_servicer = health.HealthServicer()
        health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", servicer, health_servicer
    finally:
        server.stop(grace=None)


@pytest.fixture
def target(fake):
    return fake[0]


@pytest.fixture
def servicer(fake):
    return fake[1]


def _x(*shape: int) -> np.ndarray:
    return np.random.default_rng(7).standard_normal(shape).astype(np.float32)


# ----- Client


def test_list_models_and_model_info(target):
    with Client(target) as c:
        (info,) = c.list_models()
        assert c.model_info("echo") == info
    assert info == ModelInfo(
        name="echo",
        variant="gqa",
        embed_dim=8,
        num_heads=4,
        num_kv_heads=2,
        head_dim=2,
        bias=True,
        causal_default=True,
        dtype="float32",
        device="cpu",
        max_seq_len=64,
        max_batch_size=4,
        max_weights_bytes=2**20,
        max_request_bytes=2**22,
        max_response_bytes=2**22,
        num_parameters=288,
        kv_cache=KVCacheInfo(
            budget_bytes=2**20,
            block_size=16,
            bytes_per_token=16,
            num_blocks=4096,
            num_blocks_used=3,
            num_sessions=1,
            evict_idle_sessions=True,
            dtype="bfloat16",
        ),
    )
    bare = pb.ModelInfo()
    bare.CopyFrom(MODEL)
    bare.ClearField("kv_cache")  # a model without sessions
    assert ModelInfo.from_proto(bare).kv_cache is None


def test_not_found_becomes_mha_serve_error(target):
    with Client(target) as c, pytest.raises(MhaServeError) as err:
        c.model_info("nope")
    assert err.value.code == grpc.StatusCode.NOT_FOUND
    assert err.value.details == "model 'nope' is not hosted"
    assert str(err.value) == "NOT_FOUND: model 'nope' is not hosted"
    assert err.value.target == target


def test_invalid_argument_becomes_mha_serve_error(target):
    with Client(target) as c, pytest.raises(MhaServeError) as err:
        c.attend("echo", _x(2, 5, 3))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert str(err.value).startswith("INVALID_ARGUMENT: input embed_dim 3")


def test_attend_two_d_keeps_rank(target, servicer):
    x = _x(5, 8)
    with Client(target) as c:
        r = c.attend("echo", x, weights=True)
    np.testing.assert_array_equal(r.output, x)
    assert r.output.dtype == np.float32
    assert r.weights.shape == (4, 5, 5)  # (h, R, S): the batch axis of one dropped
    np.testing.assert_allclose(r.weights, 0.2)
    assert r.weight_heads == [0, 1, 2, 3] and r.weight_query_start == 0
    assert r.model == "echo"
    assert (r.timing.queue_ms, r.timing.compute_ms, r.timing.total_ms) == (0.25, 1.5, 2.0)
    assert r.timing.batch_size == 1 and r.timing.round_trip_ms > 0
    assert not servicer.requests[-1].HasField("causal")


def test_attend_request_carries_every_option(target, servicer):
    x = _x(2, 6, 8)
    with Client(target) as c:
        r = c.attend(
            "echo",
            x,
            lengths=[6, 3],
            causal=False,
            weights=True,
            heads=[2, 0],
            query_range=(1, None),
            weights_dtype="float16",
            head_mask=[1, 0, 1, 1],
            output_dtype="float16",
        )
    req = servicer.requests[-1]
    assert list(req.lengths) == [6, 3] and req.HasField("causal") and not req.causal
    assert list(req.weights.heads) == [2, 0]
    assert (req.weights.query_start, req.weights.query_end) == (1, 0)
    assert req.weights.dtype == pb.DTYPE_FLOAT16 and req.output_dtype == pb.DTYPE_FLOAT16
    assert list(req.head_mask) == [1, 0, 1, 1]
    assert r.output.dtype == np.float16
    np.testing.assert_array_equal(r.output, x.astype(np.float16))
    assert r.weights.shape == (2, 2, 5, 6) and r.weights.dtype == np.float16
    assert r.weight_heads == [2, 0] and r.weight_query_start == 1


def test_bfloat16_input_goes_out_as_bfloat16(target, servicer):
    x = _x(3, 8)
    with Client(target) as c:
        r = c.attend("echo", x, input_dtype="bfloat16")
    assert servicer.requests[-1].input.dtype == pb.DTYPE_BFLOAT16
    assert r.output.dtype == np.float32  # bfloat16 output arrives decoded
    np.testing.assert_allclose(r.output, x, rtol=2**-8)
    assert r.weights is None


def test_bad_arguments_fail_before_the_call(target):
    with Client(target) as c:
        with pytest.raises(ValueError, match="expected \\(seq_len, embed_dim\\)"):
            c.attend("echo", np.zeros(8, np.float32))
        with pytest.raises(ValueError, match="pass weights=True"):
            c.attend("echo", _x(2, 8), heads=[0])
        with pytest.raises(ValueError, match="empty"):
            c.attend("echo", _x(2, 8), weights=True, query_range=(3, 3))


def test_client_side_refusals_are_mha_serve_errors_and_value_errors(target, servicer):
    """README: every SDK error is an MhaServeError; a refusal before sending is also the
    ValueError it always was."""
    sent = len(servicer.requests)
    x = _x(4, 8)
    with Client(target) as c:
        for call, says in [
            (lambda: c.attend("echo", np.ones((4, 8), np.int32)), "cannot send a int32 array"),
            (lambda: c.attend("echo", x, input_dtype="float64"), "unknown dtype 'float64'"),
            (lambda: c.attend("echo", x, weights=True, query_range=(-3, None)), "before row 0"),
        ]:
            with pytest.raises(InvalidArgumentError, match=says) as err:
                call()
            assert isinstance(err.value, MhaServeError) and isinstance(err.value, ValueError)
            assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert len(servicer.requests) == sent  # none of them reached the server


def test_float16_the_client_would_overflow_is_refused_before_sending(target, servicer):
    sent = len(servicer.requests)
    x = _x(8, 8) * 1e5  # beyond float16's 65504
    with Client(target) as c, warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's "overflow encountered in cast" must not leak
        with pytest.raises(InvalidArgumentError, match=r"beyond float16's range \(\+-65504"):
            c.attend("echo", x, input_dtype="float16")
        r = c.attend("echo", x)  # as float32 it goes
    assert len(servicer.requests) == sent + 1
    np.testing.assert_array_equal(r.output, x)


@pytest.mark.parametrize(("kind", "dtype"), [("f2", np.float16), ("f4", np.float32)])
def test_big_endian_input_is_answered_as_its_native_dtype(target, servicer, kind, dtype):
    """output_dtype unset answers the input's dtype: a big-endian float16 array is float16."""
    x = _x(3, 8)
    with Client(target) as c:
        r = c.attend("echo", x.astype(">" + kind))
    assert servicer.requests[-1].input.dtype == (
        pb.DTYPE_FLOAT16 if dtype == np.float16 else pb.DTYPE_FLOAT32
    )
    assert r.output.dtype == dtype
    np.testing.assert_array_equal(r.output, x.astype(dtype))


def test_a_reply_the_client_cannot_read_is_a_reply_error(target):
    """An Attend reply whose tensor's bytes do not fit its shape (another API version, a
    broken proxy) is an MhaServeError, INTERNAL, naming the server and what was wrong."""
    with Client(target) as c:
        with pytest.raises(ReplyError) as err:
            c.attend("garbled", _x(2, 8))
        c.attend("echo", _x(2, 8))  # the client keeps working
    e = err.value
    assert isinstance(e, MhaServeError) and isinstance(e, ValueError)
    assert e.code == grpc.StatusCode.INTERNAL and e.target == target
    assert str(e).startswith("INTERNAL: the server's reply cannot be read: ValueError: ")
    assert "tensor data has 12 bytes but shape [2, 8]" in e.details


async def test_an_async_reply_the_client_cannot_read_is_a_reply_error(target):
    async with AsyncClient(target) as c:
        with pytest.raises(ReplyError, match="12 bytes but shape") as err:
            await c.attend("garbled", _x(2, 8))
    assert err.value.code == grpc.StatusCode.INTERNAL and err.value.target == target


def test_a_streamed_step_the_client_cannot_read_is_a_reply_error(target):
    with (
        Client(target) as c,
        c.session("s").stream() as stream,
        pytest.raises(ReplyError, match="12 bytes but shape") as err,
    ):
        stream.step(_x(1, 8))
    assert err.value.target == target


async def test_an_async_streamed_step_the_client_cannot_read_is_a_reply_error(target):
    async with AsyncClient(target) as c, c.session("s").stream() as stream:
        with pytest.raises(ReplyError, match="12 bytes but shape") as err:
            await stream.step(_x(1, 8))
    assert err.value.target == target


def test_a_call_on_a_closed_client_says_so(target):
    with Client(target) as c:
        c.list_models()
    for call in (c.list_models, lambda: c.attend("echo", _x(2, 8)), c.session("s").refresh):
        with pytest.raises(ClosedError, match="this Client is closed.*create a new one") as err:
            call()
        assert isinstance(err.value, MhaServeError) and isinstance(err.value, ValueError)
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(ClosedError, match="this Client is closed"):
        c.session("s").stream()


@needs_health
def test_health_and_wait_ready(fake):
    target, _, health_servicer = fake
    with Client(target) as c:
        assert c.health() == "SERVING"
        c.wait_ready(5.0)
        health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        try:
            assert c.health() == "NOT_SERVING"
            with pytest.raises(TimeoutError, match=f"{target} was not SERVING within 0.3 s"):
                c.wait_ready(0.3)
        finally:
            health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)


@needs_health
def test_wait_ready_on_a_dead_target_times_out():
    with Client("127.0.0.1:1") as c, pytest.raises(TimeoutError, match="127.0.0.1:1"):
        c.wait_ready(0.3)


# ----- AsyncClient


async def test_async_client(target):
    x = _x(2, 4, 8)
    async with AsyncClient(target) as c:
        (info,) = await c.list_models()
        assert info.variant == "gqa" and await c.model_info("echo") == info
        r = await c.attend("echo", x, weights=True, heads=[3], lengths=[4, 2])
        np.testing.assert_array_equal(r.output, x)
        assert r.weights.shape == (2, 1, 4, 4) and r.weight_heads == [3]
        np.testing.assert_allclose(r.weights[1, 0, :, :2], 0.5)
        r2 = await c.attend("echo", x[0])
        assert r2.output.shape == (4, 8)
        with pytest.raises(MhaServeError) as err:
            await c.attend("echo", _x(4, 3))
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(MhaServeError, match="^NOT_FOUND: "):
            await c.model_info("nope")
        if health is not None:
            assert await c.health() == "SERVING"
            await c.wait_ready(5.0)


async def test_a_call_on_a_closed_async_client_says_so(target):
    async with AsyncClient(target) as c:
        await c.list_models()
    with pytest.raises(ClosedError, match="this AsyncClient is closed.*create a new one"):
        await c.attend("echo", _x(2, 8))
    with pytest.raises(ClosedError, match="this AsyncClient is closed"):
        c.session("s").stream()


async def test_an_internal_error_past_a_streams_deadline_reads_as_deadline_exceeded(target):
    """grpcio ends a stream whose deadline passes as a step is written with INTERNAL, now and
    then (a race, seen at millisecond deadlines): the SDK says DEADLINE_EXCEEDED then, and
    leaves an INTERNAL before the deadline (a server bug) as it is."""
    from mha_client.sessions import AsyncSession

    core = MhaServeError(grpc.StatusCode.INTERNAL, "Internal error from Core", target)
    info = SessionInfo("s", "echo", 0, 0, 0.0, 0, 0)
    async with AsyncClient(target) as c:
        short, long = (
            AsyncSession(c, info).stream(timeout=0.01),
            AsyncSession(c, info).stream(timeout=60),
        )
        await asyncio.sleep(0.05)
        late = short._as_deadline(core)  # noqa: SLF001
        assert late.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "deadline passed" in late.details and "Internal error from Core" in late.details
        assert long._as_deadline(core) is core  # noqa: SLF001
        await short.close()
        await long.close()


# ----- CLI


def test_cli_attend_saves_npz(target, tmp_path, capsys):
    out = tmp_path / "x.npz"
    argv = ["--target", target, "attend", "echo", "--random-shape", "2,5", "--weights"]
    assert main([*argv, "--save", str(out)]) == 0
    text = capsys.readouterr().out
    assert "round trip" in text and "mean entropy (nats)" in text
    with np.load(out) as saved:
        expected = np.random.default_rng(0).standard_normal((2, 5, 8), dtype=np.float32)
        np.testing.assert_array_equal(saved["output"], expected)
        assert saved["weights"].shape == (2, 4, 5, 5)
        assert saved["weight_heads"].tolist() == [0, 1, 2, 3]
        assert saved["lengths"].tolist() == [5, 5]


def test_cli_attend_json_summary(target, servicer, capsys):
    argv = ["--target", target, "attend", "echo", "--random-shape", "2,5", "--lengths", "5,3"]
    argv += ["--heads", "1,3", "--rows", "1:4", "--prune-heads", "1,3", "--bidirectional"]
    assert main([*argv, "--weights", "--dtype", "bfloat16", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    req = servicer.requests[-1]
    assert list(req.head_mask) == [1, 0, 1, 0] and req.HasField("causal") and not req.causal
    assert req.input.dtype == pb.DTYPE_BFLOAT16
    assert summary["input"] == {"shape": [2, 5, 8], "dtype": "float32", "wire_dtype": "bfloat16"}
    assert summary["weights"]["shape"] == [2, 2, 3, 5]
    # Rows 1..3 of sequence 0 are uniform over 5 keys; rows 1..2 of sequence 1 over 3.
    expected = (3 * math.log(5) + 2 * math.log(3)) / 5
    for head, entry in zip([1, 3], summary["weights"]["heads"], strict=True):
        assert entry["head"] == head
        assert entry["entropy_nats"] == pytest.approx(expected, rel=1e-5)
        assert entry["max_weight"] == pytest.approx(1 / 3)
    assert summary["timing"]["batch_size"] == 2


def test_cli_attend_input_file_and_npy_output(target, tmp_path, capsys):
    x = _x(4, 8)
    np.save(tmp_path / "in.npy", x)
    out = tmp_path / "out.npy"
    assert main(["--target", target, "attend", "echo", "--input", str(tmp_path / "in.npy"),
                 "--save", str(out), "--output-dtype", "float16"]) == 0  # fmt: skip
    np.testing.assert_array_equal(np.load(out), x.astype(np.float16))
    assert "(4, 8) float16" in capsys.readouterr().out


def test_cli_float16_overflow_is_the_clients_error_not_the_inputs(
    target, servicer, tmp_path, capsys
):
    np.save(tmp_path / "x.npy", _x(8, 8) * 1e5)
    sent = len(servicer.requests)
    argv = ["--target", target, "attend", "echo", "--input", str(tmp_path / "x.npy")]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert main([*argv, "--dtype", "float16"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: INVALID_ARGUMENT: ") and "beyond float16's range" in err
    assert "send float32" in err and "refused this before sending it" in err
    assert "NaN or Inf" not in err and len(servicer.requests) == sent


def test_cli_heatmap(target, tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="matplotlib is the optional 'plot' extra")
    png = tmp_path / "w.png"
    argv = ["--target", target, "attend", "echo", "--random-shape", "2,6", "--lengths", "4,6"]
    assert main([*argv, "--heatmap", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert str(png) in capsys.readouterr().out


def test_cli_models_and_info(target, capsys):
    assert main(["--target", target, "models", "--json"]) == 0
    (model,) = json.loads(capsys.readouterr().out)
    assert model["name"] == "echo" and model["num_kv_heads"] == 2
    assert main(["--target", target, "models"]) == 0
    header, row = capsys.readouterr().out.splitlines()
    assert header.split() == ["name", "variant", "embed_dim", "heads", "kv_heads", "head_dim",
                              "dtype", "device", "max_seq_len", "max_batch"]  # fmt: skip
    assert row.split() == ["echo", "gqa", "8", "4", "2", "2", "float32", "cpu", "64", "4"]
    assert main(["--target", target, "info", "echo"]) == 0
    out = capsys.readouterr().out
    lines = [line.split() for line in out.splitlines()]
    assert ["max_response_bytes", "4194304"] in lines
    assert ["kv_cache.dtype", "bfloat16"] in lines and ["kv_cache.num_sessions", "1"] in lines


@needs_health
def test_cli_health(fake, capsys):
    target, _, health_servicer = fake
    assert main(["--target", target, "health", "--wait", "5"]) == 0
    assert capsys.readouterr().out.strip() == "SERVING"
    health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    try:
        assert main(["--target", target, "health"]) == 1
        assert capsys.readouterr().out.strip() == "NOT_SERVING"
    finally:
        health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)


@needs_health
def test_cli_health_of_an_unknown_service_says_so(fake, capsys):
    """health --service nosuch printed "error: NOT_FOUND: <_InactiveRpcError of RPC that
    terminated with: ...>", the repr of gRPC's exception (the health service sends no
    message with its NOT_FOUND)."""
    target, _, _ = fake
    assert main(["--target", target, "health", "--service", "nosuch"]) == 1
    err = capsys.readouterr().err
    assert "no health service 'nosuch'" in err and "_InactiveRpcError" not in err


def test_cli_server_errors_exit_1(target, tmp_path, capsys):
    np.save(tmp_path / "bad.npy", _x(5, 3))
    assert main(["--target", target, "attend", "echo", "--input", str(tmp_path / "bad.npy")]) == 1
    assert capsys.readouterr().err.startswith("error: INVALID_ARGUMENT: input embed_dim 3")
    assert main(["--target", target, "attend", "nope", "--random-shape", "3"]) == 1
    assert capsys.readouterr().err.startswith("error: NOT_FOUND: model 'nope'")


def test_cli_prune_heads_out_of_range_exits_2(target, capsys):
    argv = ["--target", target, "attend", "echo", "--random-shape", "3", "--prune-heads", "4"]
    assert main(argv) == 2
    assert "4 heads (0..3)" in capsys.readouterr().err


def test_a_status_without_a_message_says_its_code_not_a_repr():
    """grpc.health.v1 answers NOT_FOUND with no message: the error read as the RpcError's
    repr (`<_InactiveRpcError of RPC that terminated with: ...>`)."""

    class Bare(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.NOT_FOUND

        def details(self):
            return ""

    e = MhaServeError.from_rpc_error(Bare(), "host:1")
    assert e.code == grpc.StatusCode.NOT_FOUND and e.details == "NOT_FOUND, with no message"
    assert "Inactive" not in str(e)


def test_a_stream_closed_while_a_step_reopens_it_stays_closed(target):
    """close() from another thread between a step ending its call and opening the next
    (after a refusal) returned at once, seeing the call ended, and the step then opened a
    new call on the closed stream. The step's two moves, with the close between them:"""
    with Client(target) as c:
        stream = c.session("s").stream()
        stream._end()  # the step ended the refused call...
        stream.close()  # ...another thread closes the stream...
        with pytest.raises(ClosedError, match="this stream is closed"):
            stream._open()  # ...and the step's reopening finds it closed
        with pytest.raises(ClosedError, match="this stream is closed"):
            stream.step(_x(1, 8))
