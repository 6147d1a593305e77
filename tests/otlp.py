"""An OTLP/HTTP traces endpoint for the tests: what a collector receives, decoded with
OpenTelemetry's own protobuf types (ExportTraceServiceRequest)."""

from __future__ import annotations

import http.server
import secrets
import socket
import threading
from collections.abc import Callable

import pytest

from tests.helpers import free_port

trace_service_pb2 = pytest.importorskip(
    "opentelemetry.proto.collector.trace.v1.trace_service_pb2",
    reason="the OTLP protobuf types (make install's tracing extra)",
)

WAIT_S = 60.0  # for spans to arrive (the server's batches go every 50 ms here)
SERVER_KIND = 2  # opentelemetry.proto.trace.v1.Span.SpanKind.SPAN_KIND_SERVER
STATUS_ERROR = 2  # Status.StatusCode.STATUS_CODE_ERROR


class Receiver:
    """An OTLP/HTTP traces endpoint on 127.0.0.1: every span it is sent, with its resource's
    attributes, decoded."""

    def __init__(self) -> None:
        self.spans: list[tuple[dict, object]] = []  # (resource attributes, Span)
        self.paths: list[str] = []
        self._changed = threading.Condition()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
                with receiver._changed:
                    receiver.paths.append(self.path)
                    for resource_spans in request.resource_spans:
                        resource = attributes(resource_spans.resource.attributes)
                        for scope in resource_spans.scope_spans:
                            receiver.spans.extend((resource, s) for s in scope.spans)
                    receiver._changed.notify_all()
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait_for(self, match: Callable[[object], bool], count: int = 1) -> list:
        """The spans that match, once there are `count` of them (bounded by WAIT_S)."""
        with self._changed:
            found: list = []

            def enough() -> bool:
                found[:] = [(r, s) for r, s in self.spans if match(s)]
                return len(found) >= count

            assert self._changed.wait_for(enough, WAIT_S), (
                f"{len(found)} of {count} spans in {WAIT_S} s; got "
                f"{sorted({s.name for _, s in self.spans})}"
            )
            return list(found)

    def children(self, parent) -> dict[str, object]:
        with self._changed:
            return {s.name: s for _, s in self.spans if s.parent_span_id == parent.span_id}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Silent:
    """An OTLP/HTTP endpoint that takes connections and their requests and never answers (a
    collector hung, or behind a proxy that is): an export waits out its timeout."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", free_port()))
        self._held: list[socket.socket] = []
        self.endpoint = f"http://127.0.0.1:{self._listener.getsockname()[1]}/v1/traces"
        threading.Thread(target=self._hold, daemon=True).start()

    def _hold(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # closed
                return
            self._held.append(conn)

    def close(self) -> None:
        self._listener.close()
        for conn in self._held:
            conn.close()


def attributes(kvs) -> dict:
    out = {}
    for kv in kvs:
        value = kv.value
        out[kv.key] = getattr(value, value.WhichOneof("value"))
    return out


def traceparent() -> tuple[str, bytes, bytes]:
    """A sampled W3C traceparent, as a client's span sends it, and its trace and span ids."""
    trace_id, span_id = secrets.token_bytes(16), secrets.token_bytes(8)
    return f"00-{trace_id.hex()}-{span_id.hex()}-01", trace_id, span_id


def call_in(trace_id: bytes) -> Callable[[object], bool]:
    """A call's span in that trace (its queue and compute are INTERNAL)."""
    return lambda s: s.trace_id == trace_id and s.kind == SERVER_KIND
