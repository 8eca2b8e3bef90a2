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

A process that stops flushes its spans for at most SHUTDOWN_SECONDS: with the collector
down, the SDK would wait out the exporter's retries (OTEL_EXPORTER_OTLP_TIMEOUT, 10 s per
batch) and a worker told to stop took 13 to 15 s to exit. Spans are worth less than a
prompt deploy: what is not out by then is dropped.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import threading
from typing import Any

logger = logging.getLogger(__name__)
SHUTDOWN_SECONDS = 2.0
_configured: dict[str, Any] = {}  # the pid of the process that configured tracing, and its exporter


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
    # Not the SDK's own exit hook: it waits for as long as the exporter retries (shutdown()).
    provider = TracerProvider(resource=resource, shutdown_on_exit=False)
    exporter = OTLPSpanExporter()
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    atexit.register(shutdown)
    for instrumentor in (CeleryInstrumentor(), HTTPXClientInstrumentor(), PsycopgInstrumentor()):
        if not instrumentor.is_instrumented_by_opentelemetry:
            instrumentor.instrument()
    _configured.update(pid=os.getpid(), provider=provider, exporter=exporter)
    return True


def configure_web() -> None:
    """From runtime_site/asgi.py, before Django loads: the Django instrumentation adds its
    middleware to settings.MIDDLEWARE when it is switched on."""
    if configure("runtime-web"):
        from opentelemetry.instrumentation.django import DjangoInstrumentor

        if not DjangoInstrumentor().is_instrumented_by_opentelemetry:
            DjangoInstrumentor().instrument()


def shutdown(timeout: float = SHUTDOWN_SECONDS) -> None:
    """Export what is buffered, for at most `timeout` seconds: a process about to exit (a
    worker's pool process, and any process at exit). The SDK's own shutdown and flush
    ignore their timeouts while the exporter retries an unreachable collector, so it runs
    on a thread of its own; past the deadline the exporter is shut down, which ends its
    retries (a request in flight is left to its daemon thread), and the rest is dropped."""
    if _configured.get("pid") != os.getpid():
        return  # tracing off, already shut down, or configured by this forked process's parent
    del _configured["pid"]
    flushing = threading.Thread(target=_configured["provider"].shutdown, name="otel-shutdown", daemon=True)
    flushing.start()
    flushing.join(timeout)
    if flushing.is_alive():
        logger.warning(
            "tracing: spans not exported within %.1f s of stopping (collector unreachable?): dropped", timeout
        )
        _configured["exporter"].shutdown()


def trace_headers() -> dict[str, str]:
    """`traceparent` (and `tracestate`) of the current span, for a request httpx does not send
    (the official MCP client's own HTTP stack). Empty when tracing is off."""
    from opentelemetry import propagate

    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier
