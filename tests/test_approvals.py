"""Approval gates end to end: a real worker, the REST API, an independent SMTP server and
HTTP sink counting what actually went out."""

from __future__ import annotations

import json
import socket
import sys

import pytest

from conftest import ROOT, Processes, free_port, make_persona, wait_until
from ledger_app.models import LedgerEntry
from runtime_site.blobstore import blob_store
from steering_app.models import InputRequest
from tasks_app import policy
from tasks_app.access import console
from tasks_app.actions import do_create_task
from tasks_app.agents.document_review.corpus import generate_corpus
from tasks_app.models import AuditRecord, Task
from tests.test_ledger import FAST, Sink, webhook


@pytest.fixture
def approver(db):
    return make_persona("acme", "april", "approver")


def smtp_sink(processes: Processes, tmp_path) -> tuple[int, object]:
    port, out = free_port(), tmp_path / "mail.jsonl"
    processes.start(
        "smtp", [sys.executable, str(ROOT / "tests" / "smtp_sink.py"), "--port", str(port), "--out", str(out)]
    )

    def listening() -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    wait_until(listening, timeout=10, what="the SMTP server")
    return port, out


def waiting_for(task: Task, key_prefix: str) -> dict:
    def open_request():
        snapshot = Task.objects.get(id=task.id)
        request = InputRequest.objects.filter(task=task, status="open", key__startswith=key_prefix).first()
        return snapshot.status == "input_required" and request

    request = wait_until(open_request, timeout=60, what=f"an open {key_prefix} request")
    return {"key": request.key, "prompt": request.prompt}


def approve(persona, task: Task, key: str, answer: str = "approve"):
    return persona.client().post(f"/runtime/tasks/{task.id}/inputs/{key}", {"answer": answer}, format="json")


@pytest.mark.django_db(transaction=True)
def test_publish_and_mail_wait_for_an_approver_and_happen_once(alice, approver, processes, tmp_path):
    store = blob_store()
    generate_corpus(store, "corpora/approve", 60, 4, "2026-11-01")
    smtp_port, mail = smtp_sink(processes, tmp_path)
    processes.worker(**FAST, EMAIL_HOST="127.0.0.1", EMAIL_PORT=str(smtp_port))
    created = alice.client().post(
        "/runtime/tasks",
        {
            "agent": "document_review",
            "goal": "review and publish",
            "input": {"corpus": "corpora/approve", "batchSize": 20, "publish": True, "notify": ["legal@example.com"]},
        },
        format="json",
    )
    task = Task.objects.get(id=created.json()["taskId"])

    publish = waiting_for(task, "approve-")
    assert "content.publish" in publish["prompt"]
    assert not store.list(f"published/{task.id}")  # nothing before the approval
    assert approve(alice, task, publish["key"]).status_code == 403  # an operator may not approve
    assert approve(approver, task, publish["key"]).status_code == 202

    mail_request = waiting_for(task, "approve-")  # the publish request is answered, so this is the next
    assert mail_request["key"] != publish["key"]
    assert "email.send" in mail_request["prompt"] and mail.read_text() == ""
    assert approve(approver, task, mail_request["key"]).status_code == 202
    wait_until(lambda: Task.objects.get(id=task.id).status == "completed", timeout=60, what="completion")

    task.refresh_from_db()
    assert task.result["published"]["ref"].endswith("report.md") and len(store.list(f"published/{task.id}")) == 1
    delivered = [json.loads(line) for line in mail.read_text().splitlines()]
    assert len(delivered) == 1 and delivered[0]["to"] == ["legal@example.com"]
    assert delivered[0]["key"] == LedgerEntry.objects.get(task=task, tool="email.send").key
    accepted = AuditRecord.objects.filter(task=task, action="steering_accepted")
    assert accepted.count() == 2 and {r.actor for r in accepted} == {f"user:{approver.user.pk}"}


@pytest.mark.django_db(transaction=True)
def test_a_rejected_publish_takes_the_rejection_path_and_publishes_nothing(alice, approver, processes):
    store = blob_store()
    generate_corpus(store, "corpora/reject", 30, 4, "2026-11-01")
    processes.worker(**FAST)
    task, _ = do_create_task(
        console(alice.tenant, "user:test"), agent="document_review", input={"corpus": "corpora/reject", "publish": True}
    )
    request = waiting_for(task, "approve-")
    assert approve(approver, task, request["key"], "reject").status_code == 202
    wait_until(lambda: Task.objects.get(id=task.id).status == "completed", timeout=60, what="completion")
    task.refresh_from_db()
    assert "rejected" in task.result["published"] and not store.list(f"published/{task.id}")
    assert not LedgerEntry.objects.filter(task=task).exists()  # the call was never started


