"""Django admin for operators: filters, history beside the task, nothing hand-editable that
would break an invariant, and actions that change state only through the domain functions
the API uses, each leaving an audit record with the operator as actor."""

from __future__ import annotations

from datetime import timedelta
from unittest import mock

import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone

from ledger_app.models import LedgerEntry
from tasks_app import admin as task_admin
from tasks_app import leases, operators
from tasks_app.models import AuditRecord, Task
from tasks_app.tests.test_engine import new_task, run_to_end
from tasks_app.tests.test_recovery import crash_mid_slice

pytestmark = pytest.mark.django_db


@pytest.fixture
def operator(client):
    get_user_model().objects.create_superuser("opal", "opal@example.com", "pw")
    client.login(username="opal", password="pw")
    return client


def dead_letter(persona) -> Task:
    task = new_task(persona)
    for _ in range(4):
        crash_mid_slice(task)
        operators.do_mark_recovering(task.id, actor="system:reaper", max_recoveries=3)
    assert Task.objects.get(id=task.id).status == "dead_lettered"
    return task


def held_by_a_gone_worker(persona) -> Task:
    task = new_task(persona)
    assert leases.claim(task.id, worker_id="gone", ttl=300) is not None
    return task


def post_action(client, action: str, task: Task, **extra: str):
    return client.post("/admin/tasks_app/task/", {"action": action, "_selected_action": [str(task.id)], **extra})


def listed(client, query: str) -> str:
    response = client.get(f"/admin/tasks_app/task/{query}")
    assert response.status_code == 200
    return response.content.decode()


def test_the_task_list_filters_by_status_tenant_agent_and_age_and_searches(alice, mallory, operator):
    fresh, old = new_task(alice), new_task(alice, idempotency_key="nightly-run-7")
    Task.objects.filter(id=old.id).update(created_at=timezone.now() - timedelta(days=9))
    other = new_task(mallory)
    Task.objects.filter(id=other.id).update(status="paused")

    assert str(other.id) in listed(operator, "?status__exact=paused")
    assert str(fresh.id) not in listed(operator, "?status__exact=paused")
    by_tenant = listed(operator, f"?tenant__id__exact={alice.tenant.id}")
    assert str(fresh.id) in by_tenant and str(other.id) not in by_tenant
    assert str(fresh.id) in listed(operator, "?agent=noop")
    recent, week_old = listed(operator, "?age=1d"), listed(operator, "?age=old")
    assert str(fresh.id) in recent and str(old.id) not in recent
    assert str(old.id) in week_old and str(fresh.id) not in week_old
    found = listed(operator, "?q=nightly-run-7")
    assert str(old.id) in found and str(fresh.id) not in found
    assert str(other.id) in listed(operator, "?q=globex")  # by tenant slug


def test_the_task_page_shows_its_history_and_nothing_on_it_can_be_edited_by_hand(alice, operator):
    task = new_task(alice, steps=3)
    run_to_end(task)
    task.refresh_from_db()
    page = operator.get(f"/admin/tasks_app/task/{task.id}/change/").content.decode()
    for heading in ("Checkpoints", "Steering commands", "Input requests", "Ledger entries", "Audit records"):
        assert heading in page, heading
    assert "3 steps" in page and f"?task__id__exact={task.id}" in page
    assert 'name="status"' not in page and 'name="state_version"' not in page and 'name="lease_owner"' not in page

    operator.post(
        f"/admin/tasks_app/task/{task.id}/change/",
        {"status": "queued", "state_version": "1", "lease_owner": "me", "priority": "0"},
    )
    after = Task.objects.get(id=task.id)
    assert (after.status, after.state_version, after.lease_owner, after.priority) == (
        "completed",
        task.state_version,
        None,
        task.priority,
    )
    assert operator.get("/admin/tasks_app/task/add/").status_code == 403  # tasks start via do_create_task
    steps = operator.get(f"/admin/tasks_app/step/?task__id__exact={task.id}")
    assert steps.status_code == 200


ACTIONS = [
    # (admin action, domain function patched, task factory, extra POST fields, status after, audit action)
    ("redrive", "do_redrive_task", dead_letter, {}, "recovering", "transition"),
    ("close", "do_close_task", dead_letter, {}, "failed", "transition"),
    ("release_lease", "do_release_lease", held_by_a_gone_worker, {}, "queued", "lease_released"),
    # the cancel command, as steering sends it: accepted, the transition, applied
    (
        "cancel",
        "do_cancel_task",
        new_task,
        {"apply": "1", "reason": "customer withdrew"},
        "cancelled",
        "steering_applied",
    ),
]


