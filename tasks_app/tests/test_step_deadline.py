"""A step past its deadline is abandoned by the heartbeat and the task recovered as after a
crash, with the diagnosis audited (in-process; tests/test_worker_lifecycle.py has the real
worker, whose stuck pool process is replaced)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tasks_app import engine
from tasks_app.access import console
from tasks_app.actions import do_create_task
from tasks_app.agents.base import Agent, StepContext, register
from tasks_app.models import AuditRecord, Step, Task

pytestmark = pytest.mark.django_db


@register
class HangingAgent(Agent):
    name = "test_hanging"
    input_schema = {"type": "object", "properties": {"hangSeconds": {"type": "number"}}}
    step_seconds = 0.3

    def start(self, input: dict[str, Any], goal: str) -> dict[str, Any]:
        return {"done": False, "hang": input.get("hangSeconds", 1.0)}

    def next_step(self, state: dict[str, Any]) -> str | None:
        return None if state["done"] else "wait-for-the-remote"

    def run_step(self, ctx: StepContext, state: dict[str, Any]) -> dict[str, Any]:
        time.sleep(state["hang"])  # stands in for a call that never answers
        return {**state, "done": True}

    def result(self, state: dict[str, Any]) -> dict[str, Any]:
        return {}


@pytest.fixture(autouse=True)
def quick_heartbeat(settings) -> None:
    settings.RUNTIME_HEARTBEAT_SECONDS = 0.1


# the heartbeat thread abandons the step on its own connection: it must see the task
@pytest.mark.django_db(transaction=True)
def test_a_step_past_the_agents_deadline_is_abandoned_and_the_task_recovered_with_the_diagnosis(alice):
    task, _ = do_create_task(console(alice.tenant, "user:test"), agent="test_hanging", input={})
    assert engine.run_slice(task.id, worker_id="w1") is engine.SliceOutcome.DROPPED  # its late commit is fenced off
    task.refresh_from_db()
    assert (task.status, task.recoveries, task.lease_owner, task.lease_epoch) == ("recovering", 1, None, 2)
    assert not Step.objects.filter(task=task).exists()
    record = AuditRecord.objects.filter(task=task, to_status="recovering").get()
    assert record.actor == "worker:w1"
    assert "step wait-for-the-remote ran past its deadline of 0.3s on w1" in record.reason
    assert record.data["cause"] == {
        "code": "step_deadline_exceeded",
        "step": "wait-for-the-remote",
        "deadlineSeconds": 0.3,
    }


# the heartbeat thread abandons the step on its own connection: it must see the task
@pytest.mark.django_db(transaction=True)
def test_without_a_declared_deadline_the_configured_one_holds(alice, settings, monkeypatch):
    settings.RUNTIME_STEP_SECONDS = 0.3
    monkeypatch.setattr(HangingAgent, "step_seconds", None)
    task, _ = do_create_task(console(alice.tenant, "user:test"), agent="test_hanging", input={})
    engine.run_slice(task.id, worker_id="w1")
    assert Task.objects.get(id=task.id).recoveries == 1


# the heartbeat thread abandons the step on its own connection: it must see the task
@pytest.mark.django_db(transaction=True)
def test_a_step_that_always_hangs_is_dead_lettered_after_max_recoveries(alice, settings):
    settings.RUNTIME = {**settings.RUNTIME, "runtime": {**settings.RUNTIME["runtime"], "max_recoveries": 2}}
    task, _ = do_create_task(console(alice.tenant, "user:test"), agent="test_hanging", input={"hangSeconds": 0.6})
    for _ in range(3):
        engine.run_slice(task.id, worker_id="w1")
    task.refresh_from_db()
    assert task.status == "dead_lettered" and task.recoveries == 3
    assert task.error["code"] == "max_recoveries_exceeded"
    assert task.error["cause"]["step"] == "wait-for-the-remote"
    assert engine.run_slice(task.id, worker_id="w1") is engine.SliceOutcome.DROPPED  # held for an operator


def test_an_agent_declaring_no_deadline_runs_its_step_however_long_it_takes(alice, settings, monkeypatch):
    settings.RUNTIME_STEP_SECONDS = 0.3
    monkeypatch.setattr(HangingAgent, "step_seconds", 0)  # 0: no limit, as in runtime.step_seconds
    task, _ = do_create_task(console(alice.tenant, "user:test"), agent="test_hanging", input={"hangSeconds": 0.8})
    engine.run_slice(task.id, worker_id="w1")
    task.refresh_from_db()
    assert (task.status, task.recoveries) == ("completed", 0)


@pytest.mark.parametrize("seconds", [-1, float("nan")])
def test_an_agent_declaring_a_deadline_that_is_no_duration_fails_its_step_with_that_diagnosis(
    alice, monkeypatch, seconds
):
    # Not abandoned at every beat until dead-lettered (negative), nor never (NaN): the agent's bug, named.
    monkeypatch.setattr(HangingAgent, "step_seconds", seconds)
    task, _ = do_create_task(console(alice.tenant, "user:test"), agent="test_hanging", input={"hangSeconds": 0.5})
    engine.run_slice(task.id, worker_id="w1")
    task.refresh_from_db()
    assert (task.status, task.recoveries) == ("failed", 0)
    assert task.error["code"] == "step_failed" and "step deadline" in task.error["message"]


@pytest.mark.parametrize("raw", ["-1", "nan", "inf"])
def test_a_configured_step_deadline_that_is_no_duration_stops_the_process_at_startup(raw):
    import os
    import subprocess
    import sys

    from conftest import ROOT

    run = subprocess.run(
        [sys.executable, "manage.py", "check"],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "RUNTIME_STEP_SECONDS": raw},
        timeout=120,
    )
    assert run.returncode != 0 and "step_seconds" in run.stderr, run.stderr[-2000:]


@register
class SlowToSumUpAgent(HangingAgent):
    """A quick step, then a slow result(): the runtime's work after a step is not the step's."""

    name = "test_slow_to_sum_up"

    def result(self, state: dict[str, Any]) -> dict[str, Any]:
        time.sleep(1.5)
        return {}


def test_a_step_that_returned_in_time_is_not_abandoned_for_what_the_slice_does_after_it(alice):
    task, _ = do_create_task(console(alice.tenant, "user:test"), agent="test_slow_to_sum_up", input={"hangSeconds": 0})
    engine.run_slice(task.id, worker_id="w1")
    task.refresh_from_db()
    assert (task.status, task.recoveries) == ("completed", 0)
