"""The accept reads what it decides on with the task row's lock (issue 14 made it one
statement): a command that waited for the lock decides on the row as its holder left it."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from django.db import connection

from conftest import database_url, wait_until
from steering_app.actions import do_enqueue_command
from steering_app.models import SteeringCommand
from tasks_app import leases
from tasks_app.access import console
from tasks_app.models import Task
from tasks_app.tests.test_engine import new_task

pytestmark = pytest.mark.django_db(transaction=True)


@contextmanager
def row_locked(task: Task) -> Iterator[psycopg.Connection[Any]]:
    """Another session holding the task's row lock until the block ends (and commits)."""
    with psycopg.connect(database_url()) as other:
        other.execute("SELECT 1 FROM tasks_app_task WHERE id = %s FOR UPDATE", [task.id])
        yield other


def waiting_for_a_lock() -> bool:
    with psycopg.connect(database_url().rsplit("/", 1)[0] + "/postgres", autocommit=True) as probe:
        row = probe.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND wait_event_type = 'Lock'",
            [connection.settings_dict["NAME"]],
        ).fetchone()
    return bool(row and row[0])


def in_thread(call: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(call())
        except BaseException as exc:  # noqa: BLE001 (reported by the test)
            out.append(exc)
        finally:
            connection.close()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def command(
    task: Task, command_id: str, type: str = "pause", payload: dict[str, Any] | None = None
) -> Callable[[], Any]:
    who = console(task.tenant, "user:test")
    return lambda: do_enqueue_command(
        task.id, who=who, command_id=command_id, type=type, payload=payload or {}, expected_version=task.state_version
    )


def test_a_command_that_waited_for_the_lock_applies_at_once_when_its_holder_let_the_lease_go(alice):
    task = new_task(alice, steps=10)
    leases.claim(task.id, worker_id="w1", ttl=60)  # a worker holds the task ...
    task.refresh_from_db()
    with row_locked(task) as holder:
        thread, out = in_thread(command(task, "p1"))
        wait_until(waiting_for_a_lock, timeout=30, what="the accept to wait for the row lock")
        # ... and lets it go at its safe point while the accept waits.
        holder.execute("UPDATE tasks_app_task SET lease_owner = NULL, lease_expires_at = NULL WHERE id = %s", [task.id])
    thread.join(30)
    assert not isinstance(out[0], BaseException), out
    accepted, created = out[0]
    assert created and accepted.status == "applied"  # nobody mid-step: applied now, not left pending
    assert Task.objects.get(id=task.id).status == "paused"


def test_two_sends_of_one_command_that_both_waited_for_the_lock_are_one_command_and_its_replay(alice):
    task = new_task(alice, steps=10)
    with row_locked(task):
        threads = [in_thread(command(task, "same", "set_priority", {"priority": 3})) for _ in range(2)]
        wait_until(waiting_for_a_lock, timeout=30, what="the accepts to wait for the row lock")
    answers = []
    for thread, out in threads:
        thread.join(30)
        assert not isinstance(out[0], BaseException), out
        answers.append(out[0])
    assert sorted(created for _, created in answers) == [False, True]
    assert answers[0][0].version == answers[1][0].version
    assert SteeringCommand.objects.filter(task=task).count() == 1
