"""Traces across processes: a task created over the API by a real uvicorn, run by a real
Celery worker, calling a real HTTP receiver; both processes export over OTLP/HTTP to a
receiver started here, which decodes the protobuf. One trace holds the whole task: the
request, the slice messages, each slice, each step, each tool call and its HTTP call, and
the receiver of that call got a traceparent of the same trace."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator

import httpx
import pytest

from conftest import Processes, free_port, settled, wait_until
from tasks_app.access import console
from tasks_app.actions import do_create_task
from tasks_app.models import Task
from tests.otlp_receiver import OtlpReceiver, render
from tests.test_ledger import FAST, Sink
from tests.test_worker_lifecycle import log_of, worker_on

pytestmark = pytest.mark.django_db(transaction=True)

SERVER, CLIENT, PRODUCER, CONSUMER = 2, 3, 4, 5  # opentelemetry.proto SpanKind values
SHOWN = ("runtime.task_id", "runtime.tenant", "runtime.agent", "runtime.step", "runtime.attempt", "runtime.tool")


@pytest.fixture
def receiver():
    receiver = OtlpReceiver()
    yield receiver
    receiver.close()


def test_one_task_is_one_trace_across_web_worker_and_the_remote(alice, processes: Processes, receiver):
    otel = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_BSP_SCHEDULE_DELAY": "100"}
    sink = Sink(processes)
    port = free_port()
    processes.web(port, **otel)
    processes.worker(**{**FAST, **otel, "RUNTIME_SLICE_STEPS": "1"})  # a slice per step: two slices, two messages
    created = httpx.post(
        f"http://127.0.0.1:{port}/runtime/tasks",
        timeout=15,
        headers={"Authorization": f"Bearer {alice.token}"},
        json={"agent": "webhook", "input": {"url": f"{sink.url}/effects", "count": 2}},
    )
    assert created.status_code == 201, created.text
    task = Task.objects.get(id=created.json()["taskId"])
    assert settled(task).status == "completed"

    # The trace of the request that created the task.
    request = wait_until(
        lambda: next(
            (
                s
                for s in receiver.spans
                if s["kind"] == SERVER
                and s["service"] == "runtime-web"
                and s["attributes"].get("http.route") == "runtime/tasks"
            ),
            None,
        ),
        timeout=30,
        what="the API request's span",
    )
    trace_id = request["trace_id"]

    def whole() -> list[dict] | None:
        spans = receiver.trace(trace_id)
        steps = [s for s in spans if s["name"].startswith("step ")]
        http = [s for s in spans if s["kind"] == CLIENT and s["name"] == "POST"]
        slices = [s for s in spans if s["name"] == "slice"]  # each ends (and is exported) after its steps
        return spans if len(steps) == 2 and len(http) == 2 and len(slices) == 2 else None

    spans = wait_until(whole, timeout=30, what="every span of the task's trace")
    print(
        f"\nspan tree of task {task.id} (SQL spans left out):\n"
        + render([s for s in spans if "db.system" not in s["attributes"]], SHOWN)
    )
    by_id = {s["span_id"]: s for s in spans}

    def parent(span: dict) -> dict:
        return by_id[span["parent_id"]]

    assert request["parent_id"] == ""  # the root
    slices = [s for s in spans if s["name"] == "slice"]
    assert {s["service"] for s in slices} == {"runtime-worker"}
    # The first slice's message was sent by the request (through Celery's headers) ...
    consumer = parent(slices[0])
    assert consumer["kind"] == CONSUMER and consumer["service"] == "runtime-worker"
    producer = parent(consumer)
    assert producer["kind"] == PRODUCER and producer["service"] == "runtime-web"
    assert any(a is request for a in _ancestors(producer, by_id))
    # ... the next one by the slice before it.
    assert any(a in slices[:1] for a in _ancestors(slices[1], by_id))
    for step in (s for s in spans if s["name"].startswith("step ")):
        assert parent(step)["name"] == "slice"
        assert step["attributes"]["runtime.task_id"] == str(task.id)
        assert step["attributes"]["runtime.tenant"] == "acme"
        assert step["attributes"]["runtime.agent"] == "webhook"
        assert step["attributes"]["runtime.step"] in ("notify-1", "notify-2")
        assert step["attributes"]["runtime.attempt"] == 1
    for call in (s for s in spans if s["kind"] == CLIENT and s["name"] == "POST"):
        tool = parent(call)
        assert tool["name"] == "tool http.request" and parent(tool)["name"].startswith("step ")
    # The remote saw the same trace, with the HTTP call's span as parent.
    traceparents = sink.stats()["traceparents"]
    assert len(traceparents) == 2
    for header in traceparents.values():
        _, trace, span_id, _ = header.split("-")
        assert trace == trace_id and by_id[span_id]["kind"] == CLIENT
    # The worker's database work is traced too (psycopg), inside the slices.
    assert any(s["service"] == "runtime-worker" and s["attributes"].get("db.system") == "postgresql" for s in spans)


def test_a_task_resumed_after_its_worker_was_killed_stays_in_the_trace_of_its_creation(
    alice, processes: Processes, receiver
):
    otel = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_BSP_SCHEDULE_DELAY": "100"}
    port = free_port()
    processes.web(port, **otel)
    first = processes.worker(**{**FAST, **otel})
    processes.beat(**FAST)  # the reaper rings the task again after the kill: outside any trace
    created = httpx.post(
        f"http://127.0.0.1:{port}/runtime/tasks",
        timeout=15,
        headers={"Authorization": f"Bearer {alice.token}"},
        json={"agent": "noop", "input": {"steps": 30, "sleepMs": 50}, "checkpointPolicy": {"everySteps": 5}},
    )
    assert created.status_code == 201, created.text
    task = Task.objects.get(id=created.json()["taskId"])
    wait_until(lambda: Task.objects.get(id=task.id).steps_done >= 10, timeout=60, what="ten steps")
    processes.kill(first)  # SIGKILL mid-slice: its open slice span is never exported
    processes.worker(**{**FAST, **otel})
    assert settled(task, timeout=120).status == "completed"
    assert Task.objects.get(id=task.id).recoveries >= 1

    request = wait_until(
        lambda: next(
            (s for s in receiver.spans if s["kind"] == SERVER and s["attributes"].get("http.route") == "runtime/tasks"),
            None,
        ),
        timeout=30,
        what="the API request's span",
    )
    steps = lambda: {  # noqa: E731
        s["attributes"]["runtime.step.sequence"]
        for s in receiver.spans
        if s["name"].startswith("step ") and s["attributes"].get("runtime.task_id") == str(task.id)
    }
    wait_until(lambda: steps() >= set(range(11, 31)), timeout=30, what="the steps after the kill")
    ours = [s for s in receiver.spans if s["attributes"].get("runtime.task_id") == str(task.id)]
    assert {s["trace_id"] for s in ours} == {request["trace_id"]}, "a slice after the kill started a trace of its own"
    # The slice the reaper rang says so: it links to the message that rang it, from another trace.
    resumed = [s for s in ours if s["name"] == "slice" and s["links"]]
    assert resumed and all(trace != request["trace_id"] for s in resumed for trace, _ in s["links"])


def _ancestors(span: dict, by_id: dict) -> list[dict]:
    out = []
    while span["parent_id"] in by_id:
        span = by_id[span["parent_id"]]
        out.append(span)
    return out


def test_calls_to_a_remote_mcp_server_carry_the_tool_calls_traceparent(alice, processes: Processes, receiver):
    from tests.test_remote_mcp import FAST as REMOTE_FAST
    from tests.test_remote_mcp import Remote, calls

    remote = Remote(processes)
    processes.worker(**{**REMOTE_FAST, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_BSP_SCHEDULE_DELAY": "100"})
    task = settled(calls(alice, remote, ("record", {"arguments": {"text": "traced"}})))
    assert task.status == "completed", task.error

    tool = wait_until(
        lambda: next((s for s in receiver.spans if s["name"] == "tool mcp.call"), None),
        timeout=30,
        what="the mcp.call span",
    )
    assert tool["attributes"]["runtime.task_id"] == str(task.id)
    seen = remote.stats()["traceparents"]
    assert seen and all(h.split("-")[1:3] == [tool["trace_id"], tool["span_id"]] for h in seen), (seen, tool)


# The OTLP exporter's own default time limit for one export (OTEL_EXPORTER_OTLP_TIMEOUT), retries
# included: what a worker waited at least, per batch, to stop while its collector was unreachable.
EXPORT_TIMEOUT = 10


@contextlib.contextmanager
def unreachable_collector(how: str) -> Iterator[str]:
    """An OTLP endpoint that refuses connections (nothing listens on its port) or blackholes
    them (a socket that listens and never accepts: the request is sent, no answer ever comes)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        if how == "blackholed":
            sock.listen(64)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.mark.parametrize("how", ["refused", "blackholed"])
