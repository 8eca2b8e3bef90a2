"""Taking a task over from a lost lease holder, with real worker and beat processes on
PostgreSQL and Redis: every loss counted once, by whoever finds it first (the reaper, or the
worker whose message finds the lease run out), and a poison step held after max_recoveries."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from django.utils import timezone

from conftest import FAST_LEASES, Processes, wait_until
from tasks_app.access import console
from tasks_app.actions import do_create_task
from tasks_app.audit import verify_chain
from tasks_app.models import AuditRecord, Task

pytestmark = pytest.mark.django_db(transaction=True)


def recoveries_audited(task: Task) -> list[dict]:
    return list(
        AuditRecord.objects.filter(task=task)
        .filter(to_status__in=["recovering", "dead_lettered"])
        .exclude(from_status="dead_lettered")
        .values_list("data", flat=True)
    ) + list(AuditRecord.objects.filter(task=task, action="recovery").values_list("data", flat=True))


def test_a_step_that_kills_only_its_pool_process_is_held_after_max_recoveries(
    alice, processes: Processes, tmp_path: Path
):
    runs = tmp_path / "runs"
    env = {**FAST_LEASES, "RUNTIME_MAX_RECOVERIES": "2", "RUNTIME_TEST_WORKER_KILLS": str(runs)}
    worker = processes.worker(concurrency=1, **env)
    processes.worker(concurrency=1, **env)
    processes.beat(**env)
    task, _ = do_create_task(console(alice.tenant, "user:test"), agent="kills_its_process", input={})
    wait_until(
        lambda: Task.objects.get(id=task.id).status not in ("queued", "working", "recovering"),
        timeout=120,
        what=lambda: f"the task to be held: {Task.objects.values('status', 'recoveries').get(id=task.id)}",
    )
    task.refresh_from_db()
    assert task.status == "dead_lettered" and task.recoveries == 3, (task.status, task.recoveries)
    assert task.error["code"] == "max_recoveries_exceeded"
    assert len(runs.read_text().split()) == 3  # one run per loss, each loss counted once
    counts = sorted(d["recoveries"] for d in recoveries_audited(task))
    assert counts == [1, 2, 3], counts
    assert worker.poll() is None
    assert verify_chain(task) is None


def test_a_worker_frozen_past_its_lease_and_thawed_costs_one_recovery(alice, processes: Processes):
    env = {**FAST_LEASES, "RUNTIME_SLICE_STEPS": "1000"}
    frozen = processes.worker(concurrency=1, ready=True, **env)
    task, _ = do_create_task(console(alice.tenant, "user:test"), agent="noop", input={"steps": 80, "sleepMs": 100})
    wait_until(lambda: Task.objects.get(id=task.id).steps_done >= 5, timeout=60, what="5 steps")
    processes.kill(frozen, signal.SIGSTOP)
    processes.worker(concurrency=1, **env)
    processes.beat(**env)
    wait_until(lambda: Task.objects.get(id=task.id).recoveries >= 1, timeout=60, what="the recovery")
    wait_until(lambda: Task.objects.get(id=task.id).steps_done >= 20, timeout=60, what="20 steps")
    processes.kill(frozen, signal.SIGCONT)
    wait_until(lambda: Task.objects.get(id=task.id).status == "completed", timeout=120, what="completion")
    task.refresh_from_db()
    assert task.recoveries == 1, task.recoveries
    assert verify_chain(task) is None


def test_a_tenant_at_its_limit_whose_running_task_lost_its_worker_gets_both_tasks_done(alice, processes: Processes):
    """runtime.max_concurrent_tasks=1: the one running task's worker is killed, and the task
    submitted meanwhile is turned away at capacity while the dead worker's lease holds. Once
    the lease runs out the lost task is recovered (counted once) and neither waits for ever."""
    # One slice for the whole run, so the first worker holds the lease when it is killed (its
    # slice used to end, and the task run out, while the second worker booted on a busy machine);
    # a lease of 8 s, so the new task's claim comes while the dead worker's lease still holds.
    env = {
        **FAST_LEASES,
        "RUNTIME_LEASE_SECONDS": "8",
        "RUNTIME_MAX_CONCURRENT_TASKS": "1",
        "RUNTIME_STALL_SECONDS": "600",
        "RUNTIME_SLICE_SECONDS": "600",
        "RUNTIME_SLICE_STEPS": "1000",
    }
    first = processes.worker(concurrency=1, ready=True, **env)
    who = console(alice.tenant, "user:test")
    lost, _ = do_create_task(who, agent="noop", input={"steps": 200, "sleepMs": 100})
    wait_until(lambda: Task.objects.get(id=lost.id).steps_done >= 3, timeout=60, what="3 steps")
    processes.worker(concurrency=2, ready=True, **env)
    processes.kill(first)
    waiting, _ = do_create_task(who, agent="noop", input={"steps": 5, "sleepMs": 10})
    wait_until(
        lambda: Task.objects.get(id=waiting.id).waiting_turn_since is not None,
        timeout=30,
        what="the new task to be turned away while the dead worker's lease holds",
    )
    processes.beat(**env)
    wait_until(
        lambda: (
            set(Task.objects.filter(id__in=[lost.id, waiting.id]).values_list("status", flat=True)) == {"completed"}
        ),
        timeout=90,
        what=lambda: (
            f"both to complete: {list(Task.objects.filter(id__in=[lost.id, waiting.id]).values('status', 'recoveries', 'waiting_turn_since'))}"
        ),
    )
    assert Task.objects.get(id=lost.id).recoveries == 1
    assert Task.objects.get(id=waiting.id).recoveries == 0


def test_a_pause_applied_while_the_holder_is_frozen_past_its_lease_lets_no_step_commit_after_the_thaw(
    alice, processes: Processes
):
    """The holder is frozen (SIGSTOP) in the middle of a step until its lease has run out; no
    beat. A pause then finds nobody mid-step and applies at once: paused. Thawed, the holder
    must not renew its lease or commit the step it was in: the task stays as it was paused."""
    from steering_app.actions import do_enqueue_command
    from tasks_app.models import Step

    env = {**FAST_LEASES, "RUNTIME_SLICE_STEPS": "1000"}
    holder = processes.worker(concurrency=1, ready=True, **env)
    who = console(alice.tenant, "user:test")
    task, _ = do_create_task(who, agent="noop", input={"steps": 200, "sleepMs": 300})
    wait_until(lambda: Task.objects.get(id=task.id).steps_done >= 3, timeout=60, what="3 steps")
    processes.kill(holder, signal.SIGSTOP)
    wait_until(
        lambda: Task.objects.filter(id=task.id, lease_expires_at__lt=timezone.now()).exists(),
        timeout=30,
        what="the frozen holder's lease to run out",
    )
    version = Task.objects.get(id=task.id).state_version
    do_enqueue_command(task.id, who=who, command_id="p1", type="pause", payload={}, expected_version=version)
    paused = Task.objects.get(id=task.id)
    assert paused.status == "paused"
    log = Path(holder.log_path)
    processes.kill(holder, signal.SIGCONT)
    wait_until(
        lambda: (
            "slice abandoned without writing" in log.read_text(errors="replace")
            or Step.objects.filter(task=task).count() > paused.steps_done
        ),
        timeout=30,
        what="the thawed holder to stop (or commit its step)",
    )
    final = Task.objects.get(id=task.id)
    assert final.status == "paused", final.status
    assert Step.objects.filter(task=task).count() == paused.steps_done == final.steps_done