@pytest.mark.parametrize(
    ("action", "function", "make", "extra", "status", "audit_action"), ACTIONS, ids=[a[0] for a in ACTIONS]
)
def test_each_action_changes_state_only_through_its_domain_function_and_is_audited(
    alice, operator, action, function, make, extra, status, audit_action
):
    module = task_admin if function == "do_cancel_task" else operators
    real = getattr(module, function)

    task = make(alice)
    before = Task.objects.get(id=task.id)
    with mock.patch.object(module, function) as stub:  # the admin itself writes nothing
        assert post_action(operator, action, task, **extra).status_code == 302
    stub.assert_called_once()
    assert stub.call_args.kwargs["who"].actor == "admin:opal"
    unchanged = Task.objects.get(id=task.id)
    assert (unchanged.status, unchanged.state_version, unchanged.lease_epoch, unchanged.audit_seq) == (
        before.status,
        before.state_version,
        before.lease_epoch,
        before.audit_seq,
    )

    with mock.patch.object(module, function, wraps=real) as spy:
        assert post_action(operator, action, task, **extra).status_code == 302
    spy.assert_called_once()
    after = Task.objects.get(id=task.id)
    assert after.status == status
    record = AuditRecord.objects.filter(task=task).order_by("-seq").first()
    assert (record.actor, record.action) == ("admin:opal", audit_action)
    if action == "cancel":
        assert record.reason == "customer withdrew"
    if action == "release_lease":
        assert after.lease_owner is None and after.lease_epoch == before.lease_epoch + 1


def test_cancel_asks_for_the_reason_before_it_changes_anything(alice, operator):
    task = new_task(alice)
    page = post_action(operator, "cancel", task)
    assert page.status_code == 200 and 'name="reason"' in page.content.decode()
    assert Task.objects.get(id=task.id).status == "queued"
    empty = post_action(operator, "cancel", task, apply="1", reason="")
    assert empty.status_code == 200 and Task.objects.get(id=task.id).status == "queued"  # a reason is required
    assert post_action(operator, "cancel", task, apply="1", reason="duplicate").status_code == 302
    assert Task.objects.get(id=task.id).status == "cancelled"


def test_an_action_refused_by_the_domain_function_changes_nothing_and_says_why(alice, operator):
    task = new_task(alice)  # queued: not a dead letter
    response = post_action(operator, "redrive", task)
    assert response.status_code == 302
    assert Task.objects.get(id=task.id).status == "queued"
    messages = [str(m) for m in response.wsgi_request._messages]
    assert any("cannot become recovering" in m for m in messages), messages


@pytest.mark.parametrize("resolution", ["succeeded", "failed"])
def test_resolving_an_unknown_ledger_entry_goes_through_do_resolve_unknown(alice, operator, resolution):
    task = new_task(alice)
    entry = LedgerEntry.objects.create(
        tenant=alice.tenant,
        task=task,
        step_sequence=1,
        call_index=1,
        key=f"{task.id}:1:1",
        tool="content.publish",
        fingerprint="f",
        status="unknown",
        lease_epoch=1,
    )
    with mock.patch("ledger_app.admin.do_resolve_unknown", wraps=operators.do_resolve_unknown) as spy:
        response = operator.post(
            "/admin/ledger_app/ledgerentry/", {"action": f"resolve_{resolution}", "_selected_action": [str(entry.id)]}
        )
    assert response.status_code == 302
    spy.assert_called_once()
    assert spy.call_args.kwargs["who"].actor == "admin:opal"
    assert LedgerEntry.objects.get(id=entry.id).status == resolution
    record = AuditRecord.objects.filter(task=task, action="ledger_resolved").get()
    assert record.actor == "admin:opal" and record.data["status"] == resolution


def test_people_without_staff_status_do_not_reach_the_admin(alice, client):
    alice.user.set_password("pw")
    alice.user.save()
    client.login(username="alice", password="pw")
    response = client.get("/admin/tasks_app/task/")
    assert response.status_code == 302 and "/admin/login/" in response["Location"]


def test_kill_asks_for_the_reason_then_goes_through_the_steering_command_and_shows_the_kill_policy(alice, operator):
    task = new_task(alice)
    page = post_action(operator, "kill", task)
    assert page.status_code == 200 and 'name="reason"' in page.content.decode()
    assert "Kill Policy" in page.content.decode() and "payment.create" in page.content.decode()
    assert Task.objects.get(id=task.id).status == "queued"
    assert post_action(operator, "kill", task, apply="1", reason="runaway agent").status_code == 302
    task = Task.objects.get(id=task.id)
    assert task.status == "cancelled" and task.status_message == "killed: runaway agent"
    command = task.steering_commands.get()
    assert (command.type, command.status, command.requested_by) == ("kill", "applied", "admin:opal")
    assert AuditRecord.objects.filter(
        task=task, action="steering_accepted", actor="admin:opal", reason="runaway agent"
    ).exists()
