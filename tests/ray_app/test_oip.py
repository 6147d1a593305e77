"""The Open Inference Protocol through Ray Serve's real gRPC proxy: an unchanged tritonclient
(tests/e2e/triton_client.py in its own environment) gets what mha.v1 gets through the same
proxy; Triton sequences over two replicas, each step reaching its session's replica and
equal to its full causal recompute, whichever Ingress call it comes in; a sequence whose
replica is gone answers NOT_FOUND naming it, and SequenceDirectory forgets it."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from mha_client.api import attention_pb2 as mha_pb
from mha_client.api import attention_pb2_grpc as mha_grpc
from mha_client.api.inference import grpc_service_pb2 as pb
from mha_client.api.inference import grpc_service_pb2_grpc as pb_grpc
from mha_serve.ray_app.ids import pinned_to, replica_of
from tests.e2e.test_triton import check_tritonclient, triton_python  # noqa: F401 (fixture)
from tests.ray_app.cluster import APP
from tests.ray_app.conftest import ATOL, replica_handle, replica_ids

pytestmark = pytest.mark.slow
TIMEOUT_S = 120
EMBED = 512
OWNER = "peer:ipv4:127.0.0.1"  # the identity a loopback client's sequences are kept under


@pytest.fixture(scope="module")
def channel(cluster):
    with grpc.insecure_channel(cluster.target) as channel:
        yield channel


def sessions_held() -> int:
    total = 0
    for replica_id in replica_ids():
        usage = replica_handle("cache_usage", replica_id).remote().result(timeout_s=TIMEOUT_S)
        total += sum(n for n, _ in usage.values())
    return total


def directory(method: str):
    from ray import serve

    return serve.get_deployment_handle("SequenceDirectory", APP).options(method_name=method)


def infer_request(x: np.ndarray, model: str, seq_id, *, start=False, end=False, request_id=""):
    tensor = pb.ModelInferRequest.InferInputTensor(
        name="INPUT", datatype="FP32", shape=list(x.shape)
    )
    request = pb.ModelInferRequest(model_name=model, id=request_id, inputs=[tensor])
    request.raw_input_contents.append(x.astype(np.float32).tobytes())
    if seq_id is not None:
        if isinstance(seq_id, str):
            request.parameters["sequence_id"].string_param = seq_id
        else:
            request.parameters["sequence_id"].int64_param = seq_id
        request.parameters["sequence_start"].bool_param = start
        request.parameters["sequence_end"].bool_param = end
    return request


def output(response: pb.ModelInferResponse) -> np.ndarray:
    return np.frombuffer(response.raw_output_contents[0], np.float32).reshape(
        response.outputs[0].shape
    )


def test_tritonclient_through_the_proxy_gets_what_mha_v1_gets(
    cluster,
    channel,
    triton_python,  # noqa: F811 (the fixture imported above)
    tmp_path,
):
    stub = mha_grpc.AttentionServiceStub(channel)
    check_tritonclient(cluster.target, stub, triton_python, tmp_path, sessions_held)
    assert directory("size").remote().result(timeout_s=TIMEOUT_S) == 0


def test_sequences_reach_their_replica_over_infer_and_the_stream(channel, models):
    """Sequences started until both replicas hold some (bounded), stepped interleaved by
    ModelInfer and then on one stream, every step equal to the model's full recompute."""
    stub = pb_grpc.GRPCInferenceServiceStub(channel)
    rng = np.random.default_rng(7)
    history: dict[int, np.ndarray] = {}
    owners: dict[int, str] = {}
    for seq_id in range(1, 41):
        x = rng.standard_normal((1, 2, EMBED), dtype=np.float32)
        reply = stub.ModelInfer(infer_request(x, "gqa", seq_id, start=True), timeout=TIMEOUT_S)
        np.testing.assert_allclose(output(reply), models.step("gqa", x[0], 2)[None], atol=ATOL)
        history[seq_id] = x[0]
        owners[seq_id] = replica_of(reply.parameters["session_id"].string_param)
        if len(set(owners.values())) == 2 and len(owners) >= 6:
            break
    assert len(set(owners.values())) == 2, "every sequence landed on one replica"
    for round_ in range(2):
        for seq_id in sorted(history, reverse=bool(round_)):
            x = rng.standard_normal((1, 1, EMBED), dtype=np.float32)
            reply = stub.ModelInfer(infer_request(x, "gqa", seq_id), timeout=TIMEOUT_S)
            history[seq_id] = np.concatenate([history[seq_id], x[0]])
            want = models.step("gqa", history[seq_id], 1)[None]
            np.testing.assert_allclose(output(reply), want, atol=ATOL, err_msg=str(seq_id))
            assert replica_of(reply.parameters["session_id"].string_param) == owners[seq_id]
    # The stream: every sequence steps once and ends, in one stream, all in flight at once
    # (each message's calls need a request id of their own: forward.own_request_id).
    steps = {s: rng.standard_normal((1, 1, EMBED), dtype=np.float32) for s in history}
    requests = [infer_request(x, "gqa", s, end=True, request_id=str(s)) for s, x in steps.items()]
    replies = list(stub.ModelStreamInfer(iter(requests), timeout=TIMEOUT_S))
    assert [r.infer_response.id for r in replies] == [str(s) for s in steps]
    for seq_id, reply in zip(steps, replies, strict=True):
        assert not reply.error_message, reply.error_message
        session_id = reply.infer_response.parameters["session_id"].string_param
        assert replica_of(session_id) == owners[seq_id]
        history[seq_id] = np.concatenate([history[seq_id], steps[seq_id][0]])
        want = models.step("gqa", history[seq_id], 1)[None]
        np.testing.assert_allclose(output(reply.infer_response), want, atol=ATOL)
    assert directory("size").remote().result(timeout_s=TIMEOUT_S) == 0
    assert sessions_held() == 0
    # Ended: a step is refused naming the sequence, by ModelInfer and on the stream.
    x = rng.standard_normal((1, 1, EMBED), dtype=np.float32)
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(infer_request(x, "gqa", 1), timeout=TIMEOUT_S)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sequence 1 to model 'gqa' must specify the START flag" in info.value.details()
    (reply,) = stub.ModelStreamInfer(iter([infer_request(x, "gqa", "s")]), timeout=TIMEOUT_S)
    assert "sequence 's' to model 'gqa' must specify the START flag" in reply.error_message


