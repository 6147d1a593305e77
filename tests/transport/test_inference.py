"""The Open Inference Protocol door over a real channel: the same numbers as mha.v1, Triton's
errors and sequences, metrics under protocol="kserve-v2" (stubs generated from our protos;
tests/e2e/test_triton.py runs the real tritonclient)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import grpc
import numpy as np
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from mha_client.api import attention_pb2 as pb
from mha_client.api import attention_pb2_grpc as pb_grpc
from mha_client.api.inference import grpc_service_pb2 as ip
from mha_client.api.inference import grpc_service_pb2_grpc as ip_grpc
from mha_client.api.inference import model_config_pb2 as mc
from mha_serve import metrics
from mha_serve.config import ServerConfig
from mha_serve.engine import ModelSpec
from mha_serve.model import AttentionConfig
from mha_serve.transport.server import Server
from tests.helpers import free_port

EMBED = 32
HEADS = 4
Input = ip.ModelInferRequest.InferInputTensor
Output = ip.ModelInferRequest.InferRequestedOutputTensor


@dataclass
class Stubs:
    oip: ip_grpc.GRPCInferenceServiceStub
    v1: pb_grpc.AttentionServiceStub
    channel: grpc.aio.Channel


@contextlib.asynccontextmanager
async def serving(**server_kw):
    """A server on two tiny models ("tiny" keeps sessions, "flat" has no cache), and stubs of
    both protocols on one channel."""
    models = [
        ModelSpec("tiny", AttentionConfig(EMBED, HEADS, 2)),
        ModelSpec("flat", AttentionConfig(EMBED, HEADS), kv_cache_bytes=0),
    ]
    server = Server(
        ServerConfig(host="127.0.0.1", port=free_port(), metrics_port=0, models=models, **server_kw)
    )
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            yield Stubs(
                ip_grpc.GRPCInferenceServiceStub(channel),
                pb_grpc.AttentionServiceStub(channel),
                channel,
            )
    finally:
        await server.stop()


def embeddings(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)


def infer_request(
    x: np.ndarray,
    *,
    model: str = "tiny",
    outputs=(),
    typed: bool = False,
    datatype="FP32",
    **params,
) -> ip.ModelInferRequest:
    tensor = Input(name="INPUT", datatype=datatype, shape=x.shape)
    if typed:
        tensor.contents.fp32_contents.extend(x.ravel().tolist())
    request = ip.ModelInferRequest(
        model_name=model, id="req-1", inputs=[tensor], outputs=[Output(name=n) for n in outputs]
    )
    if not typed:
        request.raw_input_contents.append(x.tobytes())
    for key, value in params.items():
        field = {bool: "bool_param", int: "int64_param", str: "string_param"}[type(value)]
        setattr(request.parameters[key], field, value)
    return request


def output(response: ip.ModelInferResponse, name: str) -> np.ndarray:
    (index,) = [i for i, o in enumerate(response.outputs) if o.name == name]
    tensor = response.outputs[index]
    dtype = {"FP32": np.float32, "FP16": np.float16, "BF16": np.uint16}[tensor.datatype]
    return np.frombuffer(response.raw_output_contents[index], dtype).reshape(tensor.shape)


def mha_v1(x: np.ndarray, **fields) -> pb.AttendRequest:
    return pb.AttendRequest(
        input=pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=x.shape, data=x.tobytes()), **fields
    )


def tensor_of(t: pb.Tensor) -> np.ndarray:
    return np.frombuffer(t.data, np.float32).reshape(t.shape)


def requests_counted(method: str, model: str, code: str, protocol: str) -> float:
    return metrics.REQUESTS.labels(method, model, code, protocol)._value.get()  # noqa: SLF001


# --- health and metadata -----------------------------------------------------------------


async def test_health_metadata_and_config_describe_the_models():
    async with serving() as stubs:
        oip = stubs.oip
        assert (await oip.ServerLive(ip.ServerLiveRequest())).live
        assert (await oip.ServerReady(ip.ServerReadyRequest())).ready
        assert (await oip.ModelReady(ip.ModelReadyRequest(name="tiny"))).ready
        assert (await oip.ModelReady(ip.ModelReadyRequest(name="tiny", version="1"))).ready
        assert not (await oip.ModelReady(ip.ModelReadyRequest(name="nope"))).ready
        assert not (await oip.ModelReady(ip.ModelReadyRequest(name="tiny", version="2"))).ready
        server = await oip.ServerMetadata(ip.ServerMetadataRequest())
        assert server.name == "mha-serve" and "sequence" in server.extensions
        meta = await oip.ModelMetadata(ip.ModelMetadataRequest(name="tiny"))
        assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [
            ("INPUT", "FP32", [-1, -1, EMBED])
        ]
        assert [(t.name, list(t.shape)) for t in meta.outputs] == [
            ("OUTPUT", [-1, -1, EMBED]),
            ("ATTENTION_WEIGHTS", [-1, HEADS, -1, -1]),
        ]
        config = (await oip.ModelConfig(ip.ModelConfigRequest(name="tiny"))).config
        assert config.name == "tiny" and config.max_batch_size == 0
        assert config.input[0].data_type == mc.TYPE_FP32
        assert list(config.input[0].dims) == [-1, -1, EMBED]
        assert config.WhichOneof("scheduling_choice") == "sequence_batching"
        assert config.sequence_batching.max_sequence_idle_microseconds == 600 * 10**6
        assert config.parameters["request.causal"].string_value.startswith("bool:")
        assert config.parameters["request.lengths"].string_value.startswith("string:")
        assert config.parameters["num_kv_heads"].string_value == "2"
        flat = (await oip.ModelConfig(ip.ModelConfigRequest(name="flat"))).config
        assert flat.WhichOneof("scheduling_choice") == "dynamic_batching"
        for call in (
            oip.ModelMetadata(ip.ModelMetadataRequest(name="nope")),
            oip.ModelConfig(ip.ModelConfigRequest(name="nope")),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            assert err.value.details().startswith("Request for unknown model: 'nope' is not found")


async def test_not_ready_until_the_models_are_warm():
    server = Server(ServerConfig(host="127.0.0.1", port=free_port(), metrics_port=0))
    await server.listen()  # the port is open; no models loaded yet
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            oip = ip_grpc.GRPCInferenceServiceStub(channel)
            assert (await oip.ServerLive(ip.ServerLiveRequest())).live
            assert not (await oip.ServerReady(ip.ServerReadyRequest())).ready
            assert not (await oip.ModelReady(ip.ModelReadyRequest(name="mha"))).ready
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await oip.ModelInfer(infer_request(embeddings(1, 2, 512), model="mha"))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop()


async def test_reflection_lists_both_protocols():
    async with serving() as stubs:
        stub = reflection_pb2_grpc.ServerReflectionStub(stubs.channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        async for reply in stub.ServerReflectionInfo(iter([request])):
            names = {s.name for s in reply.list_services_response.service}
            break
        assert {"inference.GRPCInferenceService", "mha.v1.AttentionService"} <= names


# --- inference ---------------------------------------------------------------------------


async def test_infer_equals_mha_v1_raw_and_typed_with_and_without_weights():
    x = embeddings(2, 5, EMBED)
    async with serving() as stubs:
        ref = await stubs.v1.Attend(mha_v1(x, model="tiny"))
        raw = await stubs.oip.ModelInfer(infer_request(x))
        typed = await stubs.oip.ModelInfer(infer_request(x, typed=True))
        assert raw.id == "req-1" and raw.model_name == "tiny" and raw.model_version == "1"
        assert [o.name for o in raw.outputs] == ["OUTPUT"]  # weights only when asked
        for response in (raw, typed):
            np.testing.assert_allclose(output(response, "OUTPUT"), tensor_of(ref.output), atol=1e-6)

        weights = pb.WeightsRequest(enabled=True, heads=[3, 1], query_start=1, query_end=4)
        ref = await stubs.v1.Attend(mha_v1(x, model="tiny", causal=True, weights=weights))
        both = await stubs.oip.ModelInfer(
            infer_request(
                x,
                outputs=("OUTPUT", "ATTENTION_WEIGHTS"),
                causal=True,
                weight_heads="3,1",
                query_start=1,
                query_end=4,
            )
        )
        got = output(both, "ATTENTION_WEIGHTS")
        assert got.shape == (2, 2, 3, 5)
        np.testing.assert_allclose(got, tensor_of(ref.attention_weights), atol=1e-6)
        np.testing.assert_allclose(output(both, "OUTPUT"), tensor_of(ref.output), atol=1e-6)
        tensor = both.outputs[1]
        assert tensor.parameters["weight_heads"].string_param == "3,1"
        assert tensor.parameters["query_start"].int64_param == 1
        only = await stubs.oip.ModelInfer(
            infer_request(
                x,
                outputs=("ATTENTION_WEIGHTS",),
                causal=True,
                weight_heads="3,1",
                query_start=1,
                query_end=4,
            )
        )
        assert [o.name for o in only.outputs] == ["ATTENTION_WEIGHTS"]
        np.testing.assert_array_equal(output(only, "ATTENTION_WEIGHTS"), got)


async def test_lengths_head_mask_and_dtypes_follow_the_parameters():
    x = embeddings(2, 4, EMBED, seed=1)
    async with serving() as stubs:
        ref = await stubs.v1.Attend(
            mha_v1(
                x,
                model="tiny",
                lengths=[4, 2],
                head_mask=[1, 0, 1, 1],
                output_dtype=pb.DTYPE_FLOAT16,
            )
        )
        got = await stubs.oip.ModelInfer(
            infer_request(x, lengths="4,2", head_mask="1,0,1,1", output_dtype="FP16")
        )
        assert got.outputs[0].datatype == "FP16"
        np.testing.assert_array_equal(
            output(got, "OUTPUT"), np.frombuffer(ref.output.data, np.float16).reshape(2, 4, EMBED)
        )
        # BF16 in: the same bits as mha.v1's BF16 (bf16 = the high 16 bits of fp32)
        bits = (x.view(np.uint32) >> 16).astype(np.uint16)
        ref = await stubs.v1.Attend(
            pb.AttendRequest(
                model="tiny",
                input=pb.Tensor(dtype=pb.DTYPE_BFLOAT16, shape=x.shape, data=bits.tobytes()),
            )
        )
        request = infer_request(x, datatype="BF16")
        request.raw_input_contents[0] = bits.tobytes()
        got = await stubs.oip.ModelInfer(request)
        assert got.outputs[0].datatype == "BF16"
        assert got.raw_output_contents[0] == ref.output.data


@pytest.mark.parametrize(
    ("change", "code", "message"),
    [
        (dict(model="nope"), "NOT_FOUND", "Request for unknown model: 'nope' is not found"),
        (
            dict(shape=(2, 3, 16)),
            "INVALID_ARGUMENT",
            "unexpected shape for input 'INPUT' for model 'tiny'. Expected [-1,-1,32], got [2,3,16]",
        ),
        (dict(shape=(3, EMBED)), "INVALID_ARGUMENT", "unexpected shape for input 'INPUT'"),
        (
            dict(datatype="INT32"),
            "INVALID_ARGUMENT",
            "inference input 'INPUT' data-type is 'INT32', but model 'tiny' expects",
        ),
        (
            dict(raw=b"\0" * 12),
            "INVALID_ARGUMENT",
            "input byte size mismatch for input 'INPUT' for model 'tiny'. Expected",
        ),
        (dict(name="X"), "INVALID_ARGUMENT", "unexpected inference input 'X' for model 'tiny'"),
        (dict(outputs=("PROBS",)), "INVALID_ARGUMENT", "unexpected inference output 'PROBS'"),
        (dict(params={"weight_heads": "0"}), "INVALID_ARGUMENT", "ATTENTION_WEIGHTS is not among"),
        (
            dict(params={"causal": "yes"}),
            "INVALID_ARGUMENT",
            "parameter 'causal' for model 'tiny' must be bool",
        ),
        (dict(params={"lengths": "3,x"}), "INVALID_ARGUMENT", "parameter 'lengths' is '3,x'"),
        (dict(values=1e30), "INVALID_ARGUMENT", "overflow"),
        (
            dict(version="7"),
            "NOT_FOUND",
            "Request for unknown model: 'tiny' version 7 is not found",
        ),
    ],
)
async def test_bad_requests_get_tritons_errors_and_the_server_keeps_serving(change, code, message):
    x = embeddings(*change.get("shape", (2, 3, EMBED)))
    if "values" in change:
        x = np.full(x.shape, change["values"], np.float32)
    request = infer_request(
        x,
        model=change.get("model", "tiny"),
        outputs=change.get("outputs", ()),
        datatype=change.get("datatype", "FP32"),
        **change.get("params", {}),
    )
    request.model_version = change.get("version", "")
    if "raw" in change:
        request.raw_input_contents[0] = change["raw"]
    if "name" in change:
        request.inputs[0].name = change["name"]
    async with serving() as stubs:
        model = "unknown" if "model" in change else "tiny"
        before = requests_counted("ModelInfer", model, code, "kserve-v2")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stubs.oip.ModelInfer(request)
        assert err.value.code().name == code
        assert message in err.value.details()
        assert requests_counted("ModelInfer", model, code, "kserve-v2") == before + 1
        ok = await stubs.oip.ModelInfer(infer_request(embeddings(1, 2, EMBED)))
        assert list(ok.outputs[0].shape) == [1, 2, EMBED]


async def test_malformed_bytes_answer_invalid_argument():
    async with serving() as stubs:
        call = stubs.channel.unary_unary(
            "/inference.GRPCInferenceService/ModelInfer",
            request_serializer=lambda b: b,
            response_deserializer=ip.ModelInferResponse.FromString,
        )
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call(b"\xff\xff\xff")
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "inference.ModelInferRequest" in err.value.details()


async def test_requests_count_under_the_kserve_protocol_label():
    async with serving() as stubs:
        before = requests_counted("ModelInfer", "tiny", "OK", "kserve-v2")
        before_v1 = requests_counted("Attend", "tiny", "OK", "mha.v1")
        await stubs.oip.ModelInfer(infer_request(embeddings(1, 2, EMBED)))
        await stubs.v1.Attend(mha_v1(embeddings(1, 2, EMBED), model="tiny"))
        assert requests_counted("ModelInfer", "tiny", "OK", "kserve-v2") == before + 1
        assert requests_counted("Attend", "tiny", "OK", "mha.v1") == before_v1 + 1


# --- sequences ---------------------------------------------------------------------------


async def num_sessions(stubs: Stubs) -> int:
    info = await stubs.v1.GetModelInfo(pb.GetModelInfoRequest(name="tiny"))
    return info.kv_cache.num_sessions


async def mha_v1_steps(stubs: Stubs, steps: list[np.ndarray]) -> list[np.ndarray]:
    sid = (await stubs.v1.CreateSession(pb.CreateSessionRequest(model="tiny"))).session_id
    outs = [tensor_of((await stubs.v1.Attend(mha_v1(x, session_id=sid))).output) for x in steps]
    await stubs.v1.CloseSession(pb.CloseSessionRequest(session_id=sid))
    return outs


def step_request(
    x: np.ndarray, seq_id: int | str, *, start=False, end=False
) -> ip.ModelInferRequest:
    return infer_request(x, sequence_id=seq_id, sequence_start=start, sequence_end=end)


@pytest.mark.parametrize("seq_id", [42, "chat-7"])
async def test_a_sequence_steps_one_session_like_mha_v1(seq_id):
    steps = [embeddings(1, n, EMBED, seed=n) for n in (5, 1, 3)]
    async with serving() as stubs:
        expected = await mha_v1_steps(stubs, steps)
        got, tokens = [], []
        for i, x in enumerate(steps):
            r = await stubs.oip.ModelInfer(
                step_request(x, seq_id, start=i == 0, end=i == len(steps) - 1)
            )
            got.append(output(r, "OUTPUT"))
            tokens.append(r.parameters["sequence_num_tokens"].int64_param)
        assert tokens == [5, 6, 9]
        for g, e in zip(got, expected, strict=True):
            np.testing.assert_allclose(g, e, atol=1e-6)
        assert await num_sessions(stubs) == 0  # end closed it
        with pytest.raises(grpc.aio.AioRpcError) as err:  # ended: a step is refused
            await stubs.oip.ModelInfer(step_request(steps[0], seq_id))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        named = f"sequence {seq_id!r}" if isinstance(seq_id, str) else f"sequence {seq_id}"
        assert f"inference request for {named} to model 'tiny' must specify the START flag" in (
            err.value.details()
        )


async def test_sequences_are_per_model_and_a_start_replaces_a_live_one():
    x = embeddings(1, 2, EMBED)
    async with serving() as stubs:
        await stubs.oip.ModelInfer(step_request(x, 5, start=True))
        again = await stubs.oip.ModelInfer(step_request(x, 5, start=True))  # a new sequence 5
        assert again.parameters["sequence_num_tokens"].int64_param == 2
        assert await num_sessions(stubs) == 1  # the old session was closed
        with pytest.raises(grpc.aio.AioRpcError) as err:  # "flat" keeps no sessions
            await stubs.oip.ModelInfer(
                infer_request(x, model="flat", sequence_id=5, sequence_start=True)
            )
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stubs.oip.ModelInfer(infer_request(x, sequence_start=True))
        assert "sequence_id" in err.value.details()
        await stubs.oip.ModelInfer(step_request(x, 5, end=True))
        assert await num_sessions(stubs) == 0


async def test_a_start_at_the_clients_session_limit_replaces_its_live_sequence():
    """docs/api.md: a start for an id already active closes the old session first, so that
    a client holding its max_sessions_per_client can start its sequence again."""
    x = embeddings(1, 2, EMBED)
    async with serving(max_sessions_per_client=1) as stubs:
        first = await stubs.oip.ModelInfer(step_request(x, 5, start=True))
        again = await stubs.oip.ModelInfer(step_request(x, 5, start=True))
        assert again.parameters["sequence_num_tokens"].int64_param == 2
        old = first.parameters["session_id"].string_param
        assert again.parameters["session_id"].string_param != old
        assert await num_sessions(stubs) == 1
        with pytest.raises(grpc.aio.AioRpcError) as err:  # the old session was closed
            await stubs.v1.GetSession(pb.GetSessionRequest(session_id=old))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.aio.AioRpcError) as err:  # another sequence: past the limit
            await stubs.oip.ModelInfer(step_request(x, 6, start=True))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_sessions_per_client 1" in err.value.details()
        step = await stubs.oip.ModelInfer(step_request(x, 5, end=True))  # 5 goes on
        assert step.parameters["sequence_num_tokens"].int64_param == 4


@pytest.mark.parametrize(
    "refused",
    [
        dict(params={"causal": "maybe"}),  # a parameter the request's conversion refuses
        dict(x=embeddings(1, 2, EMBED // 2)),  # the wrong embed_dim
        dict(outputs=("Y",)),  # an unknown output
        dict(params={"causal": False}),  # refused by the engine, at the step
    ],
)
async def test_an_end_refused_still_ends_its_sequence(refused):
    """docs/api.md: end closes the sequence's session after its step, whatever that step's
    outcome: a step refused before it reached the session too (it stayed open, counting
    against its client's limits until its TTL)."""
    x = embeddings(1, 2, EMBED)
    async with serving() as stubs:
        await stubs.oip.ModelInfer(step_request(x, 77, start=True))
        assert await num_sessions(stubs) == 1
        last = infer_request(
            refused.get("x", x),
            outputs=refused.get("outputs", ()),
            sequence_id=77,
            sequence_end=True,
            **refused.get("params", {}),
        )
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stubs.oip.ModelInfer(last)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert await num_sessions(stubs) == 0
        with pytest.raises(grpc.aio.AioRpcError) as err:  # ended: a step is refused
            await stubs.oip.ModelInfer(step_request(x, 77))
        assert "must specify the START flag" in err.value.details()


async def test_a_sequence_whose_session_is_gone_is_named():
    x = embeddings(1, 2, EMBED)
    async with serving() as stubs:
        first = await stubs.oip.ModelInfer(step_request(x, 9, start=True))
        session_id = first.parameters["session_id"].string_param  # the same session in mha.v1
        info = await stubs.v1.GetSession(pb.GetSessionRequest(session_id=session_id))
        assert info.num_tokens == 2
        await stubs.v1.CloseSession(pb.CloseSessionRequest(session_id=session_id))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stubs.oip.ModelInfer(step_request(x, 9))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert "sequence 9 to model 'tiny' is no longer active" in err.value.details()


async def test_the_stream_steps_sequences_and_answers_errors_in_band():
    steps = [embeddings(1, n, EMBED, seed=10 + n) for n in (3, 2)]
    async with serving() as stubs:
        expected = await mha_v1_steps(stubs, steps)
        requests = [
            step_request(steps[0], 77, start=True),
            infer_request(steps[0], model="nope"),  # an error: the stream goes on
            step_request(steps[1], 77, end=True),
            step_request(steps[1], 77),  # ended
            infer_request(embeddings(2, 3, EMBED)),  # stateless, on the same stream
        ]
        replies = [r async for r in stubs.oip.ModelStreamInfer(iter(requests))]
        assert [bool(r.error_message) for r in replies] == [False, True, False, True, False]
        np.testing.assert_allclose(
            output(replies[0].infer_response, "OUTPUT"), expected[0], atol=1e-6
        )
        np.testing.assert_allclose(
            output(replies[2].infer_response, "OUTPUT"), expected[1], atol=1e-6
        )
        assert replies[1].error_message.startswith("Request for unknown model: 'nope'")
        assert "sequence 77 to model 'tiny' must specify the START flag" in replies[3].error_message
        assert list(replies[4].infer_response.outputs[0].shape) == [2, 3, EMBED]
        assert await num_sessions(stubs) == 0


def test_the_sequence_map_forgets_sessions_that_are_gone():
    from mha_serve.transport.oip.sequences import SequenceMap

    live = {"s1", "s3"}
    ids = SequenceMap(prune_at=3)
    for n in range(3):
        assert ids.start(("m", n), f"s{n}", live=live.__contains__) is None
    assert ids.start(("m", 0), "s0b", live=live.__contains__) == "s0"  # a restart
    ids.start(("m", 3), "s3", live=live.__contains__)  # past prune_at: s2 is gone
    assert ids.get(("m", 2)) is None and ids.get(("m", 1)) == "s1"
    ids.end(("m", 1), "other")  # a stale end leaves a newer mapping alone
    assert ids.get(("m", 1)) == "s1"


async def test_tritons_timeout_parameter_bounds_the_wait():
    x = embeddings(1, 2, EMBED)
    async with serving() as stubs:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stubs.oip.ModelInfer(infer_request(x, timeout=1))  # 1 microsecond
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        ok = await stubs.oip.ModelInfer(infer_request(x, timeout=60_000_000))
        assert list(ok.outputs[0].shape) == [1, 2, EMBED]


async def test_malformed_stream_messages_are_answered_in_band():
    async with serving() as stubs:
        call = stubs.channel.stream_stream(
            "/inference.GRPCInferenceService/ModelStreamInfer",
            request_serializer=lambda b: b,
            response_deserializer=ip.ModelStreamInferResponse.FromString,
        )
        good = infer_request(embeddings(1, 2, EMBED)).SerializeToString()
        replies = [r async for r in call(iter([b"\xff\xff\xff", good]))]
        assert "not a valid inference.ModelInferRequest" in replies[0].error_message
        assert not replies[1].error_message
        assert list(replies[1].infer_response.outputs[0].shape) == [1, 2, EMBED]


def test_sequence_ids_of_every_kind_kserve_clients_send():
    from mha_serve.engine import InvalidRequest
    from mha_serve.transport.oip.sequences import sequence_of

    request = ip.ModelInferRequest()
    assert sequence_of(request.parameters) is None
    request.parameters["sequence_id"].uint64_param = 2**64 - 1
    request.parameters["sequence_end"].bool_param = True
    assert sequence_of(request.parameters).id == 2**64 - 1
    assert sequence_of(request.parameters).end
    request.parameters["sequence_id"].string_param = ""  # none, but flags set: refused
    with pytest.raises(InvalidRequest, match="sequence_id is not"):
        sequence_of(request.parameters)
    request.parameters["sequence_id"].double_param = 1.5
    with pytest.raises(InvalidRequest, match="integer or a string"):
        sequence_of(request.parameters)


async def test_a_streams_requests_batch_together_and_answer_in_order():
    """Sent before the first answer, a stream's requests compute concurrently: they share
    forward passes (the batcher waits up to 500 ms to fill one), yet replies keep their order."""
    models = [ModelSpec("tiny", AttentionConfig(EMBED, HEADS, 2), max_queue_delay_ms=500)]
    server = Server(ServerConfig(host="127.0.0.1", port=free_port(), metrics_port=0, models=models))
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            oip = ip_grpc.GRPCInferenceServiceStub(channel)
            requests = []
            for i in range(8):
                request = infer_request(embeddings(1, 4, EMBED, seed=i))
                request.id = f"r{i}"
                requests.append(request)
            replies = [r async for r in oip.ModelStreamInfer(iter(requests))]
    finally:
        await server.stop()
    assert [r.infer_response.id for r in replies] == [f"r{i}" for i in range(8)]
    sizes = [r.infer_response.parameters["batch_size"].int64_param for r in replies]
    assert max(sizes) > 1, sizes


def test_inference_stubs_pickle_under_their_own_modules():
    """As mha.v1's (tests/test_protos.py): protoc would name them inference.*_pb2, which no
    package provides; the grpc stub imports its sibling relatively (grpc/grpc#29390)."""
    import pickle
    from pathlib import Path

    for module in (ip, mc):
        for name in module.DESCRIPTOR.message_types_by_name:
            cls = getattr(module, name)
            assert cls.__module__ == module.__name__, name
            assert module.__name__.startswith("mha_client.api.inference."), module.__name__
            assert pickle.loads(pickle.dumps(cls())) == cls(), name
    text = Path(ip_grpc.__file__).read_text()
    assert "from . import grpc_service_pb2" in text and "from inference" not in text


async def test_a_clients_sequence_is_out_of_another_clients_reach(tmp_path):
    """Sequence ids are the clients' own small numbers: with tokens, client B sending A's
    sequence id without start is refused, never steps A's session (its cached keys)."""
    tokens = tmp_path / "tokens"
    tokens.write_text("token-a\ntoken-b\n")
    async with serving(auth_token_file=str(tokens)) as stubs:
        x = embeddings(1, 1, EMBED)
        a = (("authorization", "Bearer token-a"),)
        b = (("authorization", "Bearer token-b"),)
        start = infer_request(x, sequence_id=7, sequence_start=True)
        await stubs.oip.ModelInfer(start, metadata=a)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stubs.oip.ModelInfer(infer_request(x, sequence_id=7), metadata=b)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "START flag" in err.value.details()
        reply = await stubs.oip.ModelInfer(infer_request(x, sequence_id=7), metadata=a)
        assert list(output(reply, "OUTPUT").shape) == [1, 1, EMBED]  # A's steps go on
