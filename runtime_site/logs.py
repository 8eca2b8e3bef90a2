"""Logs as JSON lines (RUNTIME_LOG_FORMAT=json; compose and the image set it).

Every line carries what it happened for — the task, its tenant and agent, the step — as
set by the engine's observation points (tasks_app/telemetry.py), the trace and span it
happened in (when tracing is on), and the process that wrote it ("worker": host:pid, for
the web process too). Messages and structured fields pass through the same redaction as
events (tasks_app/redaction.py): secret-looking keys and token-like values are masked.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any

# What the current code works on: task_id, tenant, agent, step.
# The default is never mutated: log_context sets a new dict each time.
_context: ContextVar[dict[str, Any]] = ContextVar("runtime_log_context", default={})  # noqa: B039


@contextmanager
def about(**fields: Any) -> Iterator[None]:
    """Log lines written inside carry these fields (on top of the enclosing ones)."""
    token = _context.set({**_context.get(), **{k: v for k, v in fields.items() if v is not None}})
    try:
        yield
    finally:
        _context.reset(token)


def _trace_ids() -> dict[str, str]:
    from opentelemetry import trace

    span_context = trace.get_current_span().get_span_context()
    if not span_context.is_valid:
        return {}
    return {"trace_id": f"{span_context.trace_id:032x}", "span_id": f"{span_context.span_id:016x}"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        from tasks_app.redaction import redact

        line: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": redact(record.getMessage()),
            **_context.get(),
            **_trace_ids(),
            "worker": f"{socket.gethostname()}:{os.getpid()}",
        }
        if data := getattr(record, "data", None):  # logger.info(..., extra={"data": {...}})
            line["data"] = redact(data)
        if record.exc_info:
            line["exception"] = redact(self.formatException(record.exc_info))
        return json.dumps(line, default=str)
