"""Faults in-process against real PostgreSQL: crashes repeated inside one range of steps,
and infrastructure errors inside a step or its commit (issue 12)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from tasks_app import engine, recovery
from tasks_app.actions import do_create_task
from tasks_app.agents.base import Agent, StepContext, register
from tasks_app.audit import verify_chain
from tasks_app.models import Step, Task
from tasks_app.selectors import task_snapshot
from tasks_app.tests.test_engine import expire_lease, run_to_end

pytestmark = pytest.mark.django_db(transaction=True)


class Killed(BaseException):  # noqa: N818
    """Stands in for SIGKILL: the engine catches no BaseException, so the slice dies where it
    is, holding its lease, and commits nothing more."""


CRASHED: Counter[str] = Counter()  # per task: how many of its planned crashes happened


@register
class CrashingAgent(Agent):
    """`steps` steps; its worker "dies" (Killed) on reaching each sequence of `crashAt` in turn."""

    name = "test_crashing"
    input_schema = {"type": "object"}

    def start(self, input: dict[str, Any], goal: str) -> dict[str, Any]:
        return {"done": 0, "total": input["steps"]}

    def next_step(self, state: dict[str, Any]) -> str | None:
        return f"s{state['done'] + 1}" if state["done"] < state["total"] else None

    def run_step(self, ctx: StepContext, state: dict[str, Any]) -> dict[str, Any]:
        plan, crashed = ctx.input.get("crashAt", []), CRASHED[ctx.task_id]
        if crashed < len(plan) and ctx.sequence == plan[crashed]:
            CRASHED[ctx.task_id] += 1
            raise Killed
        done = state["done"] + 1
        ctx.progress(done / state["total"], phase="counting", message=f"step {done} of {state['total']}")
        return {**state, "done": done}

    def result(self, state: dict[str, Any]) -> dict[str, Any]:
        return {"steps": state["done"]}


def crash_then_recover(task: Task) -> dict[str, Any]:
    """Run a slice that dies; the reaper then finds its lease expired. The snapshot between."""
    with pytest.raises(Killed):
        engine.run_slice(task.id, worker_id="doomed")
    shown = task_snapshot(Task.objects.get(id=task.id))
    expire_lease(task)
    assert recovery.do_mark_recovering(task.id, actor="system:reaper") is not None
    return shown


def attempts(task: Task) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for sequence, attempt in Step.objects.filter(task=task).order_by("sequence", "attempt").values_list(
            "sequence", "attempt"):
        out.setdefault(sequence, []).append(attempt)
    return out


def test_crashes_repeated_inside_one_range_of_steps_rerun_them_as_new_attempts(alice):
    # Checkpoint at 10; the first worker dies in step 14 (11-13 committed after the
    # checkpoint), the second while re-running step 12, inside the same range.
    task, _ = do_create_task(alice.tenant, actor="user:test", agent="test_crashing",
                             input={"steps": 20, "crashAt": [14, 12]}, checkpoint_policy={"everySteps": 10})
    first = crash_then_recover(task)
    second = crash_then_recover(task)
    assert run_to_end(task, worker="survivor")[-1] is engine.SliceOutcome.DONE

    task.refresh_from_db()
    assert task.status == "completed" and task.result == {"steps": 20} and task.recoveries == 2
    # Each re-run is a new attempt of its step, numbered after the ones before it.
    assert attempts(task) == {**{s: [1] for s in range(1, 21)}, 11: [1, 2, 3], 12: [1, 2], 13: [1, 2]}
    # What people saw never went back: the re-run of 11 did not undo 12 and 13.
    assert (first["stepsDone"], first["progress"], first["statusMessage"]) == (13, 0.65, "step 13 of 20")
    assert (second["stepsDone"], second["progress"], second["statusMessage"]) == (13, 0.65, "step 13 of 20")
    progress = [e.data["progress"] for e in task.events.filter(type="progress").order_by("seq")]
    assert progress == sorted(progress)
    assert verify_chain(task) is None


def test_a_task_whose_steps_done_was_lowered_by_an_older_release_still_resumes(alice):
    # Releases before issue 12 lowered steps_done on a re-run; rows above it must not collide.
    task, _ = do_create_task(alice.tenant, actor="user:test", agent="test_crashing",
                             input={"steps": 12, "crashAt": [9]}, checkpoint_policy={"everySteps": 5})
    crash_then_recover(task)  # steps 1-8 committed, checkpoint at 5
    Task.objects.filter(id=task.id).update(steps_done=6)
    run_to_end(task, worker="survivor")
    task.refresh_from_db()
    assert task.status == "completed", task.error
    assert attempts(task) == {**{s: [1] for s in range(1, 13)}, 6: [1, 2], 7: [1, 2], 8: [1, 2]}
