"""OpenTelemetry traces, exported over OTLP/HTTP when OTEL_EXPORTER_OTLP_ENDPOINT is set
and entirely off otherwise (no provider, no instrumentation, no cost).

One trace per task creation: the API request (Django) → the slice message (Celery puts
the context into the message's headers) → each slice → each step → each tool call, with
httpx's client span and a `traceparent` header on outgoing HTTP, and the same header on
calls to remote MCP servers. A slice's successor message is sent from inside the slice,
so the task's later slices stay in its trace; a slice rung from elsewhere (the reaper
after a crash, steering, a redrive) joins it through the traceparent kept on the task
row (tasks_app/telemetry.py). The exporter reads the standard OTEL_*
variables (endpoint, headers, timeouts, OTEL_BSP_* batching); OTEL_SERVICE_NAME
overrides the service name each process gives itself.
"""

from __future__ import annotations

import os
import socket
from typing import Any

_configured: dict[str, int] = {}  # the pid of the process that configured tracing


def enabled() -> bool:
    return bool(os.getenv("OTEL_EXPORTER_OTLP_ENDPOINT"))


def configure(service: str) -> bool:
    """Once per process (per pool process in workers: the exporter's thread does not survive
    a fork). False, and nothing done, when no endpoint is configured."""
    if not enabled():
        return False
    if _configured.get("pid") == os.getpid():
        return True
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.instrumentation.celery import CeleryInstrumentor
    from opentelemetry.instrumentation.httpx import HTTPXClientInstrumentor
    from opentelemetry.instrumentation.psycopg import PsycopgInstrumentor
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create(
        {
            "service.name": os.getenv("OTEL_SERVICE_NAME") or service,
            "service.instance.id": f"{socket.gethostname()}:{os.getpid()}",
        }
    )
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    for instrumentor in (CeleryInstrumentor(), HTTPXClientInstrumentor(), PsycopgInstrumentor()):
        if not instrumentor.is_instrumented_by_opentelemetry:
            instrumentor.instrument()
    _configured["pid"] = os.getpid()
    return True


def configure_web() -> None:
    """From runtime_site/asgi.py, before Django loads: the Django instrumentation adds its
    middleware to settings.MIDDLEWARE when it is switched on."""
    if configure("runtime-web"):
        from opentelemetry.instrumentation.django import DjangoInstrumentor

        if not DjangoInstrumentor().is_instrumented_by_opentelemetry:
            DjangoInstrumentor().instrument()


def flush() -> None:
    """Export what is buffered (a worker process about to exit)."""
    from opentelemetry import trace

    provider: Any = trace.get_tracer_provider()
    if hasattr(provider, "force_flush"):
        provider.force_flush(timeout_millis=5000)


def trace_headers() -> dict[str, str]:
    """`traceparent` (and `tracestate`) of the current span, for a request httpx does not send
    (the official MCP client's own HTTP stack). Empty when tracing is off."""
    from opentelemetry import propagate

    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier
