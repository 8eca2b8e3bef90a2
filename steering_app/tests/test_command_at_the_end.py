"""A command accepted after a task's last safe point, while its worker finishes it (between
the last step's commit and the completion): the worker goes back to the safe point instead
of completing over it. A pause landed as "pausing" there, which cannot become "completed":
the completion raised, the slice crashed and the task waited out its lease to be recovered;
another command stayed pending on the completed task."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from steering_app.actions import do_enqueue_command
from steering_app.models import CommandStatus, SteeringCommand
from tasks_app import engine
from tasks_app.access import console
from tasks_app.actions import do_create_task
from tasks_app.agents.base import Agent, StepContext, register
from tasks_app.audit import verify_chain
from tasks_app.models import Task

pytestmark = pytest.mark.django_db

# What the operator does while the worker works out the result (the test sets it).
AT_RESULT: list[Callable[[], Any]] = []


@register
class LateSteeringAgent(Agent):
    name = "test_late_steering"
    input_schema = {"type": "object"}

    def start(self, input: dict[str, Any], goal: str) -> dict[str, Any]:
        return {"n": 0}

    def next_step(self, state: dict[str, Any]) -> str | None:
        return f"s{state['n'] + 1}" if state["n"] < 2 else None

    def run_step(self, ctx: StepContext, state: dict[str, Any]) -> dict[str, Any]:
        return {**state, "n": state["n"] + 1}

    def result(self, state: dict[str, Any]) -> dict[str, Any]:
        while AT_RESULT:  # after the last safe point, before the completion's commit
            AT_RESULT.pop()()
        return {"n": state["n"]}


def steer(persona, task: Task, type: str, payload: dict[str, Any] | None = None, reason: str = "") -> SteeringCommand:
    version = Task.objects.get(id=task.id).state_version
    command, _ = do_enqueue_command(
        task.id,
        who=console(persona.tenant, "user:op"),
        command_id=f"{type}-{version}",
        type=type,
        payload=payload or {},
        expected_version=version,
        reason=reason,
    )
    return command


@pytest.mark.parametrize("type,payload", [("pause", {}), ("adjust_goal", {"goal": "elsewhere"})])
def test_a_command_accepted_as_the_task_completes_is_not_completed_over(alice, type, payload) -> None:
    task, _ = do_create_task(console(alice.tenant, "user:test"), agent="test_late_steering", input={})
    sent: list[SteeringCommand] = []
    AT_RESULT.append(lambda: sent.append(steer(alice, task, type, payload)))
    outcome = engine.run_slice(task.id, worker_id="w1")
    assert outcome is engine.SliceOutcome.DONE
    command = SteeringCommand.objects.get(id=sent[0].id)
    assert command.status == CommandStatus.APPLIED, (command.status, command.outcome)
    task.refresh_from_db()
    if type == "pause":
        assert task.status == "paused" and task.lease_owner is None
        steer(alice, task, "resume")
        assert engine.run_slice(task.id, worker_id="w1") is engine.SliceOutcome.DONE
        task.refresh_from_db()
    assert task.status == "completed" and task.result == {"n": 2}
    if type == "adjust_goal":
        assert task.goal == "elsewhere"
    assert not SteeringCommand.objects.filter(task=task, status=CommandStatus.PENDING).exists()
    assert verify_chain(task) is None