def test_a_sequence_whose_replica_is_gone_answers_not_found(channel):
    """A sequence whose session names a replica that no longer runs (an id no replica has)."""
    stub = pb_grpc.GRPCInferenceServiceStub(channel)
    gone = pinned_to("gone0replica")
    key = ("mqa", OWNER, 77)
    directory("start").remote(key, gone).result(timeout_s=TIMEOUT_S)
    x = np.ones((1, 1, EMBED), np.float32)
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(infer_request(x, "mqa", 77), timeout=TIMEOUT_S)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND, info.value.details()
    details = info.value.details()
    assert "sequence 77 to model 'mqa'" in details and "gone0replica" in details, details
    assert "sequence_start" in details
    assert directory("get").remote(key).result(timeout_s=TIMEOUT_S) is None


def test_a_bad_request_gets_a_triton_error_and_mha_v1_goes_on(channel):
    stub = pb_grpc.GRPCInferenceServiceStub(channel)
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(infer_request(np.ones((1, 2, 16)), "mha", None), timeout=TIMEOUT_S)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "unexpected shape for input 'INPUT' for model 'mha'" in info.value.details()
    raw = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
    with pytest.raises(grpc.RpcError) as info:
        raw(b"\xff\xff\xff", timeout=TIMEOUT_S)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "inference.ModelInferRequest" in info.value.details()
    models = mha_grpc.AttentionServiceStub(channel).ListModels(
        mha_pb.ListModelsRequest(), timeout=TIMEOUT_S
    )
    assert [m.name for m in models.models] == ["mha", "gqa", "mqa"]


def test_reflection_lists_both_protocols(channel):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    (reply,) = stub.ServerReflectionInfo(iter([request]), timeout=TIMEOUT_S)
    names = {s.name for s in reply.list_services_response.service}
    assert {"inference.GRPCInferenceService", "mha.v1.AttentionService"} <= names, names
