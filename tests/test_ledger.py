"""Exactly-once side effects with real worker processes, counted by an independent HTTP
receiver (tests/sink.py), not by our own tables."""

from __future__ import annotations

import sys

import httpx
import pytest

from conftest import FAST_LEASES, ROOT, Processes, answers, free_port, settled, wait_until
from ledger_app.models import LedgerEntry
from tasks_app.access import console
from tasks_app.actions import do_create_task
from tasks_app.models import Task
from tasks_app.queue import enqueue_slice

pytestmark = pytest.mark.django_db(transaction=True)

FAST = {**FAST_LEASES, "RUNTIME_SLICE_STEPS": "8", "SECURITY_HTTP_ALLOWLIST": "127.0.0.1"}


class Sink:
    def __init__(self, processes: Processes, fail_first: int = 0, delay_ms: int = 0) -> None:
        self.port = free_port()
        processes.start(
            "sink",
            [
                sys.executable,
                str(ROOT / "tests" / "sink.py"),
                "--port",
                str(self.port),
                "--fail-first",
                str(fail_first),
                "--delay-ms",
                str(delay_ms),
            ],
        )
        self.url = f"http://127.0.0.1:{self.port}"
        wait_until(lambda: answers(f"{self.url}/stats"), timeout=10, what="the sink")

    def stats(self) -> dict:
        return httpx.get(f"{self.url}/stats", timeout=5).json()


def webhook(alice, sink: Sink, *, count: int = 3, reconcile: bool = True, options: dict | None = None, **extra) -> Task:
    """A webhook task; `options` go to do_create_task (policies, budget) so they hold from its first step."""
    payload = {"url": f"{sink.url}/effects", "payload": {"hello": "world"}, "count": count, **extra}
    if reconcile:
        payload["reconcileUrl"] = f"{sink.url}/effects/{{key}}"
    return do_create_task(console(alice.tenant, "user:test"), agent="webhook", input=payload, **(options or {}))[0]


@pytest.mark.parametrize("point", ["ledger:before_call", "ledger:after_call", "ledger:after_settle"])
def test_a_crash_around_a_call_still_ends_with_exactly_one_effect(alice, processes, tmp_path, point):
    sink = Sink(processes)
    marker = tmp_path / "crashed"
    processes.worker(**FAST, RUNTIME_FAULT_INJECTION=f"{point}:{marker}")
    processes.beat(**FAST)
    task = settled(webhook(alice, sink))
    assert marker.exists(), "the fault was never injected"
    assert task.status == "completed", task.error
    assert task.recoveries >= 1 and task.result["sent"] == 3
    stats = sink.stats()
    assert stats["effects"] == 3 and set(stats["perKey"].values()) == {1}  # never sent twice
    assert set(LedgerEntry.objects.filter(task=task).values_list("status", flat=True)) == {"succeeded"}


def test_a_remote_that_cannot_be_asked_gets_a_person_not_a_second_call(alice, processes, tmp_path):
    sink = Sink(processes)
    marker = tmp_path / "crashed"
    processes.worker(**FAST, RUNTIME_FAULT_INJECTION=f"ledger:after_call:{marker}")
    processes.beat(**FAST)
    task = settled(webhook(alice, sink, reconcile=False))
    assert task.status == "input_required"
    entry = LedgerEntry.objects.get(task=task, step_sequence=1)
    assert entry.status == "unknown"
    assert sink.stats()["perKey"] == {entry.key: 1}
    snapshot = alice.client().get(f"/runtime/tasks/{task.id}").json()
    [request] = snapshot["inputRequests"]
    assert request["key"] == f"confirm-{entry.key}" and request["schema"] == {"enum": ["done", "not_done"]}
    answer = alice.client().post(
        f"/runtime/tasks/{task.id}/steering",
        {
            "commandId": "confirm-1",
            "type": "provide_input",
            "payload": {"key": request["key"], "answer": "done"},
            "expectedVersion": snapshot["stateVersion"],
        },
        format="json",
    )
    assert answer.status_code == 202, answer.content
    task = settled(task)
    assert task.status == "completed"
    stats = sink.stats()
    assert stats["effects"] == 3 and set(stats["perKey"].values()) == {1}


