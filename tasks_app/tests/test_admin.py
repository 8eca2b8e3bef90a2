"""Every model is in the admin, and its pages render for a superuser."""

from __future__ import annotations

import pytest
from django.contrib import admin
from django.contrib.auth import get_user_model

from tasks_app.tests.test_engine import new_task, run_to_end


@pytest.mark.django_db(transaction=True)
def test_admin_lists_render_for_every_registered_model(alice, client):
    run_to_end(new_task(alice, steps=3))
    get_user_model().objects.create_superuser("root", "root@example.com", "pw")
    client.login(username="root", password="pw")
    names = {m._meta.label for m in admin.site._registry}
    assert {
        "tasks_app.Task",
        "checkpoints_app.Checkpoint",
        "steering_app.SteeringCommand",
        "steering_app.InputRequest",
        "ledger_app.LedgerEntry",
        "tasks_app.AuditRecord",
    } <= names
    for model in admin.site._registry:
        url = f"/admin/{model._meta.app_label}/{model._meta.model_name}/"
        assert client.get(url).status_code == 200, url


@pytest.fixture
def operator_client(client, db):
    get_user_model().objects.create_superuser("opal", "opal@example.com", "pw")
    client.login(username="opal", password="pw")
    return client


def act(client, model: str, action: str, pk, **extra: str) -> None:
    app = {"task": "tasks_app", "ledgerentry": "ledger_app"}[model]
    response = client.post(f"/admin/{app}/{model}/", {"action": action, "_selected_action": [str(pk)], **extra})
    assert response.status_code == 302


@pytest.mark.django_db(transaction=True)
def test_admin_actions_go_through_the_domain_functions_and_are_audited(alice, operator_client):
    from tasks_app import leases, operators
    from tasks_app.models import AuditRecord, Task
    from tasks_app.tests.test_recovery import crash_mid_slice

    dead = new_task(alice)
    for _ in range(4):
        crash_mid_slice(dead)
        operators.do_mark_recovering(dead.id, actor="system:reaper", max_recoveries=3)
    act(operator_client, "task", "redrive", dead.id)
    assert Task.objects.get(id=dead.id).status == "recovering"
    assert AuditRecord.objects.filter(task=dead, actor="admin:opal", to_status="recovering").exists()

    held = new_task(alice)
    lease = leases.claim(held.id, worker_id="gone", ttl=300)
    act(operator_client, "task", "release_lease", held.id)
    assert Task.objects.get(id=held.id).lease_owner is None and not leases.renew(lease, ttl=30)
    assert AuditRecord.objects.filter(task=held, actor="admin:opal", action="lease_released").exists()

    queued = new_task(alice)
    act(operator_client, "task", "cancel", queued.id, apply="1", reason="no longer needed")
    assert Task.objects.get(id=queued.id).status == "cancelled"

    closed = new_task(alice)
    act(operator_client, "task", "close", closed.id)  # not a dead letter: refused, nothing changes
    assert Task.objects.get(id=closed.id).status == "queued"


@pytest.mark.django_db(transaction=True)
def test_resolving_an_unknown_effect_answers_the_waiting_task(alice, operator_client):
    from ledger_app.models import LedgerEntry
    from steering_app.models import InputRequest
    from tasks_app.models import AuditRecord, Task

    task = new_task(alice)
    Task.objects.filter(id=task.id).update(status="input_required")
    entry = LedgerEntry.objects.create(
        tenant=alice.tenant,
        task=task,
        step_sequence=1,
        call_index=1,
        key=f"{task.id}:1:1",
        tool="email.send",
        fingerprint="f",
        status="unknown",
        lease_epoch=1,
    )
    InputRequest.objects.create(
        tenant=alice.tenant,
        task=task,
        key=f"confirm-{entry.key}",
        kind="question",
        prompt="did it?",
        answer_schema={"enum": ["done", "not_done"]},
        step_sequence=1,
    )
    act(operator_client, "ledgerentry", "resolve_succeeded", entry.id)
    assert LedgerEntry.objects.get(id=entry.id).status == "succeeded"
    assert InputRequest.objects.get(task=task).answer == "done"
    assert Task.objects.get(id=task.id).status == "working"
    assert AuditRecord.objects.filter(task=task, actor="admin:opal", action="ledger_resolved").exists()
    # the answer went in as an ordinary command: accepted and applied, each audited
    assert AuditRecord.objects.filter(task=task, actor="admin:opal", action="steering_accepted").exists()
    assert AuditRecord.objects.filter(task=task, actor="admin:opal", action="steering_applied").exists()


@pytest.mark.django_db(transaction=True)
def test_resolving_an_effect_of_a_task_that_no_longer_takes_answers_still_resolves_it(alice, operator_client):
    from ledger_app.models import LedgerEntry
    from steering_app.models import InputRequest
    from tasks_app.models import Task

    task = new_task(alice)
    Task.objects.filter(id=task.id).update(status="cancelled")  # it refuses provide_input now
    entries = [
        LedgerEntry.objects.create(
            tenant=alice.tenant,
            task=task,
            step_sequence=1,
            call_index=i,
            key=f"{task.id}:1:{i}",
            tool="email.send",
            fingerprint="f",
            status="unknown",
            lease_epoch=1,
        )
        for i in (1, 2)
    ]
    for entry in entries:
        InputRequest.objects.create(
            tenant=alice.tenant,
            task=task,
            key=f"confirm-{entry.key}",
            kind="question",
            prompt="did it?",
            answer_schema={"enum": ["done", "not_done"]},
            step_sequence=1,
        )
    response = operator_client.post(
        "/admin/ledger_app/ledgerentry/",
        {"action": "resolve_succeeded", "_selected_action": [e.id for e in entries]},
        follow=True,
    )
    assert response.status_code == 200  # not a 500 halfway through the selection
    assert set(LedgerEntry.objects.filter(task=task).values_list("status", flat=True)) == {"succeeded"}
    assert set(InputRequest.objects.filter(task=task).values_list("status", flat=True)) == {"open"}
