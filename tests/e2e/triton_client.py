"""Runs in tritonclient's own environment (.venv-triton, made by test_triton.py), not ours:
an unchanged tritonclient against a real mha-serve. Asserts what it can alone, and saves the
numbers for test_triton.py to compare with the same calls through mha.v1.

    python triton_client.py TARGET WORK_DIR

WORK_DIR holds inputs.npz and descriptors/ (our protos, serialized) and gets outputs.npz.
"""

from __future__ import annotations

import queue
import sys
from pathlib import Path

import grpc
import ml_dtypes
import numpy as np
import tritonclient.grpc as tc
from google.protobuf import descriptor_pb2
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

TIMEOUT_S = 60  # every call's bound (client_timeout, stream waits)


def check_wire_compatible(descriptors: Path) -> None:
    """Every field and RPC of our protos matches tritonclient's own: name, number, type, label."""
    theirs = {**_messages(service_pb2.DESCRIPTOR), **_messages(model_config_pb2.DESCRIPTOR)}
    checked = 0
    for path in sorted(descriptors.glob("*.pb")):
        ours = descriptor_pb2.FileDescriptorProto.FromString(path.read_bytes())
        for message in _flatten(ours.message_type, ours.package):
            full_name, fields = message
            assert full_name in theirs, f"{full_name}: no such message in tritonclient"
            for field in fields:
                other = theirs[full_name].fields_by_name.get(field.name)
                assert other is not None, f"{full_name}.{field.name}: not in tritonclient's"
                assert (other.number, other.type) == (field.number, field.type), (
                    f"{full_name}.{field.name}: number/type {field.number}/{field.type}, "
                    f"tritonclient's {other.number}/{other.type}"
                )
                checked += 1
        for service in ours.service:
            theirs_service = service_pb2.DESCRIPTOR.services_by_name[service.name]
            for method in service.method:
                other = theirs_service.methods_by_name[method.name]
                assert method.input_type.lstrip(".") == other.input_type.full_name, method.name
                assert method.output_type.lstrip(".") == other.output_type.full_name, method.name
                assert method.server_streaming == other.server_streaming, method.name
                assert method.client_streaming == other.client_streaming, method.name
    assert checked > 50, f"only {checked} fields compared"


def _messages(file_descriptor) -> dict:
    found = {}
    stack = list(file_descriptor.message_types_by_name.values())
    while stack:
        message = stack.pop()
        found[message.full_name] = message
        stack.extend(message.nested_types)
    return found


def _flatten(messages, prefix: str):
    for message in messages:
        name = f"{prefix}.{message.name}"
        if not message.options.map_entry:
            yield name, list(message.field)
        yield from _flatten(message.nested_type, name)


def infer_input(x: np.ndarray, datatype: str) -> tc.InferInput:
    tensor = tc.InferInput("INPUT", list(x.shape), datatype)
    tensor.set_data_from_numpy(x)
    return tensor


def requested(weights: bool) -> list[tc.InferRequestedOutput]:
    names = ["OUTPUT", "ATTENTION_WEIGHTS"] if weights else ["OUTPUT"]
    return [tc.InferRequestedOutput(name) for name in names]


def expect_error(status: str, text: str, call, *args, **kwargs) -> None:
    try:
        call(*args, **kwargs)
    except InferenceServerException as e:
        assert e.status() == f"StatusCode.{status}", (e.status(), e.message())
        assert text in e.message(), e.message()
        return
    raise AssertionError(f"no error; expected {status} {text!r}")


