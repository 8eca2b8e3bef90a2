"""Turns of a tenant at runtime.max_concurrent_tasks: a task turned away at capacity waits
(waiting_turn_since) and is rung when a turn frees. A slice that ends rings it; so must
every other way a turn frees: a lease taken away without its slice ending (a recovery, a
kill, a cancel or pause over a lost holder, a give-back, an expiry), and the waiting mark
itself, when the only running task ended between the capacity check and the mark.

Only the ring may wake the waiting task here: the stall scan that would also find it is
set to run in ten minutes (runtime.stall_seconds), and each woken task must start well
before that, on a real worker."""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from django.utils import timezone

from conftest import FAST_LEASES, Persona, Processes, database_url, purge_queues, wait_until
from steering_app.actions import do_cancel_task, do_enqueue_command
from tasks_app import engine, leases, operators
from tasks_app.access import console
from tasks_app.actions import do_create_task
from tasks_app.models import Task

pytestmark = pytest.mark.django_db(transaction=True)

# One turn per tenant; the stall scan (the backstop that re-finds a waiting task) far away.
TURNS = {"RUNTIME_MAX_CONCURRENT_TASKS": "1", "RUNTIME_STALL_SECONDS": "600"}
WOKEN_WITHIN = 30  # seconds: the ring, not the stall scan (600 s)


def noop(persona: Persona, steps: int, sleep_ms: int = 10) -> Task:
    return do_create_task(
        console(persona.tenant, "user:test"), agent="noop", input={"steps": steps, "sleepMs": sleep_ms}
    )[0]


def one_turn(settings: Any, **runtime: Any) -> None:
    """This process (where the actions under test commit, and ring) with the workers' limit."""
    settings.RUNTIME = {
        **settings.RUNTIME,
        "runtime": {**settings.RUNTIME["runtime"], "max_concurrent_tasks": 1, **runtime},
    }


def waiting(task: Task) -> bool:
    return Task.objects.filter(id=task.id, waiting_turn_since__isnull=False).exists()


def completes(task: Task, *, why: str) -> None:
    wait_until(
        lambda: Task.objects.get(id=task.id).status == "completed",
        timeout=WOKEN_WITHIN,
        what=lambda: (
            f"the waiting task to be rung and completed ({why}): "
            f"{Task.objects.values('status', 'waiting_turn_since', 'lease_owner').get(id=task.id)}"
        ),
    )


def run_out(task: Task) -> None:
    """The holder's lease runs out in its hands (a lost or frozen worker), no reaper yet."""
    Task.objects.filter(id=task.id).update(lease_expires_at=timezone.now() - timezone.timedelta(seconds=1))


def _kill(alice: Persona, held: Task, lease: leases.Lease) -> None:
    version = Task.objects.get(id=held.id).state_version
    do_enqueue_command(
        held.id,
        who=console(alice.tenant, "user:test"),
        command_id="k1",
        type="kill",
        payload={},
        expected_version=version,
        reason="stop it",
    )


def _cancel_over_a_lost_holder(alice: Persona, held: Task, lease: leases.Lease) -> None:
    run_out(held)
    do_cancel_task(held.id, who=console(alice.tenant, "user:test"), reason="no longer needed")


def _pause_over_a_lost_holder(alice: Persona, held: Task, lease: leases.Lease) -> None:
    run_out(held)
    version = Task.objects.get(id=held.id).state_version
    do_enqueue_command(
        held.id,
        who=console(alice.tenant, "user:test"),
        command_id="p1",
        type="pause",
        payload={},
        expected_version=version,
    )


def _reaper_dead_letters(alice: Persona, held: Task, lease: leases.Lease) -> None:
    run_out(held)
    operators.do_mark_recovering(held.id, actor="system:reaper", max_recoveries=0)


def _give_back(alice: Persona, held: Task, lease: leases.Lease) -> None:
    operators.do_give_back(lease, actor="worker:test")


def _abandon_step(alice: Persona, held: Task, lease: leases.Lease) -> None:
    operators.do_abandon_step(lease, step="step-1", seconds=1)  # max_recoveries 0: dead-lettered


def _expire(alice: Persona, held: Task, lease: leases.Lease) -> None:
    Task.objects.filter(id=held.id).update(expires_at=timezone.now() - timezone.timedelta(seconds=1))
    operators.do_expire_task(held.id, actor="system:reaper")


# What frees the turn, and the state it leaves the task that held it in: in none of them
# does that task run again, so no slice of it ends to ring the waiting one.
TAKEN_AWAY: dict[str, tuple[Callable[[Persona, Task, leases.Lease], None], str]] = {
    "kill": (_kill, "cancelled"),
    "cancel over a lost holder": (_cancel_over_a_lost_holder, "cancelled"),
    "pause over a lost holder": (_pause_over_a_lost_holder, "paused"),
    "reaper dead-letters": (_reaper_dead_letters, "dead_lettered"),
    "give-back after an infrastructure fault": (_give_back, "working"),
    "step past its deadline": (_abandon_step, "dead_lettered"),
    "expired": (_expire, "failed"),
}


@pytest.mark.parametrize("how", list(TAKEN_AWAY))
def test_a_turn_freed_without_a_slice_ending_rings_the_task_waiting_for_it(
    how: str, alice: Persona, processes: Processes, settings: Any
):
    """The held task's lease (claimed here, as its worker would) is taken away by an action
    of this process; the task turned away meanwhile must be rung on its commit and run by
    the worker, long before the stall scan. (A give-back leaves the held task runnable with
    no message: only its retry, which this test does not send, would run it.)"""
    one_turn(settings, max_recoveries=0)
    held, turned_away = noop(alice, steps=50), noop(alice, steps=3)
    purge_queues()  # their first messages: only a ring may bring the turned-away task to a worker
    lease = leases.claim(held.id, worker_id="test:1", ttl=600)
    assert lease is not None and engine._load(lease) is not None  # working, as a slice leaves it
    assert engine.run_slice(turned_away.id, worker_id="test:2") is engine.SliceOutcome.AT_CAPACITY
    assert waiting(turned_away)
    processes.worker(concurrency=1, ready=True, **TURNS)
    action, left_as = TAKEN_AWAY[how]
    action(alice, held, lease)
    assert Task.objects.get(id=held.id).status == left_as
    completes(turned_away, why=how)


