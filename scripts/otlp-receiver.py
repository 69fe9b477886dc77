"""A minimal OTLP/HTTP trace receiver for the tests: decodes each export with OpenTelemetry's own
protobuf definitions (PyPI `opentelemetry-proto`), strictly — an unknown field, a wrong type or an
id of the wrong length is a 400 — and appends the spans it got to a JSON-lines file.

OTLP/JSON differs from protobuf's JSON mapping in one point: trace and span ids are hex, not
base64 (https://opentelemetry.io/docs/specs/otlp/#json-protobuf-encoding); they are converted
before parsing, as the Collector does.

Usage: otlp-receiver.py PORT OUT.jsonl
"""

import base64
import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span

port, out = int(sys.argv[1]), sys.argv[2]
IDS = {"traceId": 16, "spanId": 8, "parentSpanId": 8}


def ids_to_base64(span):
    for key, size in IDS.items():
        if key in span:
            raw = bytes.fromhex(span[key])
            if len(raw) != size:
                raise ValueError(f"{key} {span[key]!r} is not {size} bytes")
            span[key] = base64.b64encode(raw).decode()


def value(v):
    return next(iter(json_format.MessageToDict(v).values()), None)


class Handler(BaseHTTPRequestHandler):
    def do_POST(self):
        if self.path != "/v1/traces":
            return self.answer(404, {"error": "not /v1/traces"})
        if self.headers.get("content-type") != "application/json":
            return self.answer(415, {"error": "expected application/json"})
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        try:
            for rs in body.get("resourceSpans", []):
                for ss in rs.get("scopeSpans", []):
                    for span in ss.get("spans", []):
                        ids_to_base64(span)
            request = json_format.ParseDict(body, ExportTraceServiceRequest())
        except (ValueError, json_format.ParseError) as e:
            return self.answer(400, {"error": str(e)})
        with open(out, "a") as f:
            for rs in request.resource_spans:
                resource = {a.key: value(a.value) for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        f.write(json.dumps({
                            "service": resource.get("service.name"),
                            "trace_id": s.trace_id.hex(),
                            "span_id": s.span_id.hex(),
                            "parent_span_id": s.parent_span_id.hex(),
                            "name": s.name,
                            "kind": Span.SpanKind.Name(s.kind),
                            "start": s.start_time_unix_nano,
                            "end": s.end_time_unix_nano,
                            "status": s.status.code,
                            "attributes": {a.key: value(a.value) for a in s.attributes},
                        }) + "\n")
        self.answer(200, {})

    def answer(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
