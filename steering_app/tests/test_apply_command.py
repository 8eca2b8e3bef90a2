"""Steering's actions alone, in-process on a real database (the fast tier): what each writes
to the task row, and exactly which events and audit records it emits (conftest.emits)."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import transaction

from conftest import emits
from steering_app.actions import (
    STEERING_FIELDS,
    apply_command,
    apply_pending,
    do_answer_input,
    do_cancel_task,
    do_enqueue_command,
)
from steering_app.models import InputRequest, SteeringCommand
from tasks_app import leases
from tasks_app.access import console
from tasks_app.actions import transition
from tasks_app.errors import CommandRefused
from tasks_app.models import Task
from tasks_app.tests.test_engine import expire_lease, new_task

pytestmark = pytest.mark.django_db


# Written by their own UPDATE statements (tasks_app.audit, tasks_app.events), never by a save.
OWN_UPDATES = {"event_seq", "audit_seq", "audit_head"}


def row(task: Task) -> dict[str, Any]:
    return {f.name: getattr(task, f.attname) for f in Task._meta.concrete_fields if f.name not in OWN_UPDATES}


COMMANDS = [
    ("queued", "pause", {}),
    ("paused", "resume", {}),
    ("working", "cancel", {}),
    ("working", "kill", {}),
    ("working", "adjust_goal", {"goal": "shorter", "constraints": {"maxDocs": 3}}),
    ("input_required", "provide_input", {"key": "q", "answer": "yes"}),
    ("working", "set_priority", {"priority": 1}),
]


@pytest.mark.parametrize(("status", "type", "payload"), COMMANDS, ids=[c[1] for c in COMMANDS])
def test_every_field_a_command_changes_is_in_the_list_its_caller_saves(alice, status, type, payload):
    task = new_task(alice)
    Task.objects.filter(id=task.id).update(status=status, lease_owner="w1", lease_epoch=3)
    InputRequest.objects.create(tenant=alice.tenant, task=task, key="q", prompt="?", step_sequence=1)
    with transaction.atomic():
        locked = Task.objects.select_for_update().get(id=task.id)
        before = row(locked)
        command = SteeringCommand.objects.create(
            tenant=alice.tenant, task=locked, command_id="c", type=type, payload=payload, expected_version=1,
            requested_by="user:t", reason="because", version=2,
        )  # fmt: skip
        apply_command(locked, command, actor="user:t")
        changed = {name for name, value in row(locked).items() if value != before[name]}
    assert changed, "the command changed nothing: the test no longer tests anything"
    assert changed <= set(STEERING_FIELDS), changed - set(STEERING_FIELDS)


def test_transition_returns_every_field_it_changes(alice):
    task = new_task(alice)
    with transaction.atomic():
        locked = Task.objects.select_for_update().get(id=task.id)
        before = row(locked)
        fields = transition(locked, "cancelled", actor="user:t", reason="done")
        changed = {name for name, value in row(locked).items() if value != before[name]}
    assert changed and changed <= set(fields)


def test_a_pause_of_an_idle_task_is_accepted_applied_and_emitted_once(alice):
    task = new_task(alice)
    with emits(task, events=["steering.applied"], audit=["steering_accepted", "transition", "steering_applied"]):
        do_enqueue_command(
            task.id, who=console(alice.tenant, "user:t"), command_id="p", type="pause", payload={}, expected_version=1
        )
    assert Task.objects.get(id=task.id).status == "paused"


CANCELS = {
    # REST's /cancel, MCP's tasks/cancel and the admin
    "do_cancel_task": lambda task, who: do_cancel_task(task.id, who=who, reason="not needed"),
    # steering's cancel (REST, MCP's cancel_task, the dashboard, rt steer)
    "the cancel command": lambda task, who: do_enqueue_command(
        task.id, who=who, command_id="c", type="cancel", payload={}, expected_version=1, reason="not needed"
    ),
}


@pytest.mark.parametrize("cancel", CANCELS.values(), ids=CANCELS.keys())
def test_a_cancel_of_an_idle_task_is_one_command_accepted_and_applied_whoever_sends_it(alice, cancel):
    task = new_task(alice)
    audit = ["steering_accepted", "transition", "steering_applied"]
    with emits(task, events=["terminal", "steering.applied"], audit=audit):
        cancel(task, console(alice.tenant, "user:t"))
    task = Task.objects.get(id=task.id)
    assert task.status == "cancelled" and task.cancel_reason == "not needed"
    command = SteeringCommand.objects.get(task=task)
    assert (command.type, command.status, command.reason) == ("cancel", "applied", "not needed")


@pytest.mark.parametrize("cancel", CANCELS.values(), ids=CANCELS.keys())
def test_a_cancel_under_a_live_lease_is_asked_for_once_and_lands_at_the_workers_safe_point(alice, cancel):
    task = new_task(alice)
    lease = leases.claim(task.id, worker_id="w1", ttl=60)
    assert lease is not None
    who = console(alice.tenant, "user:t")
    with emits(task, events=[], audit=["steering_accepted"]):
        cancel(task, who)
    task = Task.objects.get(id=task.id)
    assert task.status == "queued" and task.cancel_requested and task.cancel_reason == "not needed"
    with emits(task, events=[], audit=[]):  # asked again before it lands: nothing more
        do_cancel_task(task.id, who=who, reason="again")
    # the worker's safe point (engine._apply_steering): the end applies the cancel, as anywhere else
    applied = ["transition", "steering_applied"]
    with emits(task, events=["terminal", "steering.applied"], audit=applied), transaction.atomic():
        held = leases.fenced(lease)
        apply_pending(held, actor="worker:w1")
        held.save(update_fields=STEERING_FIELDS)
    assert Task.objects.get(id=task.id).status == "cancelled"
    command = SteeringCommand.objects.get(task=task)
    assert (command.type, command.status) == ("cancel", "applied")


def test_a_cancel_asked_again_once_the_worker_lost_its_lease_lands_the_first_and_adds_no_refused_one(alice):
    task = new_task(alice)
    lease = leases.claim(task.id, worker_id="w1", ttl=60)
    assert lease is not None
    who = console(alice.tenant, "user:t")
    do_cancel_task(task.id, who=who, reason="not needed")
    expire_lease(task)  # the worker died before its safe point
    with emits(task, events=["terminal", "steering.applied"], audit=["transition", "steering_applied"]):
        do_cancel_task(task.id, who=who, reason="again")
    task = Task.objects.get(id=task.id)
    assert (task.status, task.cancel_reason, task.lease_owner) == ("cancelled", "not needed", None)
    assert task.lease_epoch > lease.epoch  # fenced: the worker, should it still run, commits nothing
    assert list(SteeringCommand.objects.filter(task=task).values_list("type", "status")) == [("cancel", "applied")]


def test_an_answer_emits_its_command_and_the_task_going_back_to_work(alice):
    task = new_task(alice)
    Task.objects.filter(id=task.id).update(status="input_required")
    InputRequest.objects.create(tenant=alice.tenant, task=task, key="q", prompt="?", step_sequence=1)
    audit = ["steering_accepted", "transition", "steering_applied"]
    with emits(task, events=["steering.applied"], audit=audit):
        do_answer_input(task.id, who=console(alice.tenant, "user:t"), key="q", answer="yes")
    assert Task.objects.get(id=task.id).status == "working"


def test_a_refused_command_emits_nothing(alice):
    task = new_task(alice)
    with emits(task, events=[], audit=[]), pytest.raises(CommandRefused):
        do_enqueue_command(
            task.id, who=console(alice.tenant, "user:t"), command_id="r", type="resume", payload={}, expected_version=1
        )
