"""A task's ending is one hook (tasks_app.actions.on_task_ended; steering registers
settle_on_end): every transition to a terminal status, whichever path takes it, rejects the
steering commands still pending (audited as the ending's actor, on the stream after the
terminal event) and withdraws the open questions, in the ending's transaction. A command
that ends the task itself (a cancel, a kill) is applied, not rejected by its own ending, and
nothing is settled twice. In-process, on PostgreSQL."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.db import transaction
from django.utils import timezone

from conftest import emits
from steering_app.actions import open_input_request
from steering_app.models import CommandStatus, InputRequest, InputStatus, SteeringCommand
from steering_app.tests.test_command_at_the_end import steer
from steering_app.tests.test_steering import mid_step, to_the_safe_point
from tasks_app import engine, leases, operators
from tasks_app.access import console
from tasks_app.actions import do_create_task, transition
from tasks_app.agents.base import Agent, StepContext, register
from tasks_app.audit import verify_chain
from tasks_app.models import AuditRecord, Task
from tasks_app.states import ALLOWED_TRANSITIONS, TERMINAL

pytestmark = pytest.mark.django_db

ENDINGS = sorted((before, to) for before, targets in ALLOWED_TRANSITIONS.items() for to in targets if to in TERMINAL)


def held_with_pending_commands(persona) -> tuple[Task, list[SteeringCommand]]:
    """A task a worker holds mid-step (a live lease): what is steered waits for its safe point."""
    task, _ = do_create_task(console(persona.tenant, "user:test"), agent="noop", input={"steps": 3})
    assert leases.claim(task.id, worker_id="w1", ttl=600) is not None
    Task.objects.filter(id=task.id).update(status="working")
    sent = [steer(persona, task, "adjust_goal", {"goal": "elsewhere"}), steer(persona, task, "pause", reason="coffee")]
    assert [c.status for c in sent] == [CommandStatus.PENDING] * 2
    return Task.objects.get(id=task.id), sent


def assert_settled(task_id: Any, sent: list[SteeringCommand], *, status: str, actor: str) -> None:
    task = Task.objects.get(id=task_id)
    assert task.status == status
    for command in SteeringCommand.objects.filter(id__in=[c.id for c in sent]):
        assert command.status == CommandStatus.REJECTED, (command.type, command.status)
        assert command.outcome == f"the task is {status}; it takes no more commands"
    rejections = AuditRecord.objects.filter(task=task, action="steering_rejected").values_list("actor", flat=True)
    assert list(rejections) == [actor] * len(sent)
    assert not InputRequest.objects.filter(task=task, status=InputStatus.OPEN).exists()
    assert verify_chain(task) is None


@pytest.mark.parametrize("before,to", ENDINGS)
def test_every_terminal_transition_settles_commands_and_withdraws_questions(alice, before, to) -> None:
    """The contract itself, for any path that ends a task through transition(), today's and
    tomorrow's: none of them has to remember to settle anything."""
    task, sent = held_with_pending_commands(alice)
    with transaction.atomic():
        open_input_request(Task.objects.get(id=task.id), key="why", prompt="why?", schema={}, step=1)
    Task.objects.filter(id=task.id).update(status=before)

    with (
        emits(
            task,
            events=["terminal", "steering.rejected", "steering.rejected"],
            audit=["transition", "steering_rejected", "steering_rejected"],
        ),
        transaction.atomic(),
    ):
        locked = Task.objects.select_for_update().get(id=task.id)
        locked.save(update_fields=transition(locked, to, actor="system:ending", reason="ended"))

    assert_settled(task.id, sent, status=to, actor="system:ending")
    assert InputRequest.objects.get(task=task, key="why").status == InputStatus.WITHDRAWN


def test_a_task_past_its_ttl_rejects_its_commands_as_the_reaper(alice) -> None:
    task, sent = held_with_pending_commands(alice)
    Task.objects.filter(id=task.id).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert operators.do_expire_task(task.id, actor="system:reaper") is not None
    assert_settled(task.id, sent, status="failed", actor="system:reaper")


