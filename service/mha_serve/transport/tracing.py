"""OpenTelemetry traces of the calls a server answers (ServerConfig.tracing_endpoint).

Off by default, and then free: `SPANS` is None and a call pays one test of it. On, every call
that settles (answer.settle: both protocols, every method, each message of a StreamSession)
is a SERVER span named as gRPC's instrumentation names it ("mha.v1.AttentionService/Attend"),
a child of the client's span when its metadata carries W3C `traceparent` (and `tracestate`),
with gRPC's semantic attributes (rpc.system, rpc.service, rpc.method, rpc.grpc.status_code;
status ERROR only for the codes that are the server's failure, SERVER_ERRORS), the model,
and for a computation (Attend, a session step, ModelInfer) two child spans, `queue` and
`compute`, placed by the reply's own timing (Timing: receipt to compute, the
forward) with the batch size and the session. Spans go to an OTLP/HTTP collector
(Jaeger, Tempo, the OpenTelemetry Collector: `http://HOST:4318/v1/traces`) in batches, off
the event loop (the SDK's BatchSpanProcessor thread); sampling is the client's decision when
it sent one (ParentBased), else tracing_sample_ratio of the traces that start here.

Each process that answers calls exports its own spans: the server, each frontend worker
(`--frontend-workers`), each Ray replica. The OpenTelemetry SDK and its OTLP exporter are the
`tracing` extra (`pip install 'mha-serve[tracing]'`); imported only when tracing is on.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
from contextvars import ContextVar
from typing import Any

from mha_serve.serving.protocol import Timing

log = logging.getLogger(__name__)

EXTRA = (
    "pip install 'mha-serve[tracing]' (opentelemetry-sdk, opentelemetry-exporter-otlp-proto-http)"
)
# The gRPC service of each protocol label (metrics.PROTOCOL_*), for the spans' names.
SERVICES = {"mha.v1": "mha.v1.AttentionService", "kserve-v2": "inference.GRPCInferenceService"}
# The statuses that make a server's span an ERROR (OpenTelemetry's semantic conventions for
# gRPC server spans, and opentelemetry-instrumentation-grpc's server): the server failed. The
# others are the client's (a bad argument, an unknown model or session, a limit, a cancel):
# the call was answered as it should be, its span's status left unset.
SERVER_ERRORS = frozenset(
    {"UNKNOWN", "DEADLINE_EXCEEDED", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS"}
)
# How long a stop waits for the collector to take the spans still held. A collector takes
# them in milliseconds; one down or hung would hold the stop for the SDK's own bound (30 s,
# each batch retried up to OTEL_EXPORTER_OTLP_TRACES_TIMEOUT): past Kubernetes'
# terminationGracePeriodSeconds (deploy/k8s: 30 s, preStop and grace_period_s within it) and
# past the STOP_MARGIN_S after which the engine process kills a frontend (workers.py).
STOP_FLUSH_S = 3.0


class Spans:
    """The tracer of a process and what its spans share."""

    def __init__(self, endpoint: str, sample_ratio: float, role: str) -> None:
        check_installed(endpoint)  # (what each import below needs)
        from importlib.metadata import PackageNotFoundError, version

        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        try:
            release = version("mha-serve")
        except PackageNotFoundError:  # run from a checkout that was never installed
            release = "unknown"
        resource = Resource.create(
            {
                "service.name": os.environ.get("OTEL_SERVICE_NAME", "mha-serve"),
                "service.version": release,
                "service.instance.id": f"{socket.gethostname()}:{os.getpid()}",
                "mha_serve.role": role,
            }
        )
        self.provider = TracerProvider(
            resource=resource, sampler=ParentBased(TraceIdRatioBased(sample_ratio))
        )
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self.tracer = self.provider.get_tracer("mha_serve")
        self.propagator = TraceContextTextMapPropagator()
        self.server_kind = SpanKind.SERVER
        self.error = lambda details: Status(StatusCode.ERROR, details)
        self.in_context = set_span_in_context

    def start(self, method: str, model: str, protocol: str, context: Any) -> Any:
        """A call's span, started now and current (note() writes to it) until end()."""
        carrier = {}
        try:
            for key, value in context.invocation_metadata() or ():
                if key in ("traceparent", "tracestate"):
                    carrier[key] = value
        except Exception:  # a context without metadata: a trace of its own
            pass
        service = SERVICES.get(protocol, protocol)
        attributes = {
            "rpc.system": "grpc",
            "rpc.service": service,
            "rpc.method": method,
            "mha.protocol": protocol,
        }
        if model:
            attributes["mha.model"] = model
        span = self.tracer.start_span(
            f"{service}/{method}",
            context=self.propagator.extract(carrier) if carrier else None,
            kind=self.server_kind,
            attributes=attributes,
        )
        return span, _CURRENT.set(span)

    def end(self, started: Any, code: int, name: str, details: str | None) -> None:
        span, token = started
        _CURRENT.reset(token)
        span.set_attribute("rpc.grpc.status_code", code)
        if details is not None:  # refused, or cancelled
            span.set_attribute("mha.status_details", f"{name}: {details}")
            if name in SERVER_ERRORS:
                span.set_attribute("error.type", name)
                span.set_status(self.error(f"{name}: {details}"))
        span.end()

    def note(self, timing: Timing, session_id: str) -> None:
        """The current call's reply timing: its attributes, and `queue` and `compute` as
        child spans, placed from the call's start by the reply's own durations."""
        span = _CURRENT.get()
        if span is None or not span.is_recording():
            return
        span.set_attributes(
            {
                "mha.queue_ms": timing.queue_ms,
                "mha.compute_ms": timing.compute_ms,
                "mha.server_ms": timing.total_ms,
                "mha.batch_size": timing.batch_size,
            }
        )
        if session_id:
            span.set_attribute("mha.session_id", session_id)
        if timing.restore_ms:
            span.set_attribute("mha.restore_ms", timing.restore_ms)
        # The reply's durations count from the call's receipt, which is the span's start
        # (to within the request's conversion).
        start = span.start_time
        queued = start + int(timing.queue_ms * 1e6)
        computed = queued + int(timing.compute_ms * 1e6)
        parent = self.in_context(span)
        self.tracer.start_span("queue", context=parent, start_time=start).end(end_time=queued)
        compute = self.tracer.start_span(
            "compute",
            context=parent,
            start_time=queued,
            attributes={"mha.batch_size": timing.batch_size},
        )
        compute.end(end_time=computed)

    def shutdown(self) -> None:
        """Sends what is held, then stops (the SDK waits up to 30 s on a collector that does
        not answer: stop() bounds it)."""
        started = time.monotonic()
        self.provider.shutdown()
        log.debug("tracing stopped in %.3f s", time.monotonic() - started)