def test_the_same_slice_delivered_many_times_makes_each_effect_once(alice, processes):
    sink = Sink(processes)
    processes.worker(concurrency=2, **FAST)
    task = webhook(alice, sink, count=10, sleepMs=30)
    for _ in range(10):
        enqueue_slice(task.id, task.priority)
    assert settled(task).status == "completed"
    stats = sink.stats()
    assert stats["effects"] == 10 and set(stats["perKey"].values()) == {1}


def test_transient_failures_are_retried_with_backoff_and_left_in_the_ledger(alice, processes):
    sink = Sink(processes, fail_first=2)
    processes.worker(**FAST)
    task = settled(webhook(alice, sink, count=1))
    assert task.status == "completed"
    entry = LedgerEntry.objects.get(task=task)
    assert entry.attempts == 3 and len(entry.durations_ms) == 3
    stats = sink.stats()
    assert stats["posts"] == 3 and stats["effects"] == 1


def test_retries_are_bounded_and_the_step_fails_with_a_diagnosable_reason(alice, processes):
    sink = Sink(processes, fail_first=100)
    processes.worker(**FAST)
    task = settled(webhook(alice, sink, count=2))
    assert task.status == "failed" and task.error["code"] == "tool_failed"
    assert "HTTP 503" in task.error["message"] and "after 3 attempts" in task.error["message"]
    entry = LedgerEntry.objects.get(task=task)
    assert entry.status == "failed" and entry.attempts == 3 and entry.error["retryable"] is True
    assert sink.stats()["posts"] == 3  # bounded


def test_denied_tools_and_hosts_off_the_allowlist_fail_clearly(alice, processes):
    sink = Sink(processes)
    processes.worker(**FAST)
    denied = settled(webhook(alice, sink, tool="shell.root"))
    assert denied.status == "failed" and "denied by policy" in denied.error["message"]
    elsewhere = settled(
        do_create_task(
            console(alice.tenant, "user:test"), agent="webhook", input={"url": "http://localhost:9/effects"}
        )[0]
    )
    assert elsewhere.status == "failed" and "not in security.http_allowlist" in elsewhere.error["message"]
    assert sink.stats()["posts"] == 0


def test_an_invalid_url_or_a_header_injection_is_refused_before_any_ledger_row(alice, processes, tmp_path):
    """A URL with a space, a line break or a port that cannot be, and an email subject or
    recipient carrying CR/LF (header injection): the step fails at once naming the field, not
    retried, no ledger row written (none left started for a person to reconcile), and
    nothing reached the independent receivers."""
    from tests.test_approvals import smtp_sink

    sink = Sink(processes)
    smtp_port, mail = smtp_sink(processes, tmp_path)
    # email.send without an approver: the refusal is the tool's, not a question to a person
    processes.worker(
        **FAST, EMAIL_HOST="127.0.0.1", EMAIL_PORT=str(smtp_port), SECURITY_REQUIRE_APPROVAL="payment.create"
    )
    mail_args = {"to": ["legal@example.com"], "subject": "report", "body": "done"}
    cases = [
        ("http.request", {"url": f"{sink.url}/effects x"}, "url"),
        ("http.request", {"url": f"{sink.url}/effects\r\nX-Injected: 1"}, "url"),
        ("http.request", {"url": f"{sink.url}/effects\t"}, "url"),
        ("http.request", {"url": "http://127.0.0.1:99999/effects"}, "url"),
        ("http.request", {"url": "http:///effects"}, "url"),
        (
            "http.request",
            {"url": f"{sink.url}/effects", "reconcileUrl": f"{sink.url}/effects/{{key}} x"},
            "reconcileUrl",
        ),
        ("email.send", {**mail_args, "subject": "report\r\nBcc: everyone@example.com"}, "subject"),
        ("email.send", {**mail_args, "subject": "report\nBcc: everyone@example.com"}, "subject"),
        ("email.send", {**mail_args, "to": ["legal@example.com\r\nBcc: everyone@example.com"]}, "to"),
        ("email.send", {**mail_args, "to": ["not an address"]}, "to"),
    ]
    for tool, args, field in cases:
        task, _ = do_create_task(
            console(alice.tenant, "user:test"), agent="tool_calls", input={"calls": [{"tool": tool, "args": args}]}
        )
        task = settled(task)
        assert task.status == "failed", (tool, args, task.status, task.error)
        assert task.error["code"] == "tool_failed" and field in task.error["message"], (args, task.error)
        assert not LedgerEntry.objects.filter(task=task).exists(), (args, list(LedgerEntry.objects.filter(task=task)))
    assert sink.stats()["posts"] == 0
    assert mail.read_text() == ""


