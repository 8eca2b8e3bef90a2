"""tasks_app/access.py and the actions that take a caller: who sees which task, and every
action refusing a caller below its role by itself, whatever edge called it (in-process)."""

from __future__ import annotations

import uuid

import pytest

from steering_app.actions import do_answer_input, do_cancel_task, do_enqueue_command
from steering_app.models import InputRequest, SteeringCommand
from tasks_app import access, operators
from tasks_app.actions import do_create_task
from tasks_app.auth import Principal
from tasks_app.errors import Forbidden, TaskNotFound
from tasks_app.models import AuditRecord, Task
from tasks_app.tests.test_engine import new_task

pytestmark = pytest.mark.django_db


def principal(persona) -> Principal:
    return Principal(tenant=persona.tenant, role=persona.role, actor=f"user:{persona.user.pk}")


def test_another_tenants_task_a_malformed_id_and_no_task_are_the_same_not_found(alice, mallory):
    task = new_task(alice)
    assert access.task_for(principal(alice), str(task.id)) == task
    assert access.task_for(alice.user, task.id) == task  # a signed-in person: their tenants' tasks
    for who, task_id in [(principal(mallory), str(task.id)), (mallory.user, task.id)]:
        with pytest.raises(TaskNotFound):
            access.task_for(who, task_id)
    for bad in ["not-a-uuid", str(uuid.uuid4())]:
        with pytest.raises(TaskNotFound):
            access.task_for(principal(alice), bad)
    assert list(access.visible_tasks(principal(mallory))) == []


def test_every_action_refuses_a_caller_below_its_role_and_writes_nothing(alice, victor):
    task = new_task(alice)
    Task.objects.filter(id=task.id).update(status="dead_lettered")
    InputRequest.objects.create(
        tenant=alice.tenant, task=task, key="q", prompt="?", answer_schema={}, step_sequence=1, kind="question"
    )
    viewer = principal(victor)
    calls = {
        "cancel": lambda: do_cancel_task(task.id, who=viewer, reason="no"),
        "steer": lambda: do_enqueue_command(
            task.id, who=viewer, command_id="c", type="kill", payload={}, expected_version=1, reason="no"
        ),
        "answer": lambda: do_answer_input(task.id, who=viewer, key="q", answer="yes"),
        "redrive": lambda: operators.do_redrive_task(task.id, who=viewer, reason="no"),
        "close": lambda: operators.do_close_task(task.id, who=viewer, reason="no"),
        "release": lambda: operators.do_release_lease(task.id, who=viewer, reason="no"),
    }
    before = Task.objects.get(id=task.id)
    for name, call in calls.items():
        with pytest.raises(Forbidden, match="operator role"):
            call()
        after = Task.objects.get(id=task.id)
        assert (after.status, after.state_version, after.audit_seq) == (
            before.status,
            before.state_version,
            before.audit_seq,
        ), name
    assert not SteeringCommand.objects.filter(task=task).exists()
    assert AuditRecord.objects.filter(task=task).count() == before.audit_seq


def test_an_approval_needs_the_approver_role_even_from_an_operator(alice):
    task = new_task(alice)
    Task.objects.filter(id=task.id).update(status="input_required")
    InputRequest.objects.create(
        tenant=alice.tenant, task=task, key="p", prompt="?", answer_schema={}, step_sequence=1, kind="approval"
    )
    operator = principal(alice)
    with pytest.raises(Forbidden, match="approver role"):
        do_answer_input(task.id, who=operator, key="p", answer="approve")
    with pytest.raises(Forbidden, match="approver role"):  # the steering command too: one rule
        do_enqueue_command(
            task.id,
            who=operator,
            command_id="c",
            type="provide_input",
            payload={"key": "p", "answer": "approve"},
            expected_version=Task.objects.get(id=task.id).state_version,
        )
    assert not SteeringCommand.objects.filter(task=task).exists()


def test_starting_a_task_needs_the_operator_role_and_a_refused_start_writes_and_enqueues_nothing(alice, victor):
    from django.test import TestCase

    read_only = [
        principal(victor),  # a viewer
        Principal(tenant=alice.tenant, role="operator", actor="key:narrow", scopes=frozenset({"read"})),  # a read key
    ]
    for who in read_only:
        with TestCase.captureOnCommitCallbacks() as on_commit, pytest.raises(Forbidden, match="operator role"):
            do_create_task(who, agent="noop", input={"steps": 1}, idempotency_key="k")
        assert on_commit == []  # no slice rung, no event sent
    assert not Task.objects.exists() and not AuditRecord.objects.exists()
    task, created = do_create_task(principal(alice), agent="noop", input={"steps": 1}, idempotency_key="k")
    assert created and task.tenant == alice.tenant and task.created_by == f"user:{alice.user.pk}"
