"""Real Celery worker and beat processes on real PostgreSQL and Redis.

The seed's acceptance rows "worker crash" and "duplicate message", plus a slice that is
delivered twice. Each test asserts the final state, the step count and that no step
committed before the last checkpoint ever ran twice.
"""

from __future__ import annotations

import uuid
from collections import Counter

import pytest
from django.db import connection

from checkpoints_app.models import Checkpoint
from conftest import FAST_LEASES, Processes, database_url, wait_until
from tasks_app.access import console
from tasks_app.actions import do_create_task
from tasks_app.audit import verify_chain
from tasks_app.models import Step, Task
from tasks_app.queue import enqueue_slice

pytestmark = pytest.mark.django_db(transaction=True)

# Short leases so a crash is noticed in seconds, not half a minute.
FAST = {**FAST_LEASES, "RUNTIME_SLICE_STEPS": "8"}


def status_of(task: Task) -> str:
    return Task.objects.values_list("status", flat=True).get(id=task.id)


def test_a_slice_delivered_many_times_runs_each_step_once(alice, processes: Processes):
    processes.worker(concurrency=2, **FAST)
    task, _ = do_create_task(console(alice.tenant, "user:test"), agent="noop", input={"steps": 40, "sleepMs": 20})
    # Duplicate doorbells while it runs: every one of them races the real one for the lease.
    for _ in range(12):
        enqueue_slice(task.id, task.priority)
    wait_until(lambda: status_of(task) == "completed", timeout=60, what="task to complete")
    steps = list(Step.objects.filter(task=task).values_list("sequence", "attempt"))
    assert sorted(seq for seq, _ in steps) == list(range(1, 41))
    assert {attempt for _, attempt in steps} == {1}
    task.refresh_from_db()
    assert task.result == {"steps": 40}
    # A duplicate that finds the lease held by a live worker drops itself: no worker was
    # lost, none counted (each failed claim asks whether the holder's lease ran out).
    assert (task.recoveries, task.infra_faults) == (0, 0), (task.recoveries, task.infra_faults)
    assert verify_chain(task) is None


def test_a_worker_killed_mid_run_is_replaced_and_the_task_resumes_from_its_checkpoint(alice, processes: Processes):
    first = processes.worker(**FAST)
    processes.beat(**FAST)
    task, _ = do_create_task(
        console(alice.tenant, "user:test"),
        agent="noop",
        input={"steps": 60, "sleepMs": 60},
        checkpoint_policy={"everySteps": 5},
    )
    wait_until(lambda: Task.objects.get(id=task.id).steps_done >= 17, timeout=60, what="17 steps")
    processes.kill(first)  # SIGKILL to the worker's whole process group, mid-step
    killed_at = Task.objects.get(id=task.id)
    checkpoint = Checkpoint.objects.filter(task=task).order_by("-sequence").first()
    assert killed_at.status == "working" and killed_at.lease_owner is not None
    assert checkpoint is not None and checkpoint.sequence >= 10

    processes.worker(**FAST)
    wait_until(lambda: status_of(task) == "completed", timeout=90, what="task to complete after the kill")
    task.refresh_from_db()
    assert task.result == {"steps": 60}
    assert task.lease_epoch > killed_at.lease_epoch

    rows = list(Step.objects.filter(task=task).values_list("sequence", "attempt", "worker"))
    per_sequence = Counter(seq for seq, _, _ in rows)
    assert sorted(per_sequence) == list(range(1, 61))
    # Nothing up to the checkpoint ran twice; only steps committed after it may have re-run
    # (DESIGN: recovery continues from the last checkpoint).
    assert all(per_sequence[s] == 1 for s in range(1, checkpoint.sequence + 1))
    assert all(n <= 2 for n in per_sequence.values())
    # The replacement started exactly at the checkpoint: not from zero, not from the last step.
    first_workers = {w for seq, _, w in rows if seq <= checkpoint.sequence}
    resumed = sorted(seq for seq, _, w in rows if w not in first_workers)
    assert resumed[0] == checkpoint.sequence + 1
    rerun = {seq for seq, attempt, _ in rows if attempt == 2}
    assert rerun == set(range(checkpoint.sequence + 1, killed_at.steps_done + 1))
    assert verify_chain(task) is None


def test_the_heartbeat_keeps_a_step_longer_than_the_lease(alice, processes: Processes):
    # Each step outlasts the 2 s lease; only the heartbeat keeps other workers (and the
    # scanner's re-enqueues) from taking the task over mid-step.
    env = {**FAST, "RUNTIME_LEASE_SECONDS": "2", "RUNTIME_HEARTBEAT_SECONDS": "0.5"}
    processes.worker(concurrency=2, **env)
    processes.beat(**env)
    task, _ = do_create_task(console(alice.tenant, "user:test"), agent="noop", input={"steps": 3, "sleepMs": 3000})
    wait_until(lambda: Task.objects.get(id=task.id).steps_done >= 1, timeout=30, what="the first step")
    for _ in range(4):
        enqueue_slice(task.id, task.priority)
    wait_until(lambda: status_of(task) == "completed", timeout=60, what="task to complete")
    task.refresh_from_db()
    assert task.lease_epoch == 1  # one claim, never taken over
    assert list(Step.objects.filter(task=task).values_list("sequence", "attempt").order_by("sequence")) == [
        (1, 1),
        (2, 1),
        (3, 1),
    ]


def test_a_worker_keeps_its_database_connection_from_slice_to_slice(alice, processes: Processes):
    # Celery's Django fixup closes a worker's connections around every task unless told
    # otherwise: every slice would connect to PostgreSQL afresh (runtime_site/celery.py).
    name = f"slices-{uuid.uuid4().hex[:12]}"
    processes.worker(**{**FAST, "RUNTIME_SLICE_STEPS": "1"}, DATABASE_URL=f"{database_url()}?application_name={name}")
    task, _ = do_create_task(console(alice.tenant, "user:test"), agent="noop", input={"steps": 30, "sleepMs": 30})
    sessions: set[int] = set()

    def finished() -> bool:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pid FROM pg_stat_activity WHERE application_name = %s", [name])
            sessions.update(pid for (pid,) in cursor.fetchall())
        return status_of(task) == "completed"

    wait_until(finished, timeout=60, interval=0.01, what="task to complete")
    assert Step.objects.filter(task=task).count() == 30  # 30 slices, one step each
    # The pool process's connection and its heartbeat thread's (and perhaps the worker's own).
    assert 1 <= len(sessions) <= 3, sessions