def test_a_task_publishes_only_its_own_artifacts(alice, mallory, processes):
    """content.publish copies a blob by its key: one that is not the calling task's own
    artifact (another task's of the tenant, another tenant's, one reached through "..",
    a corpus file) is refused naming the key, before any ledger row, and nothing is copied."""
    from runtime_site.blobstore import blob_store

    store = blob_store()
    neighbour, _ = do_create_task(console(alice.tenant, "user:test"), agent="noop", input={"steps": 1})
    stranger, _ = do_create_task(console(mallory.tenant, "user:test"), agent="noop", input={"steps": 1})
    for other in (neighbour, stranger):
        store.put(f"tasks/{other.id}/artifacts/secret.md", b"not yours", "text/markdown")
    store.put("corpora/private/doc.json", b"{}", "application/json")

    def publish(source: str, *, own: bytes | None = None) -> Task:
        """A tool_calls task publishing `source`, where {self} is its own id (set, with its own
        artifact `own`, before any worker runs: the worker starts once all are made)."""
        task, _ = do_create_task(
            console(alice.tenant, "user:test"),
            agent="tool_calls",
            input={"calls": [{"tool": "content.publish", "args": {"source": "-", "name": "out.md"}}]},
        )
        args = {"source": source.replace("{self}", str(task.id)), "name": "out.md"}
        Task.objects.filter(id=task.id).update(input={"calls": [{"tool": "content.publish", "args": args}]})
        if own is not None:
            store.put(f"tasks/{task.id}/artifacts/mine.md", own, "text/markdown")
        return task

    refused = [
        publish(source)
        for source in (
            f"file://tasks/{neighbour.id}/artifacts/secret.md",
            f"tasks/{stranger.id}/artifacts/secret.md",
            "file://corpora/private/doc.json",
            f"file://tasks/{{self}}/artifacts/../../{neighbour.id}/artifacts/secret.md",
            f"file://tasks/{{self}}/artifacts/x/../../../{neighbour.id}/artifacts/secret.md",
        )
    ]
    mine = publish("file://tasks/{self}/artifacts/mine.md", own=b"mine")
    processes.worker(**FAST, SECURITY_REQUIRE_APPROVAL="payment.create")
    for made in refused:
        task = settled(made)
        source = task.input["calls"][0]["args"]["source"]
        assert task.status == "failed" and task.error["code"] == "tool_failed", (source, task.error)
        assert "not this task's own artifact" in task.error["message"], (source, task.error)
        assert not LedgerEntry.objects.filter(task=task).exists(), source
        assert not store.exists(f"published/{task.id}/out.md"), source
    mine = settled(mine)
    assert mine.status == "completed", mine.error
    assert store.get(f"published/{mine.id}/out.md") == b"mine"
