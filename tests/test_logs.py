"""Logs as JSON lines from real processes: a worker's line written during a step carries the
task, tenant, agent, step, trace and worker, with a token in the message masked as in
events; the web process's own lines (uvicorn's too) are JSON as well."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest

from conftest import Processes, free_port, settled, wait_until
from tests.otlp_receiver import OtlpReceiver
from tests.test_ledger import FAST, Sink, webhook

pytestmark = pytest.mark.django_db(transaction=True)

TOKEN = "sk-live-" + "Zq7" * 8  # looks like a vendor API key: must never reach a log


def lines(proc) -> list[dict]:
    """The process's log lines (Celery's start-up banner, printed and not logged, is left out)."""
    return [json.loads(raw) for raw in Path(proc.log_path).read_text().splitlines() if raw.startswith("{")]


def test_a_workers_lines_carry_task_tenant_trace_and_worker_redacted(alice, processes: Processes):
    receiver = OtlpReceiver()
    try:
        sink = Sink(processes, fail_first=1)  # the first call gets a 503: the ledger logs its retry
        worker = processes.worker(
            **{
                **FAST,
                "RUNTIME_LOG_FORMAT": "json",
                "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url,
                "OTEL_BSP_SCHEDULE_DELAY": "100",
            }
        )
        # The sink takes any path; the URL ends up in the retry's message.
        task = webhook(alice, sink, count=1, reconcile=False, url=f"{sink.url}/effects/{TOKEN}")
        assert settled(task).status == "completed"
        retry = wait_until(
            lambda: next((line for line in lines(worker) if "retrying" in line["message"]), None),
            timeout=15,
            what="the retry's log line",
        )
        step = wait_until(
            lambda: next((s for s in receiver.spans if s["name"] == "step notify-1"), None),
            timeout=30,
            what="the step's span",
        )
    finally:
        receiver.close()
    assert TOKEN not in Path(worker.log_path).read_text()
    assert "/***" in retry["message"] and retry["level"] == "INFO" and retry["logger"] == "ledger_app.actions"
    assert retry["task_id"] == str(task.id) and retry["tenant"] == "acme" and retry["agent"] == "webhook"
    assert retry["step"] == "notify-1"
    assert retry["trace_id"] == step["trace_id"] and retry["span_id"] == step["span_id"]  # retries: in the step
    assert re.fullmatch(r"[^:]+:\d+", retry["worker"])  # host:pid
    assert retry["time"].endswith("+00:00")


def test_the_web_process_writes_json_lines_too(processes: Processes):
    port = free_port()
    web = processes.web(port, RUNTIME_LOG_FORMAT="json")
    assert httpx.get(f"http://127.0.0.1:{port}/runtime/tasks/nope", timeout=10).status_code in (401, 404)
    access = wait_until(
        lambda: [line for line in lines(web) if line["logger"] == "uvicorn.access"],
        timeout=15,
        what="uvicorn's access lines",
    )
    assert any("/healthz" in line["message"] for line in access)


def test_a_secret_in_a_urls_query_or_credentials_never_reaches_a_log(alice, processes: Processes):
    """Tools take URLs that carry secrets (`?api_key=`, `https://user:password@`); a failed
    call's message names its URL, and the line must not carry what does not look like a token."""
    secret = "correct-horse-battery-staple"
    sink = Sink(processes, fail_first=1)
    worker = processes.worker(**{**FAST, "RUNTIME_LOG_FORMAT": "json"})
    url = sink.url.replace("http://", f"http://ops:{secret}@") + f"/effects?api_key={secret}&page=2"
    task = webhook(alice, sink, count=1, reconcile=False, url=url)
    assert settled(task).status == "completed"
    retry = wait_until(
        lambda: next((line for line in lines(worker) if "retrying" in line["message"]), None),
        timeout=15,
        what="the retry's log line",
    )
    assert secret not in Path(worker.log_path).read_text()
    assert "api_key=***" in retry["message"] and "page=2" in retry["message"], retry["message"]


def test_a_long_query_string_does_not_hold_the_web_process_while_its_line_is_masked(processes: Processes):
    """uvicorn writes its access line on the event loop, through the redaction filter: masking
    a 14 KB query string took over a minute (quadratic), and no other request was answered
    meanwhile. The deadlines are what the requests take plus ample slack, far under that."""
    port = free_port()
    web = processes.web(port, RUNTIME_LOG_FORMAT="json")
    hostile = f"http://127.0.0.1:{port}/healthz?q={'a-' * 7000}&api_key=hunter2"  # under uvicorn's 16 KB head
    assert httpx.get(hostile, timeout=15).status_code == 200
    assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=15).status_code == 200
    access = wait_until(
        lambda: [line for line in lines(web) if line["logger"] == "uvicorn.access" and "api_key=" in line["message"]],
        timeout=15,
        what="the hostile request's access line",
    )
    assert "api_key=***" in access[0]["message"] and "hunter2" not in Path(web.log_path).read_text()


def test_uvicorns_access_lines_are_masked_in_the_plain_format_too(processes: Processes):
    """The default (plain) format used to leave uvicorn's loggers on uvicorn's own handlers,
    which know nothing of the redaction filter: a key in a query string reached the terminal."""
    port = free_port()
    web = processes.web(port, RUNTIME_LOG_FORMAT="plain")
    assert httpx.get(f"http://127.0.0.1:{port}/healthz?api_key=hunter2&page=2", timeout=15).status_code == 200
    access = wait_until(
        lambda: [raw for raw in Path(web.log_path).read_text().splitlines() if "api_key=" in raw],
        timeout=15,
        what="the request's access line",
    )
    assert "api_key=***" in access[0] and "page=2" in access[0], access[0]
    assert "hunter2" not in Path(web.log_path).read_text()