def main(target: str, work: Path) -> None:
    check_wire_compatible(work / "descriptors")
    data = np.load(work / "inputs.npz")
    out: dict[str, np.ndarray] = {}
    client = tc.InferenceServerClient(target)

    # health, metadata, config
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("mha") and not client.is_model_ready("no-such-model")
    server = client.get_server_metadata()
    assert server.name == "mha-serve" and "sequence" in server.extensions
    meta = client.get_model_metadata("mha")
    assert [(t.name, list(t.shape)) for t in meta.inputs] == [("INPUT", [-1, -1, 512])]
    assert [t.name for t in meta.outputs] == ["OUTPUT", "ATTENTION_WEIGHTS"]
    as_json = client.get_model_metadata("gqa", as_json=True)
    assert as_json["name"] == "gqa" and as_json["inputs"][0]["datatype"] == "FP32"
    config = client.get_model_config("gqa").config
    assert config.name == "gqa" and list(config.input[0].dims) == [-1, -1, 512]
    assert config.parameters["num_kv_heads"].string_value == "2"
    assert config.HasField("sequence_batching")

    # stateless, FP32 and BF16, with and without weights
    x = data["x"]
    kw = {"client_timeout": TIMEOUT_S}
    r = client.infer("mha", [infer_input(x, "FP32")], outputs=requested(False), **kw)
    assert r.as_numpy("ATTENTION_WEIGHTS") is None
    out["fp32"] = r.as_numpy("OUTPUT")
    params = {"causal": True, "weight_heads": "0,3", "query_start": 1}
    r = client.infer(
        "mha", [infer_input(x, "FP32")], outputs=requested(True), parameters=params, **kw
    )
    out["fp32_weights_output"], out["fp32_weights"] = (
        r.as_numpy("OUTPUT"),
        r.as_numpy("ATTENTION_WEIGHTS"),
    )
    assert out["fp32_weights"].shape == (2, 2, 4, 5)
    xb = x.astype(ml_dtypes.bfloat16)
    r = client.infer("gqa", [infer_input(xb, "BF16")], outputs=requested(False), **kw)
    assert r.as_numpy("OUTPUT").dtype == ml_dtypes.bfloat16
    out["bf16"] = r.as_numpy("OUTPUT").astype(np.float32)
    r = client.infer(
        "gqa",
        [infer_input(xb, "BF16")],
        outputs=requested(True),
        parameters={"weights_dtype": "BF16"},
        **kw,
    )
    out["bf16_weights_output"] = r.as_numpy("OUTPUT").astype(np.float32)
    out["bf16_weights"] = r.as_numpy("ATTENTION_WEIGHTS").astype(np.float32)

    # typed contents (fp32_contents), through tritonclient's own generated stub
    with grpc.insecure_channel(target) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        tensor = service_pb2.ModelInferRequest.InferInputTensor(
            name="INPUT", datatype="FP32", shape=list(x.shape)
        )
        tensor.contents.fp32_contents.extend(x.ravel().tolist())
        reply = stub.ModelInfer(
            service_pb2.ModelInferRequest(model_name="mha", inputs=[tensor]), timeout=TIMEOUT_S
        )
        out["typed"] = np.frombuffer(reply.raw_output_contents[0], np.float32).reshape(
            reply.outputs[0].shape
        )

    # a sequence through ModelInfer (an integer id) ...
    steps = [data[f"step{i}"] for i in range(3)]
    for i, step in enumerate(steps):
        r = client.infer(
            "mqa",
            [infer_input(step, "FP32")],
            sequence_id=1001,
            sequence_start=i == 0,
            sequence_end=i == len(steps) - 1,
            **kw,
        )
        out[f"infer_step{i}"] = r.as_numpy("OUTPUT")
    expect_error(
        "INVALID_ARGUMENT",
        "sequence 1001 to model 'mqa' must specify the START flag",
        client.infer,
        "mqa",
        [infer_input(steps[0], "FP32")],
        sequence_id=1001,
        **kw,
    )

    # ... and through the stream (a string id), with an error in the middle
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    for i, step in enumerate(steps):
        client.async_stream_infer(
            "mqa",
            [infer_input(step, "FP32")],
            request_id=f"s{i}",
            sequence_id="conv-1",
            sequence_start=i == 0,
            sequence_end=i == len(steps) - 1,
        )
        if i == 0:
            client.async_stream_infer(
                "no-such-model", [infer_input(step, "FP32")], request_id="bad"
            )
    replies = [answers.get(timeout=TIMEOUT_S) for _ in range(len(steps) + 1)]
    client.stop_stream()
    errors = [e for _, e in replies if e is not None]
    assert len(errors) == 1 and "Request for unknown model: 'no-such-model'" in errors[0].message()
    results = [r for r, e in replies if e is None]
    assert [r.get_response().id for r in results] == ["s0", "s1", "s2"]
    for i, r in enumerate(results):
        out[f"stream_step{i}"] = r.as_numpy("OUTPUT")

    # Triton-style errors; the server keeps serving
    expect_error(
        "NOT_FOUND",
        "Request for unknown model: 'nope' is not found",
        client.infer,
        "nope",
        [infer_input(x, "FP32")],
        **kw,
    )
    expect_error(
        "INVALID_ARGUMENT",
        "unexpected shape for input 'INPUT' for model 'mha'",
        client.infer,
        "mha",
        [infer_input(x[..., :16].copy(), "FP32")],
        **kw,
    )
    expect_error(
        "INVALID_ARGUMENT",
        "inference input 'INPUT' data-type is 'INT32'",
        client.infer,
        "mha",
        [infer_input(x.astype(np.int32), "INT32")],
        **kw,
    )
    expect_error(
        "INVALID_ARGUMENT",
        "overflow",
        client.infer,
        "mha",
        [infer_input(np.full_like(x, 1e30), "FP32")],
        **kw,
    )
    expect_error(
        "NOT_FOUND", "Request for unknown model: 'nope'", client.get_model_metadata, "nope"
    )
    assert client.is_server_ready()
    again = client.infer("mha", [infer_input(x, "FP32")], **kw).as_numpy("OUTPUT")
    np.testing.assert_array_equal(again, out["fp32"])
    client.close()
    np.savez(work / "outputs.npz", **out)
    print("tritonclient: all checks passed")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