def test_a_dead_letter_keeps_its_commands_and_an_operators_close_rejects_them(alice) -> None:
    task, sent = held_with_pending_commands(alice)
    Task.objects.filter(id=task.id).update(lease_expires_at=timezone.now() - timedelta(seconds=1))
    assert operators.do_mark_recovering(task.id, actor="system:reaper", max_recoveries=0) is not None
    assert Task.objects.get(id=task.id).status == "dead_lettered"  # held, not ended: a redrive applies them
    assert SteeringCommand.objects.filter(task=task, status=CommandStatus.PENDING).count() == 2

    operators.do_close_task(task.id, who=console(alice.tenant, "admin:root"), reason="giving up")
    assert_settled(task.id, sent, status="failed", actor="admin:root")


# The operator steers while the step runs, then the step fails (the test sets both).
DURING_STEP: list[Any] = []


@register
class SteeredThenFailingAgent(Agent):
    name = "test_steered_then_failing"
    input_schema = {"type": "object"}

    def start(self, input: dict[str, Any], goal: str) -> dict[str, Any]:
        return {}

    def next_step(self, state: dict[str, Any]) -> str | None:
        return "s1"

    def run_step(self, ctx: StepContext, state: dict[str, Any]) -> dict[str, Any]:
        while DURING_STEP:
            DURING_STEP.pop()()
        raise RuntimeError("the step broke")


def test_a_failed_step_rejects_the_commands_sent_during_it_as_its_worker(alice) -> None:
    task, _ = do_create_task(console(alice.tenant, "user:test"), agent="test_steered_then_failing", input={})
    sent: list[SteeringCommand] = []
    DURING_STEP.append(lambda: sent.append(steer(alice, task, "adjust_goal", {"goal": "elsewhere"})))
    assert engine.run_slice(task.id, worker_id="w1") is engine.SliceOutcome.DONE
    assert len(sent) == 1
    assert_settled(task.id, sent, status="failed", actor="worker:w1")


def test_a_kill_applies_itself_and_rejects_the_commands_before_it_once(alice) -> None:
    """The ending comes from a command: the kill is applied (not rejected by the end it
    makes), and what waited before it is rejected once, after it, in accepted order."""
    task, sent = held_with_pending_commands(alice)
    with emits(
        task,
        events=["terminal", "steering.applied", "steering.rejected", "steering.rejected"],
        audit=["steering_accepted", "transition", "steering_applied", "steering_rejected", "steering_rejected"],
    ):
        kill = steer(alice, task, "kill", reason="wrong customer")
    assert SteeringCommand.objects.get(id=kill.id).status == CommandStatus.APPLIED
    assert_settled(task.id, sent, status="cancelled", actor="user:op")


def test_a_cancel_the_reaper_applies_is_applied_and_what_came_after_rejected_once(alice) -> None:
    """A cancel accepted while the worker held the task, a goal after it; the worker is lost:
    the reaper applies the cancel (cancel always wins) and rejects the goal, once each."""
    task, _ = do_create_task(console(alice.tenant, "user:test"), agent="noop", input={"steps": 3})
    assert leases.claim(task.id, worker_id="w1", ttl=600) is not None
    Task.objects.filter(id=task.id).update(status="working")
    cancel = steer(alice, task, "cancel", reason="not needed")
    goal = steer(alice, task, "adjust_goal", {"goal": "elsewhere"})
    assert (cancel.status, goal.status) == (CommandStatus.PENDING, CommandStatus.PENDING)
    Task.objects.filter(id=task.id).update(lease_expires_at=timezone.now() - timedelta(seconds=1))
    with emits(
        task,
        events=["terminal", "steering.applied", "steering.rejected"],
        audit=["transition", "steering_applied", "steering_rejected"],
    ):
        operators.do_mark_recovering(task.id, actor="system:reaper")
    assert SteeringCommand.objects.get(id=cancel.id).status == CommandStatus.APPLIED
    assert_settled(task.id, [goal], status="cancelled", actor="system:reaper")