@pytest.mark.django_db(transaction=True)
def test_a_pause_just_before_a_guarded_call_never_crosses_the_approval_point(alice, approver, processes):
    sink = Sink(processes)
    processes.worker(**FAST)
    task = webhook(alice, sink, count=1, sleepMs=1500, options={"approval_policy": {"before": ["http.request"]}})
    wait_until(lambda: Task.objects.get(id=task.id).status == "working", timeout=30, what="the step to start")
    paused = alice.client().post(
        f"/runtime/tasks/{task.id}/steering",
        {"commandId": "pause-1", "type": "pause", "expectedVersion": Task.objects.get(id=task.id).state_version},
        format="json",
    )
    assert paused.status_code == 202
    wait_until(lambda: Task.objects.get(id=task.id).status == "paused", timeout=30, what="the pause")
    [request] = InputRequest.objects.filter(task=task, status="open")
    assert approve(approver, task, request.key).status_code == 202  # approved while paused ...
    assert Task.objects.get(id=task.id).status == "paused" and sink.stats()["posts"] == 0  # ... still no call
    resumed = alice.client().post(
        f"/runtime/tasks/{task.id}/steering",
        {"commandId": "resume-1", "type": "resume", "expectedVersion": Task.objects.get(id=task.id).state_version},
        format="json",
    )
    assert resumed.status_code == 202
    wait_until(lambda: Task.objects.get(id=task.id).status == "completed", timeout=30, what="completion")
    assert sink.stats()["posts"] == 1


@pytest.mark.django_db(transaction=True)
def test_a_tool_call_budget_stops_the_task_with_the_reason(alice, processes):
    sink = Sink(processes)
    processes.worker(**FAST)
    task = webhook(alice, sink, count=5, options={"budget": {"maxToolCalls": 2}})
    wait_until(lambda: Task.objects.get(id=task.id).is_terminal, timeout=30, what="the task to stop")
    task.refresh_from_db()
    assert task.status == "failed" and "budget exhausted: tool calls 2 of 2" in task.error["message"]
    assert sink.stats()["posts"] == 2


@pytest.mark.parametrize(
    ("tool", "approval_policy", "budget", "usage", "verdict"),
    [
        ("http.request", {}, {}, (0, 0, 0), policy.ALLOW),
        ("shell.root", {}, {}, (0, 0, 0), policy.DENY),
        ("filesystem.delete_recursive", {}, {}, (0, 0, 0), policy.DENY),
        ("email.send", {}, {}, (0, 0, 0), policy.NEEDS_APPROVAL),
        ("payment.create", {}, {}, (0, 0, 0), policy.NEEDS_APPROVAL),
        ("http.request", {"before": ["http.request"]}, {}, (0, 0, 0), policy.NEEDS_APPROVAL),
        ("http.request", {}, {"maxSteps": 10}, (10, 0, 0), policy.EXHAUSTED),
        ("http.request", {}, {"maxWallSeconds": 60}, (0, 0, 61), policy.EXHAUSTED),
        ("http.request", {}, {"maxToolCalls": 3}, (0, 2, 0), policy.ALLOW),
        ("http.request", {}, {"maxCost": 5}, (0, 0, 0, 5.0), policy.EXHAUSTED),
        ("http.request", {}, {"maxCost": 5}, (0, 0, 0, 4.5), policy.ALLOW),
    ],
)
def test_the_policy_guard_decides_from_its_inputs_alone(tool, approval_policy, budget, usage, verdict):
    decision = policy.decide(tool, approval_policy=approval_policy, budget=budget, usage=policy.Usage(*usage))
    assert decision.verdict == verdict


def test_an_allow_list_of_tools_denies_every_other_tool(settings):
    settings.RUNTIME = {
        **settings.RUNTIME,
        "security": {**settings.RUNTIME["security"], "allow_tools": ["http.request"]},
    }
    usage = policy.Usage(0, 0, 0)
    assert policy.decide("http.request", approval_policy={}, budget={}, usage=usage).verdict == policy.ALLOW
    denied = policy.decide("mcp.call", approval_policy={}, budget={}, usage=usage)
    assert denied.verdict == policy.DENY and "security.allow_tools" in denied.reason


@pytest.mark.django_db(transaction=True)
def test_with_on_exhausted_ask_an_approver_extends_a_tool_call_budget_mid_step(alice, approver, processes):
    sink = Sink(processes)
    processes.worker(**FAST, BUDGET_ON_EXHAUSTED="ask")
    task = webhook(alice, sink, count=3, options={"budget": {"maxToolCalls": 2}})
    wait_until(lambda: Task.objects.get(id=task.id).status == "input_required", timeout=30, what="the budget question")
    [request] = InputRequest.objects.filter(task=task, status="open")
    assert request.key.startswith("budget-call-") and request.kind == "budget_extension"
    assert sink.stats()["posts"] == 2
    assert approve(approver, task, request.key, {"maxToolCalls": 3}).status_code == 202
    wait_until(lambda: Task.objects.get(id=task.id).status == "completed", timeout=30, what="completion")
    assert sink.stats()["posts"] == 3 and set(sink.stats()["perKey"].values()) == {1}