def test_a_kill_of_the_running_task_rings_the_task_turned_away_on_another_worker(
    alice: Persona, processes: Processes, settings: Any
):
    """End to end: the one running task, on a real worker, is killed; its slice ends fenced out
    (nothing rings there), so the kill's commit must ring the task a second worker turned away."""
    one_turn(settings)
    env = {**FAST_LEASES, **TURNS, "RUNTIME_SCAN_SECONDS": "600", "RUNTIME_SLICE_STEPS": "1000"}
    processes.worker(concurrency=1, ready=True, **env)
    running = noop(alice, steps=600, sleep_ms=100)
    wait_until(lambda: Task.objects.get(id=running.id).steps_done >= 2, timeout=60, what="the task to run")
    processes.worker(concurrency=1, ready=True, **env)
    turned_away = noop(alice, steps=3)
    wait_until(lambda: waiting(turned_away), timeout=30, what="the second task to be turned away at capacity")
    _kill(alice, running, leases.Lease(running.id, "", 0))
    assert Task.objects.get(id=running.id).status == "cancelled"
    completes(turned_away, why="the running task was killed")


def test_a_lost_holders_pause_rings_the_task_turned_away(alice: Persona, processes: Processes, settings: Any):
    """End to end: the one running task's worker is frozen past its lease (no reaper runs); a
    pause then applies at once over the run-out lease and stops the task: its commit rings
    the task the other worker turned away."""
    one_turn(settings)
    env = {**FAST_LEASES, **TURNS, "RUNTIME_SCAN_SECONDS": "600", "RUNTIME_SLICE_STEPS": "1000"}
    holder = processes.worker(concurrency=1, ready=True, **env)
    running = noop(alice, steps=600, sleep_ms=100)
    wait_until(lambda: Task.objects.get(id=running.id).steps_done >= 2, timeout=60, what="the task to run")
    processes.worker(concurrency=1, ready=True, **env)
    turned_away = noop(alice, steps=3)
    wait_until(lambda: waiting(turned_away), timeout=30, what="the second task to be turned away at capacity")
    processes.kill(holder, signal.SIGSTOP)
    wait_until(
        lambda: Task.objects.filter(id=running.id, lease_expires_at__lt=timezone.now()).exists(),
        timeout=30,
        what="the frozen holder's lease to run out",
    )
    _pause_over_a_lost_holder(alice, running, leases.Lease(running.id, "", 0))
    assert Task.objects.get(id=running.id).status == "paused"
    completes(turned_away, why="the lost holder's task was paused")
    processes.kill(holder, signal.SIGCONT)


def test_a_task_turned_away_as_the_only_running_task_ends_rings_itself_after_its_waiting_mark(
    alice: Persona, processes: Processes, settings: Any
):
    """The race: the second task's claim finds the one turn taken, and before its waiting mark
    commits, the running task ends, and its slice rings nobody (nobody is marked yet). The
    mark is held back here by a row lock on the second task (its claim, refused by the count,
    locks no row; the mark does), while the first task is cancelled and its slice ends; then
    the lock goes. The turned-away task must look for a free turn once its mark commits."""
    one_turn(settings)
    env = {**TURNS, "RUNTIME_SCAN_SECONDS": "600", "RUNTIME_SLICE_STEPS": "1000"}
    first_worker = processes.worker(concurrency=1, ready=True, **env)
    running = noop(alice, steps=600, sleep_ms=100)
    wait_until(lambda: Task.objects.get(id=running.id).steps_done >= 2, timeout=60, what="the task to run")
    # Its message waits: the one worker is busy with the running task (prefetch 1, acks late).
    turned_away = noop(alice, steps=3)
    with psycopg.connect(database_url()) as lock:
        marked = lock.execute(
            f"SELECT waiting_turn_since FROM {Task._meta.db_table} WHERE id = %s FOR UPDATE",  # noqa: S608
            [turned_away.id],
        ).fetchone()
        assert marked == (None,)
        processes.worker(concurrency=1, ready=True, **env)
        wait_until(
            lock_waits_for_the_mark,
            timeout=30,
            what="the second worker's claim to be refused at capacity and its waiting mark to wait for the lock",
        )
        do_cancel_task(running.id, who=console(alice.tenant, "user:test"), reason="done with it")
        wait_until(lambda: Task.objects.get(id=running.id).status == "cancelled", timeout=30, what="the cancel")
        log = Path(first_worker.log_path)  # type: ignore[attr-defined]
        wait_until(
            lambda: "succeeded" in log.read_text(errors="replace"),
            timeout=30,
            what="the running task's slice (and its ring, which finds nobody marked) to end",
        )
        assert not waiting(turned_away)
        lock.rollback()
    completes(turned_away, why="its own waiting mark, committed after the only running task ended")


def lock_waits_for_the_mark() -> bool:
    """A waiting mark (wait_for_turn's UPDATE) waits for a row lock; no claim waits for one."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
            " AND query LIKE %s AND query LIKE %s",
            ["UPDATE%", "%waiting_turn_since%"],
        )
        return bool(cursor.fetchone()[0])