def test_the_ending_applies_exactly_the_command_it_is_handed_and_rejects_the_others_once(alice) -> None:
    """transition(by_command=...): the ending is told which command makes it, and applies
    that one, first, and no other; two cancels wait, and the ending is handed the second."""
    task, sent = held_with_pending_commands(alice)
    first, second = steer(alice, task, "cancel", reason="first"), steer(alice, task, "cancel", reason="second")
    assert (first.status, second.status) == (CommandStatus.PENDING, CommandStatus.PENDING)

    with (
        emits(
            task,
            events=["terminal", "steering.applied", "steering.rejected", "steering.rejected", "steering.rejected"],
            audit=["transition", "steering_applied", "steering_rejected", "steering_rejected", "steering_rejected"],
        ),
        transaction.atomic(),
    ):
        locked = Task.objects.select_for_update().get(id=task.id)
        ending = SteeringCommand.objects.get(id=second.id)
        locked.save(update_fields=transition(locked, "cancelled", actor="user:op", reason="second", by_command=ending))

    assert ending.status == CommandStatus.APPLIED  # the object handed over, as its caller goes on with it
    assert SteeringCommand.objects.get(id=second.id).status == CommandStatus.APPLIED
    assert_settled(task.id, [*sent, first], status="cancelled", actor="user:op")
    # Applied at the version the ending moved from, as a command applied anywhere else.
    ended = AuditRecord.objects.get(task=task, action="transition", to_status="cancelled")
    applied = AuditRecord.objects.get(task=task, action="steering_applied")
    assert (applied.data["commandId"], applied.before_version) == (second.command_id, ended.before_version)


def test_a_second_cancel_accepted_at_the_safe_point_the_first_makes_is_answered_rejected(alice) -> None:
    """Two cancels: the first waits for the worker's safe point, the worker is lost, and the
    second is accepted with nobody mid-step. The first ends the task and is applied by that
    end; the second is rejected by it, once, and its sender is told so."""
    task, _ = do_create_task(console(alice.tenant, "user:test"), agent="noop", input={"steps": 3})
    assert leases.claim(task.id, worker_id="w1", ttl=600) is not None
    Task.objects.filter(id=task.id).update(status="working")
    first = steer(alice, task, "cancel", reason="first")
    assert first.status == CommandStatus.PENDING
    Task.objects.filter(id=task.id).update(lease_expires_at=timezone.now() - timedelta(seconds=1))

    with emits(
        task,
        events=["terminal", "steering.applied", "steering.rejected"],
        audit=["steering_accepted", "transition", "steering_applied", "steering_rejected"],
    ):
        second = steer(alice, task, "cancel", reason="second")

    assert (second.status, second.outcome) == (
        CommandStatus.REJECTED,
        "the task is cancelled; it takes no more commands",
    )
    assert SteeringCommand.objects.get(id=first.id).status == CommandStatus.APPLIED
    assert_settled(task.id, [second], status="cancelled", actor="user:op")
    assert Task.objects.get(id=task.id).cancel_reason == "first"
    ended = AuditRecord.objects.get(task=task, action="transition", to_status="cancelled")
    applied = AuditRecord.objects.get(task=task, action="steering_applied")
    assert (applied.data["commandId"], applied.before_version) == (first.command_id, ended.before_version)


@pytest.mark.parametrize("type,payload", [("cancel", {}), ("pause", {}), ("adjust_goal", {"goal": "elsewhere"})])
def test_a_cancel_its_worker_applies_ends_the_task_there_and_what_came_after_is_rejected(
    alice, settings, type, payload
) -> None:
    """A cancel, then another command, both waiting for the worker's safe point. The worker
    applied the cancel as a request only and went on applying: the command after it was
    applied too (a pause made the task paused on its way to cancelled, a second cancel put
    its reason over the first's), where the reaper or an accept at a safe point applies the
    cancel, ends the task with it and rejects what came after. The same commands now settle
    the same way whoever reaches the safe point."""
    task, lease = mid_step(alice, settings)
    plan_version = task.plan_version
    first = steer(alice, task, "cancel", reason="first")
    after = steer(alice, task, type, payload, reason="second")
    assert (first.status, after.status) == (CommandStatus.PENDING, CommandStatus.PENDING)

    with emits(
        task,
        events=["terminal", "steering.applied", "steering.rejected", "checkpoint"],
        audit=["transition", "steering_applied", "steering_rejected"],
    ):
        assert to_the_safe_point(lease) is engine.SliceOutcome.DONE

    assert SteeringCommand.objects.get(id=first.id).status == CommandStatus.APPLIED
    assert_settled(task.id, [after], status="cancelled", actor="worker:w2")
    ended = Task.objects.get(id=task.id)
    assert (ended.cancel_reason, ended.status_message, ended.plan_version) == ("first", "first", plan_version)
    assert list(AuditRecord.objects.filter(task=task, action="transition").values_list("to_status", flat=True))[
        -1:
    ] == ["cancelled"]
    assert not AuditRecord.objects.filter(task=task, action="transition", to_status="paused").exists()
