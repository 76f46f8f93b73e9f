"""A local OTLP/HTTP trace collector for the tests: receives what vLLM's exporter sends
(``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf``, vllm/tracing/otel.py) and decodes it with
``opentelemetry-proto`` (installed with vLLM's tracing dependencies)."""

from __future__ import annotations

import http.server
import threading
import time

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


class Collector:
    """Listens on 127.0.0.1:``port``; ``endpoint`` is the URL for ``--otlp-traces-endpoint``; ``spans`` every
    span received, as the protobuf ``Span`` objects."""

    def __init__(self) -> None:
        spans = self.spans = []
        lock = self._lock = threading.Lock()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                request = ExportTraceServiceRequest.FromString(self.rfile.read(int(self.headers["Content-Length"])))
                with lock:
                    for resource in request.resource_spans:
                        for scope in resource.scope_spans:
                            spans.extend(scope.spans)
                body = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def wait_for(self, predicate, timeout_s: float = 30.0):
        """The first received span for which ``predicate(span)`` is true; AssertionError after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                found = [s for s in self.spans if predicate(s)]
            if found:
                return found[0]
            time.sleep(0.1)
        with self._lock:
            names = sorted({s.name for s in self.spans})
        raise AssertionError(f"no matching span within {timeout_s} s; span names received: {names}")

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
