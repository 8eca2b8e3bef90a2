"""Retention (beat job): events past the replay window and checkpoints past the newest K."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from checkpoints_app.models import Checkpoint
from tasks_app import engine, retention
from tasks_app.access import console
from tasks_app.actions import do_create_task
from tasks_app.models import Task, TaskEvent

pytestmark = pytest.mark.django_db


def run_to_end(task: Task) -> None:
    while engine.run_slice(task.id, worker_id="w1") is engine.SliceOutcome.CONTINUE:
        pass


def noop(alice, steps: int, **input) -> Task:
    return do_create_task(
        console(alice.tenant, "user:test"),
        agent="noop",
        input={"steps": steps, **input},
        checkpoint_policy={"everySteps": 1},
    )[0]


def test_events_of_tasks_ended_before_the_window_go_and_recent_ones_stay(alice):
    old, recent = noop(alice, 3), noop(alice, 3)
    run_to_end(old)
    run_to_end(recent)
    Task.objects.filter(id=old.id).update(finished_at=timezone.now() - timedelta(hours=1))
    assert TaskEvent.objects.filter(task=old).exists()
    trimmed = retention.trim_events(retention_seconds=900)
    assert trimmed > 0 and not TaskEvent.objects.filter(task=old).exists()
    assert TaskEvent.objects.filter(task=recent).exists()
    assert Task.objects.get(id=old.id).status == "completed"  # the task itself and its audit stay


def test_a_live_task_loses_only_its_old_progress_events(alice):
    task = noop(alice, 50)
    engine.run_slice(task.id, worker_id="w1")  # a slice's worth; the task is still running
    TaskEvent.objects.filter(task=task).update(created_at=timezone.now() - timedelta(hours=1))
    types_before = set(TaskEvent.objects.filter(task=task).values_list("type", flat=True))
    assert "progress" in types_before
    retention.trim_events(retention_seconds=900)
    types_after = set(TaskEvent.objects.filter(task=task).values_list("type", flat=True))
    assert types_after == types_before - {"progress"}


def test_only_the_newest_checkpoints_of_each_task_are_kept(alice):
    a, b = noop(alice, 8), noop(alice, 2)
    run_to_end(a)
    run_to_end(b)
    newest_a = list(Checkpoint.objects.filter(task=a).order_by("-sequence", "-id").values_list("id", flat=True)[:3])
    count_b = Checkpoint.objects.filter(task=b).count()
    assert Checkpoint.objects.filter(task=a).count() > 3 and count_b <= 3
    retention.trim_checkpoints(keep=3)
    assert list(Checkpoint.objects.filter(task=a).order_by("-sequence", "-id").values_list("id", flat=True)) == newest_a
    assert Checkpoint.objects.filter(task=b).count() == count_b
