"""OpenTelemetry traces (--tracing-endpoint): a real `mha-serve` process exporting OTLP/HTTP to
a receiver in the test that decodes what it is sent with OpenTelemetry's own protobuf types
(ExportTraceServiceRequest), as a collector does. Calls carry W3C traceparent as a client's
instrumentation sends it; the spans must join that trace, name the call as gRPC's
instrumentation does, carry its status, and place `queue` and `compute` by the reply's timing.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
from pathlib import Path

import grpc
import numpy as np
import pytest

from mha_client.api import attention_pb2 as pb
from mha_client.api import attention_pb2_grpc as pb_grpc
from mha_client.api.inference import grpc_service_pb2 as oip_pb
from mha_client.api.inference import grpc_service_pb2_grpc as oip_grpc
from mha_client.tensors import to_proto
from mha_serve.config import build_config
from mha_serve.engine.errors import InvalidRequest, ModelNotFound
from mha_serve.serving import Unavailable
from tests.helpers import ServerProcess

pytest.importorskip(
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    reason="the OTLP/HTTP exporter (make install's tracing extra)",
)
from tests.otlp import (  # noqa: E402
    SERVER_KIND,
    STATUS_ERROR,
    Receiver,
    Silent,
    attributes,
    call_in,
    traceparent,
)


@pytest.fixture(scope="module")
def receiver():
    r = Receiver()
    yield r
    r.close()


def start_server(receiver: Receiver, tmp: Path, *args: str) -> ServerProcess:
    proc = ServerProcess(
        "--tracing-endpoint",
        receiver.endpoint,
        *args,
        env={"OTEL_BSP_SCHEDULE_DELAY": "50"},  # the SDK's batches every 50 ms, not 5 s
        log_path=tmp / "mha-serve.log",
    )
    proc.wait_serving()
    return proc


@pytest.fixture(scope="module", params=["1", "2"], ids=["one-process", "frontend-workers-2"])
def served(receiver, tmp_path_factory, request):
    proc = start_server(
        receiver, tmp_path_factory.mktemp("tracing"), "--frontend-workers", request.param
    )
    try:
        with grpc.insecure_channel(proc.target) as channel:
            yield proc, channel, request.param
    finally:
        assert proc.stop() == 0, proc.log()


def rows(n: int) -> pb.Tensor:
    return to_proto(np.random.default_rng(n).standard_normal((n, 512)).astype(np.float32))


def test_an_attend_joins_the_clients_trace_with_its_queue_and_compute(receiver, served):
    _, channel, workers = served
    header, trace_id, parent_id = traceparent()
    stub = pb_grpc.AttentionServiceStub(channel)
    reply = stub.Attend(
        pb.AttendRequest(model="gqa", input=rows(6)), metadata=(("traceparent", header),)
    )
    [(resource, span)] = receiver.wait_for(call_in(trace_id))
    assert span.name == "mha.v1.AttentionService/Attend"
    assert span.parent_span_id == parent_id and span.kind == SERVER_KIND
    attrs = attributes(span.attributes)
    assert attrs["rpc.system"] == "grpc"
    assert attrs["rpc.service"] == "mha.v1.AttentionService"
    assert attrs["rpc.method"] == "Attend"
    assert attrs["rpc.grpc.status_code"] == 0
    assert attrs["mha.model"] == "gqa"
    assert attrs["mha.batch_size"] == reply.timing.batch_size
    assert attrs["mha.compute_ms"] == pytest.approx(reply.timing.compute_ms)
    assert span.status.code != STATUS_ERROR
    assert resource["service.name"] == "mha-serve"
    assert resource["mha_serve.role"] == ("server" if workers == "1" else "frontend")
    # queue then compute, children of the call, as long as the reply says (to the ns)
    children = receiver.wait_for(lambda s: s.parent_span_id == span.span_id, count=2)
    kids = {s.name: s for _, s in children}
    queue, compute = kids["queue"], kids["compute"]
    assert queue.trace_id == compute.trace_id == trace_id
    assert queue.start_time_unix_nano == span.start_time_unix_nano
    assert queue.end_time_unix_nano == compute.start_time_unix_nano
    assert (
        abs((queue.end_time_unix_nano - queue.start_time_unix_nano) * 1e-6 - reply.timing.queue_ms)
        < 1e-5
    )
    compute_ms = (compute.end_time_unix_nano - compute.start_time_unix_nano) * 1e-6
    assert abs(compute_ms - reply.timing.compute_ms) < 1e-5
    assert compute.end_time_unix_nano <= span.end_time_unix_nano


def test_a_refused_call_carries_its_status_and_why(receiver, served):
    """An unknown model is the client's error: its status and message on the span, the span's
    status not ERROR (gRPC's semantic conventions for a server span)."""
    _, channel, _ = served
    header, trace_id, _ = traceparent()
    stub = pb_grpc.AttentionServiceStub(channel)
    with pytest.raises(grpc.RpcError) as e:
        stub.Attend(
            pb.AttendRequest(model="no-such-model", input=rows(2)),
            metadata=(("traceparent", header),),
        )
    [(_, span)] = receiver.wait_for(call_in(trace_id))
    code = e.value.code()
    attrs = attributes(span.attributes)
    assert attrs["rpc.grpc.status_code"] == code.value[0] == grpc.StatusCode.NOT_FOUND.value[0]
    assert attrs["mha.status_details"].startswith("NOT_FOUND: ")
    assert "no-such-model" in attrs["mha.status_details"]
    assert span.status.code != STATUS_ERROR and "error.type" not in attrs
    assert not receiver.children(span), "a refused call computed nothing"


@pytest.mark.parametrize(
    ("raised", "expired", "code", "failed"),
    [
        (ModelNotFound("model 'x' is not served here"), False, "NOT_FOUND", False),
        (InvalidRequest("input has 3 dims"), False, "INVALID_ARGUMENT", False),
        (asyncio.CancelledError(), False, "CANCELLED", False),  # the client went away
        (Unavailable("the server is still loading"), False, "UNAVAILABLE", True),
        (asyncio.CancelledError(), True, "DEADLINE_EXCEEDED", True),
        (RuntimeError("a bug"), False, "INTERNAL", True),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
async def test_a_span_is_an_error_only_when_the_server_failed(
    receiver, raised, expired, code, failed
):
    """OpenTelemetry's gRPC server spans: ERROR (and error.type) for UNKNOWN,
    DEADLINE_EXCEEDED, UNIMPLEMENTED, INTERNAL, UNAVAILABLE and DATA_LOSS; a client's error
    leaves the status unset. Every outcome names its status and why (mha.status_details)."""
    from mha_serve.transport import tracing
    from mha_serve.transport.answer import settle

    model = f"model-{secrets.token_hex(4)}"  # this case's span, among the module's

    async def handle() -> None:
        raise raised

    tracing.start(receiver.endpoint, 1.0, "test")
    try:
        with contextlib.suppress(asyncio.CancelledError):
            await settle("Attend", model, handle, protocol="mha.v1", expired=lambda: expired)
    finally:
        await tracing.stop()  # sends the span
    [(_, span)] = receiver.wait_for(lambda s: attributes(s.attributes).get("mha.model") == model)
    attrs = attributes(span.attributes)
    assert attrs["rpc.grpc.status_code"] == grpc.StatusCode[code].value[0]
    assert attrs["mha.status_details"].startswith(f"{code}: ")
    assert (span.status.code == STATUS_ERROR) is failed
    assert attrs.get("error.type") == (code if failed else None)


def test_each_step_of_a_stream_is_a_span_naming_its_session(receiver, served):
    _, channel, _ = served
    stub = pb_grpc.AttentionServiceStub(channel)
    session = stub.CreateSession(pb.CreateSessionRequest(model="mha"))
    header, trace_id, parent_id = traceparent()
    steps = [pb.AttendRequest(session_id=session.session_id, input=rows(1)) for _ in range(3)]
    replies = list(stub.StreamSession(iter(steps), metadata=(("traceparent", header),)))
    assert [r.session.num_tokens for r in replies] == [1, 2, 3]
    spans = receiver.wait_for(call_in(trace_id), count=3)
    for _, span in spans:
        attrs = attributes(span.attributes)
        assert span.name == "mha.v1.AttentionService/StreamSession"
        assert span.parent_span_id == parent_id
        assert attrs["mha.session_id"] == session.session_id
        assert attrs["rpc.grpc.status_code"] == 0
    stub.CloseSession(pb.CloseSessionRequest(session_id=session.session_id))


def test_the_open_inference_protocol_is_traced_too(receiver, served):
    _, channel, _ = served
    header, trace_id, _ = traceparent()
    x = np.ones((1, 3, 512), np.float32)
    request = oip_pb.ModelInferRequest(
        model_name="mha",
        inputs=[
            oip_pb.ModelInferRequest.InferInputTensor(name="INPUT", datatype="FP32", shape=x.shape)
        ],
        raw_input_contents=[x.tobytes()],
    )
    oip_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
        request, metadata=(("traceparent", header),)
    )
    [(_, span)] = receiver.wait_for(call_in(trace_id))
    assert span.name == "inference.GRPCInferenceService/ModelInfer"
    assert attributes(span.attributes)["mha.model"] == "mha"
    assert set(receiver.children(span)) == {"queue", "compute"}


def test_each_message_of_a_model_stream_infer_is_a_span(receiver, served):
    """ModelStreamInfer's messages compute concurrently, each in a task of its own
    (oip/stream.py): each is a span of the stream's trace with its own queue and compute; a
    message's error (Triton's: error_message, the stream goes on) names its status."""
    _, channel, _ = served
    header, trace_id, parent_id = traceparent()

    def message(model: str, n: int) -> oip_pb.ModelInferRequest:
        x = np.full((1, n, 512), 0.5, np.float32)
        tensor = oip_pb.ModelInferRequest.InferInputTensor(
            name="INPUT", datatype="FP32", shape=x.shape
        )
        return oip_pb.ModelInferRequest(
            model_name=model, id=f"{model}-{n}", inputs=[tensor], raw_input_contents=[x.tobytes()]
        )

    messages = [message("gqa", n) for n in (1, 2, 3)] + [message("no-such-model", 1)]
    stub = oip_grpc.GRPCInferenceServiceStub(channel)
    replies = list(stub.ModelStreamInfer(iter(messages), metadata=(("traceparent", header),)))
    assert [bool(r.error_message) for r in replies] == [False, False, False, True]
    spans = [s for _, s in receiver.wait_for(call_in(trace_id), count=4)]
    assert {s.name for s in spans} == {"inference.GRPCInferenceService/ModelStreamInfer"}
    assert all(s.parent_span_id == parent_id for s in spans)
    refused = [s for s in spans if attributes(s.attributes)["rpc.grpc.status_code"] != 0]
    [failed] = refused
    assert "no-such-model" in attributes(failed.attributes)["mha.status_details"]
    for span in spans:
        if span is not failed:
            assert set(receiver.children(span)) == {"queue", "compute"}


def test_the_sample_ratio_records_traces_that_start_here_and_the_clients_own(receiver, tmp_path):
    """Ratio 0: a call without traceparent leaves no span; a client's sampled trace is
    recorded all the same (ParentBased). The server's stop sends what it buffered."""
    proc = start_server(receiver, tmp_path, "--tracing-sample-ratio", "0")
    header, trace_id, _ = traceparent()
    try:
        with grpc.insecure_channel(proc.target) as channel:
            stub = pb_grpc.AttentionServiceStub(channel)
            stub.ListModels(pb.ListModelsRequest())  # no traceparent: not sampled
            stub.GetModelInfo(
                pb.GetModelInfoRequest(name="mqa"), metadata=(("traceparent", header),)
            )
    finally:
        assert proc.stop() == 0, proc.log()
    [(resource, span)] = receiver.wait_for(call_in(trace_id))
    assert span.name == "mha.v1.AttentionService/GetModelInfo"
    pid = resource["service.instance.id"].rsplit(":", 1)[1]
    assert pid == str(proc.proc.pid)
    mine = [s for r, s in receiver.spans if r["service.instance.id"].endswith(f":{pid}")]
    assert [s.name for s in mine] == ["mha.v1.AttentionService/GetModelInfo"]


@pytest.mark.parametrize("workers", ["1", "2"], ids=["one-process", "frontend-workers-2"])
def test_a_collector_that_never_answers_does_not_hold_the_stop(tmp_path, workers):
    """The spans still held at a stop are sent but waited for only tracing.STOP_FLUSH_S: the
    SDK alone waits 30 s on a hung collector, past the margin after which the engine process
    kills a frontend (workers.STOP_MARGIN_S) and Kubernetes its pod."""
    from mha_serve.transport.workers import STOP_MARGIN_S

    silent = Silent()
    proc = ServerProcess(
        "--tracing-endpoint",
        silent.endpoint,
        "--frontend-workers",
        workers,
        "--grace-period-s",
        "1",
        env={"OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "600"},  # each export waits 10 min
        log_path=tmp_path / "mha-serve.log",
    )
    try:
        proc.wait_serving()
        with grpc.insecure_channel(proc.target) as channel:
            pb_grpc.AttentionServiceStub(channel).ListModels(pb.ListModelsRequest())
    finally:
        code = proc.stop(timeout=STOP_MARGIN_S)  # SIGKILL (-9) past it
        silent.close()
    log = proc.log()
    assert code == 0, log
    assert "still running" not in log, "a frontend was killed"
    assert "the collector did not take the last spans" in log


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"tracing_endpoint": "otel-collector:4318"}, "not an http:// or https:// URL"),
        # the exporter posts to the URL as given: "/", which a collector answers 404
        ({"tracing_endpoint": "http://c:4318"}, r"no path.*http://c:4318/v1/traces"),
        ({"tracing_endpoint": "https://c:4318/"}, r"no path.*https://c:4318/v1/traces"),
        ({"tracing_endpoint": "http://c:4318/v1/traces", "tracing_sample_ratio": "1.5"}, "0 to 1"),
    ],
)
def test_bad_tracing_settings_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        build_config(None, overrides)