def test_a_worker_told_to_stop_exits_promptly_when_its_collector_is_unreachable(alice, processes: Processes, how):
    with unreachable_collector(how) as endpoint:
        # Spans stay buffered until the worker stops: its flush at shutdown is what is tested.
        worker = worker_on(
            processes, "steps,maintenance", OTEL_EXPORTER_OTLP_ENDPOINT=endpoint, OTEL_BSP_SCHEDULE_DELAY="600000"
        )
        task, _ = do_create_task(console(alice.tenant, "user:test"), agent="noop", input={"steps": 3})
        assert settled(task).status == "completed"
        started = time.monotonic()
        os.kill(worker.pid, signal.SIGTERM)  # as a supervisor stops it: its main process only
        try:
            worker.wait(timeout=EXPORT_TIMEOUT)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the worker still ran {EXPORT_TIMEOUT} s after SIGTERM: its span flush is unbounded")
        print(f"\nworker exited {time.monotonic() - started:.1f} s after SIGTERM (collector {how})")
        assert worker.returncode == 0, log_of(worker)


@pytest.mark.parametrize("how", ["refused", "blackholed"])
def test_the_web_process_told_to_stop_exits_promptly_when_its_collector_is_unreachable(
    alice, processes: Processes, how
):
    with unreachable_collector(how) as endpoint:
        port = free_port()
        web = processes.web(port, OTEL_EXPORTER_OTLP_ENDPOINT=endpoint, OTEL_BSP_SCHEDULE_DELAY="600000")
        created = httpx.post(
            f"http://127.0.0.1:{port}/runtime/tasks",
            timeout=15,
            headers={"Authorization": f"Bearer {alice.token}"},
            json={"agent": "noop", "input": {"steps": 1}},
        )
        assert created.status_code == 201, created.text  # its spans wait in the buffer
        os.kill(web.pid, signal.SIGTERM)
        try:
            web.wait(timeout=EXPORT_TIMEOUT)
        except subprocess.TimeoutExpired:
            pytest.fail(f"uvicorn still ran {EXPORT_TIMEOUT} s after SIGTERM: its span flush at exit is unbounded")
        assert "spans not exported within" in log_of(web)


def test_the_web_process_told_to_stop_exports_the_spans_it_still_holds(alice, processes: Processes, receiver):
    """uvicorn ends by raising again the SIGTERM it caught, which runs no atexit hook: the
    spans of a request answered just before a deploy were lost."""
    port = free_port()
    web = processes.web(port, OTEL_EXPORTER_OTLP_ENDPOINT=receiver.url, OTEL_BSP_SCHEDULE_DELAY="600000")
    created = httpx.post(
        f"http://127.0.0.1:{port}/runtime/tasks",
        timeout=15,
        headers={"Authorization": f"Bearer {alice.token}"},
        json={"agent": "noop", "input": {"steps": 1}},
    )
    assert created.status_code == 201, created.text
    assert not receiver.spans  # held in the buffer
    os.kill(web.pid, signal.SIGTERM)
    web.wait(timeout=EXPORT_TIMEOUT)
    assert any(s["attributes"].get("http.route") == "runtime/tasks" for s in receiver.spans), receiver.spans