_CURRENT: ContextVar[Any] = ContextVar("mha_serve_span", default=None)
SPANS: Spans | None = None  # this process's tracer, when tracing is on


def check_installed(endpoint: str) -> None:
    """ValueError saying what to install when tracing is asked for and OpenTelemetry's SDK
    or its OTLP/HTTP exporter is missing."""
    if not endpoint:
        return
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as e:
        raise ValueError(
            f"tracing_endpoint is set but OpenTelemetry is not installed ({e.name}): {EXTRA}"
        ) from None


def start(endpoint: str, sample_ratio: float, role: str) -> None:
    """Tracing on for this process (endpoint: empty, off). Raises ValueError, saying what to
    install, when OpenTelemetry is not."""
    global SPANS
    if not endpoint or SPANS is not None:
        return
    SPANS = Spans(endpoint, sample_ratio, role)
    log.info(
        "tracing: spans to %s (%s of the traces that start here; a client's decision when "
        "it sent traceparent)",
        endpoint,
        f"{sample_ratio:g}",
    )


async def stop(flush_s: float = STOP_FLUSH_S) -> None:
    """Tracing off for this process: the spans still held are sent, waited for at most
    flush_s, off the event loop (the rest, with a collector down or hung, are dropped)."""
    global SPANS
    spans, SPANS = SPANS, None
    if spans is None:
        return
    done = threading.Event()

    def shutdown() -> None:
        try:
            spans.shutdown()
        finally:
            done.set()

    # A daemon thread of its own: one still waiting on the collector must not hold the exit
    # (an executor's threads are joined at exit; the SDK's own exporting thread is a daemon).
    threading.Thread(target=shutdown, name="tracing-stop", daemon=True).start()
    if not await asyncio.to_thread(done.wait, flush_s):
        log.warning(
            "tracing: the collector did not take the last spans within %.1f s; dropped",
            flush_s,
        )


def note(timing: Timing, session_id: str = "") -> None:
    """The current call's reply timing (a no-op when tracing is off)."""
    if SPANS is not None:
        SPANS.note(timing, session_id)
