"""Cancel always wins (issue 12): a cancel accepted while a pause is pending, or while the
task is about to wait for someone, ends the task; it is never left paused (or waiting) with
cancelRequested set. Through the REST API, with the engine run in-process."""

from __future__ import annotations

from typing import Any

import pytest

from steering_app.actions import do_cancel_task
from steering_app.models import SteeringCommand
from steering_app.tests.test_steering import steer
from tasks_app import engine, leases, operators
from tasks_app.access import console
from tasks_app.agents.base import Agent, StepContext, register
from tasks_app.audit import verify_chain
from tasks_app.models import AuditRecord, Step, Task
from tasks_app.tests.test_engine import new_task

pytestmark = pytest.mark.django_db


def safe_point(lease: leases.Lease) -> engine.SliceOutcome:
    """The worker holding `lease` reaches its next safe point (the rest of its slice)."""
    return engine._loop(
        engine._load(lease), leases.Heartbeat(lease, ttl=30, interval=10, abandon=operators.do_abandon_step)
    )


def cancelled(persona, task: Task, reason: str) -> Task:
    task.refresh_from_db()
    assert task.status == "cancelled" and task.cancel_reason == reason
    assert task.lease_owner is None
    assert AuditRecord.objects.filter(task=task, to_status="cancelled", reason=reason).exists()
    assert not SteeringCommand.objects.filter(task=task, status="pending").exists()  # nothing left hanging
    snapshot = persona.client().get(f"/runtime/tasks/{task.id}").json()
    assert snapshot["status"] == "cancelled" and snapshot["runtimeStatus"] == "cancelled"
    assert snapshot["statusMessage"] == reason  # not what the task said before (a step's line, "paused by ...")
    assert verify_chain(task) is None
    return task


@pytest.mark.parametrize("how", ["steering", "rest"])
def test_a_cancel_after_a_pending_pause_ends_the_task_at_the_safe_point(alice, settings, how):
    settings.RUNTIME_SLICE_STEPS = 3
    task = new_task(alice, steps=10)
    engine.run_slice(task.id, worker_id="w1")
    lease = leases.claim(task.id, worker_id="w2", ttl=30)  # a worker is mid-step
    assert steer(alice, task, "pause").json()["status"] == "pending"
    if how == "steering":
        assert steer(alice, task, "cancel", reason="wrong customer").json()["status"] == "pending"
    else:
        response = alice.client().post(f"/runtime/tasks/{task.id}/cancel", {"reason": "wrong customer"}, format="json")
        assert response.status_code == 202 and response.json()["cancelRequested"] is True

    assert safe_point(lease) is engine.SliceOutcome.DONE
    cancelled(alice, task, "wrong customer")
    assert Step.objects.filter(task=task).count() == 3  # no step after the safe point
    # Both commands show in the history as applied, in order, and the cancel won: REST's
    # /cancel is the same cancel command as steering's.
    history = alice.client().get(f"/runtime/tasks/{task.id}/steering").json()["results"]
    assert [(c["type"], c["status"]) for c in history] == [("pause", "applied"), ("cancel", "applied")]


def test_a_cancel_accepted_while_a_pause_waits_for_the_next_slice_settles_the_pause_too(alice, settings):
    # The pause was accepted under a lease; the slice ended (yield) before applying it, so no
    # worker holds the task when the cancel comes: both apply now, in the order accepted.
    settings.RUNTIME_SLICE_STEPS = 3
    task = new_task(alice, steps=10)
    engine.run_slice(task.id, worker_id="w1")
    lease = leases.claim(task.id, worker_id="w2", ttl=30)
    assert steer(alice, task, "pause").json()["status"] == "pending"
    Task.objects.filter(id=task.id).update(lease_owner=None, lease_expires_at=None)  # the slice yielded
    assert steer(alice, task, "cancel", reason="changed my mind").json()["status"] == "applied"
    cancelled(alice, task, "changed my mind")
    assert engine.run_slice(task.id, worker_id="w3") is engine.SliceOutcome.DROPPED
    assert lease.epoch < Task.objects.get(id=task.id).lease_epoch  # and w2 is fenced out


@register
class AskAfterCancelAgent(Agent):
    """One step that asks a question; while it runs, someone cancels the task over REST."""

    name = "test_ask_after_cancel"
    input_schema = {"type": "object"}

    def start(self, input: dict[str, Any], goal: str) -> dict[str, Any]:
        return {"asked": False}

    def next_step(self, state: dict[str, Any]) -> str | None:
        return None if state["asked"] else "ask"

    def run_step(self, ctx: StepContext, state: dict[str, Any]) -> dict[str, Any]:
        task = Task.objects.get(id=ctx.task_id)
        do_cancel_task(task.id, who=console(task.tenant, "user:someone"), reason="too late for questions")
        ctx.ask("go-on", "Go on?", {"type": "boolean"})
        return {"asked": True}

    def result(self, state: dict[str, Any]) -> dict[str, Any]:
        return {}


def test_a_cancel_during_a_step_that_then_asks_a_question_ends_the_task(alice):
    from tasks_app.actions import do_create_task

    task, _ = do_create_task(console(alice.tenant, "user:test"), agent="test_ask_after_cancel", input={})
    assert engine.run_slice(task.id, worker_id="w1") is engine.SliceOutcome.DONE
    cancelled(alice, task, "too late for questions")
