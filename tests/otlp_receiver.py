"""A real OTLP/HTTP trace receiver for tests: POST /v1/traces with a protobuf
ExportTraceServiceRequest (as the official exporter sends it), decoded with
opentelemetry-proto and kept as plain dicts."""

from __future__ import annotations

import gzip
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind in ("string_value", "bool_value", "int_value", "double_value") else None


class OtlpReceiver:
    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.requests = 0
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces" or self.headers.get("Content-Type") != "application/x-protobuf":
                    self.send_response(404)
                    self.end_headers()
                    return
                receiver._add(ExportTraceServiceRequest.FromString(body))
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def _add(self, request: ExportTraceServiceRequest) -> None:
        spans = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    spans.append(
                        {
                            "service": resource.get("service.name"),
                            "trace_id": span.trace_id.hex(),
                            "span_id": span.span_id.hex(),
                            "parent_id": span.parent_span_id.hex(),
                            "name": span.name,
                            "kind": span.kind,
                            "start": span.start_time_unix_nano,
                            "end": span.end_time_unix_nano,
                            "attributes": {a.key: _value(a.value) for a in span.attributes},
                            "status": span.status.code,
                            "links": [(link.trace_id.hex(), link.span_id.hex()) for link in span.links],
                        }
                    )
        with self._lock:
            self.spans += spans
            self.requests += 1

    def trace(self, trace_id: str) -> list[dict[str, Any]]:
        with self._lock:
            return [s for s in self.spans if s["trace_id"] == trace_id]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def render(spans: list[dict[str, Any]], attributes: tuple[str, ...] = ()) -> str:
    """The span tree as indented text: name [service] key=value ..."""
    children: dict[str, list[dict[str, Any]]] = {}
    ids = {s["span_id"] for s in spans}
    for span in sorted(spans, key=lambda s: s["start"]):
        children.setdefault(span["parent_id"] if span["parent_id"] in ids else "", []).append(span)
    lines: list[str] = []

    def walk(parent: str, depth: int) -> None:
        for span in children.get(parent, []):
            shown = " ".join(f"{k}={span['attributes'][k]}" for k in attributes if k in span["attributes"])
            ms = (span["end"] - span["start"]) / 1e6
            lines.append(f"{'  ' * depth}{span['name']} [{span['service']}] {ms:.1f} ms {shown}".rstrip())
            walk(span["span_id"], depth + 1)

    walk("", 0)
    return "\n".join(lines)