def test_tracing_without_opentelemetry_says_what_to_install(monkeypatch):
    from mha_serve.transport import tracing

    monkeypatch.setitem(os.sys.modules, "opentelemetry.sdk.trace", None)
    with pytest.raises(ValueError, match=r"mha-serve\[tracing\]"):
        tracing.check_installed("http://127.0.0.1:4318/v1/traces")
    tracing.check_installed("")  # off: nothing to import


def test_the_sdk_propagates_the_callers_trace_to_calls_and_streams(receiver, served):
    """Client(propagate_trace=True): each call, and a stream as it opens, carries the trace
    context current in the caller; outside any span it sends none (the server's span is a
    root of its own)."""
    from opentelemetry.sdk.trace import TracerProvider

    from mha_client.sdk import Client

    proc, _, _ = served
    tracer = TracerProvider().get_tracer("test")  # the caller's own spans, not exported
    x = np.random.default_rng(9).standard_normal((2, 512)).astype(np.float32)
    with Client(proc.target, propagate_trace=True) as client:
        with tracer.start_as_current_span("caller") as caller:
            client.attend("mha", x)
            session = client.create_session("mqa")
            with session.stream() as stream:
                stream.step(x[:1])
        lone = client.attend("gqa", x)
    ids = caller.get_span_context()
    trace_id, span_id = ids.trace_id.to_bytes(16, "big"), ids.span_id.to_bytes(8, "big")
    spans = receiver.wait_for(call_in(trace_id), count=3)
    names = sorted(s.name.rsplit("/", 1)[1] for _, s in spans)
    assert names == ["Attend", "CreateSession", "StreamSession"]
    assert all(s.parent_span_id == span_id for _, s in spans)
    [(_, root)] = receiver.wait_for(
        lambda s: (
            s.kind == SERVER_KIND
            and s.name.endswith("/Attend")
            and attributes(s.attributes).get("mha.model") == "gqa"
            and attributes(s.attributes).get("mha.compute_ms") == lone.timing.compute_ms
        )
    )
    assert root.parent_span_id == b"" and root.trace_id != trace_id
