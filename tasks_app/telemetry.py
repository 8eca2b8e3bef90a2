"""The engine's observation points, in one place: a slice, a step, a tool call.

Each is a context manager or a wrapper that the Celery task, the engine and the tool
registry put around what they already do, so that what is measured (metrics, spans:
runtime_site/metrics.py, runtime_site/tracing.py) stays out of the code that does the work.
Spans cost next to nothing while tracing is off: the API's tracer then records nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any
from uuid import UUID

from opentelemetry import context, trace
from opentelemetry.trace import Span, StatusCode

from runtime_site import logs, metrics, tracing
from tasks_app.agents import base as agents

tracer = trace.get_tracer("runtime")
_NO_SPAN = nullcontext(trace.INVALID_SPAN)  # records nothing; reusable
# Span attributes (and log fields) that name what a span worked on.
TASK_ID, TENANT, AGENT, STEP, SEQUENCE, ATTEMPT = (
    "runtime.task_id",
    "runtime.tenant",
    "runtime.agent",
    "runtime.step",
    "runtime.step.sequence",
    "runtime.attempt",
)


@contextmanager
def slice_of(task_id: str, carried: tuple[str, str, str] | None = None) -> Iterator[Span]:
    """Around one slice (one Celery message): a span in the trace the message carried, and
    the task's id, tenant and agent on every log line written inside. `carried`: (agent,
    tenant slug, trace_context) as the message carried them (tasks_app.queue.ABOUT_HEADER);
    None: read them."""
    agent, tenant, created_in = _about(task_id, carried)
    parent, links = _task_trace(created_in)
    with tracer.start_as_current_span("slice", context=parent, links=links, attributes={TASK_ID: task_id}) as span:
        if span.is_recording() and agent:
            span.set_attributes({AGENT: agent, TENANT: tenant})
        with logs.about(task_id=task_id, tenant=tenant, agent=agent):
            yield span


ABOUT_SECONDS = 60.0  # how long a worker process labels a task's slices without reading the row again
_about_tasks: dict[str, tuple[float, tuple[str | None, str | None, str]]] = {}


def _about(task_id: str, carried: tuple[str, str, str] | None = None) -> tuple[str | None, str | None, str]:
    """(agent, tenant slug, trace_context) of a task, for its slices' spans and log lines:
    what a task was created with never changes (a tenant's slug may be edited, and shows
    here within ABOUT_SECONDS), so a worker reads it once, not at every slice, and not at
    all when the message carried it (`carried`), as the create's does."""
    now = time.monotonic()
    cached = _about_tasks.get(task_id)
    if cached is not None and now - cached[0] < ABOUT_SECONDS:
        return cached[1]
    about = carried or _read_about(task_id)
    if about is None:
        return None, None, ""  # no such task (any more): not remembered
    if len(_about_tasks) >= 10_000:
        _about_tasks.clear()
    _about_tasks[task_id] = (now, about)
    return about


def _read_about(task_id: str) -> tuple[str, str, str] | None:
    """_about's read. On PostgreSQL in SQL written here: it comes before the claim of a
    task's first slice, on the path of submit → first step, where building the ORM's join
    cost more than the round trip."""
    from django.db import connection

    from tasks_app.models import Task, Tenant

    if connection.vendor != "postgresql":
        row = Task.objects.filter(id=task_id).values_list("agent", "tenant__slug", "trace_context").first()
        return None if row is None else (row[0], row[1], row[2])
    tasks, tenants = (connection.ops.quote_name(m._meta.db_table) for m in (Task, Tenant))
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT t.agent, n.slug, t.trace_context FROM {tasks} AS t JOIN {tenants} AS n"  # noqa: S608 (names from the models)
            " ON n.id = t.tenant_id WHERE t.id = %s",
            [UUID(task_id)],
        )
        row = cursor.fetchone()
    return None if row is None else (row[0], row[1], row[2])


def _task_trace(traceparent: str) -> tuple[context.Context | None, list[trace.Link]]:
    """Where a slice's span belongs: in the trace of the request that created its task. A
    slice rung from inside that trace (the request, the slice before it) stays under its
    message; one rung from elsewhere (the reaper after a crash, a steering command, a
    redrive, beat) joins the task's trace, linked to the message that rang it."""
    if not traceparent:
        return None, []
    from opentelemetry import propagate

    created = trace.get_current_span(propagate.extract({"traceparent": traceparent})).get_span_context()
    rung_by = trace.get_current_span().get_span_context()
    if not created.is_valid or created.trace_id == rung_by.trace_id:
        return None, []
    return trace.set_span_in_context(trace.NonRecordingSpan(created)), [trace.Link(rung_by)] if rung_by.is_valid else []


@contextmanager
def step(task: Any, name: str, sequence: int, *, rerun: bool = False) -> Iterator[None]:
    """Around one agent step: a span, and its duration by agent and outcome. `rerun`: a
    crash forced this step to run again (its attempt is then one more than the rows kept)."""
    t0, outcome = time.perf_counter(), "ok"
    # With tracing off, no span at all: the API's no-op tracer still took 10 us a step.
    spanning = (
        tracer.start_as_current_span(f"step {name}", record_exception=False, set_status_on_exception=False)
        if tracing.enabled()
        else _NO_SPAN
    )
    with spanning as span:
        if span.is_recording():
            span.set_attributes(
                {
                    TASK_ID: str(task.id),
                    TENANT: task.tenant.slug,
                    AGENT: task.agent,
                    STEP: name,
                    SEQUENCE: sequence,
                    ATTEMPT: _attempt(task, sequence) if rerun else 1,
                }
            )
        try:
            with logs.about(step=name):
                yield
        except (agents.InputNeeded, agents.RemoteWait) as exc:
            outcome = "waiting"  # asked a person, or a remote task runs: not a failure
            span.set_attribute("runtime.step.waiting", type(exc).__name__)
            raise
        except BaseException as exc:
            outcome = "error"
            span.record_exception(exc)
            span.set_status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"[:200])
            raise
        finally:
            metrics.STEP_SECONDS.labels(task.agent, outcome).observe(time.perf_counter() - t0)


@contextmanager
def detached() -> Iterator[None]:
    """No current span inside: what is sent from here starts a trace of its own."""
    token = context.attach(context.Context())
    try:
        yield
    finally:
        context.detach(token)


def _attempt(task: Any, sequence: int) -> int:
    from tasks_app.models import Step

    return 1 + Step.objects.filter(task_id=task.id, sequence=sequence).count()


def tool(name: str, call: Callable[[dict[str, Any], str, float], Any]) -> Callable[[dict[str, Any], str, float], Any]:
    """Wraps a tool's call (or poll) hook: a span per attempt, counted by outcome. The key is
    the ledger's, "<task>:<step>:<call index>"."""

    def observed(args: dict[str, Any], key: str, timeout: float) -> Any:
        task_id, _, rest = key.partition(":")
        with tracer.start_as_current_span(
            f"tool {name}",
            attributes={
                "runtime.tool": name,
                "runtime.idempotency_key": key,
                TASK_ID: task_id,
                SEQUENCE: int(rest.partition(":")[0]) if rest.partition(":")[0].isdigit() else 0,
            },
        ):
            try:
                result = call(args, key, timeout)
            except BaseException:
                metrics.TOOL_CALLS.labels(name, "error").inc()
                raise
        metrics.TOOL_CALLS.labels(name, "ok").inc()
        return result

    return observed
