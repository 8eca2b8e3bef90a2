"""Recovery and operator actions in-process on PostgreSQL: the reaper's three scans,
max recoveries, TTL expiry, checkpoint schema migrations, redrive, close, release."""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection, transaction
from django.utils import timezone

from checkpoints_app import codec
from checkpoints_app.models import Checkpoint
from steering_app.actions import do_cancel_task
from tasks_app import engine, leases, operators, tasks
from tasks_app.access import console
from tasks_app.actions import do_create_task
from tasks_app.agents.base import Agent, StepContext, register
from tasks_app.audit import verify_chain
from tasks_app.errors import IllegalTransition, NoLease
from tasks_app.models import AuditRecord, Step, Task
from tasks_app.selectors import task_snapshot
from tasks_app.tests.test_engine import expire_lease, new_task, run_to_end

pytestmark = pytest.mark.django_db


def crash_mid_slice(task: Task, worker: str = "doomed") -> leases.Lease:
    """A worker claims the task and dies holding the lease (its lease then expires)."""
    lease = leases.claim(task.id, worker_id=worker, ttl=30)
    assert lease is not None
    expire_lease(task)
    return lease


def test_the_scans_find_expired_leases_stalled_tasks_and_expired_ttls(alice):
    live, dead, stalled, fresh, old = (new_task(alice) for _ in range(5))
    leases.claim(live.id, worker_id="a", ttl=30)
    crash_mid_slice(dead)
    Task.objects.filter(id=stalled.id).update(updated_at=timezone.now() - timedelta(seconds=120))
    Task.objects.filter(id=old.id).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert operators.expired_lease_ids() == [dead.id]
    assert [t for t, _ in leases.stalled(stall_seconds=60)] == [stalled.id]
    assert leases.stalled(stall_seconds=60) == []  # touched: left alone for another interval
    assert operators.expired_ttl_ids() == [old.id]
    assert fresh.id not in operators.expired_lease_ids()


def test_an_expired_lease_marks_the_task_recovering_and_the_next_worker_resumes_it(alice, settings):
    settings.RUNTIME_SLICE_STEPS = 6
    task = new_task(alice, steps=20, checkpoint_policy={"everySteps": 4})
    engine.run_slice(task.id, worker_id="w1")  # 6 steps, checkpoint at 4 and 6
    lost = crash_mid_slice(task)
    marked = operators.do_mark_recovering(task.id, actor="system:reaper")
    assert marked is not None and marked.status == "recovering" and marked.recoveries == 1
    assert marked.lease_owner is None and marked.lease_epoch == lost.epoch + 1
    assert operators.do_mark_recovering(task.id, actor="system:reaper") is None  # nothing expired now
    assert task.events.filter(type="recovering").count() == 1

    run_to_end(task, worker="w2")
    task.refresh_from_db()
    assert task.status == "completed" and task.recoveries == 1
    resumed = AuditRecord.objects.get(task=task, from_status="recovering", to_status="working")
    assert resumed.reason == "resumed from checkpoint 6"
    assert task.events.filter(type="task.snapshot", seq__gt=1).exists()  # a fresh snapshot
    assert verify_chain(task) is None


def test_a_task_that_keeps_losing_its_worker_is_dead_lettered_after_max_recoveries(alice):
    task = new_task(alice)
    for expected in (1, 2, 3):
        crash_mid_slice(task)
        assert operators.do_mark_recovering(task.id, actor="system:reaper", max_recoveries=3).recoveries == expected
    crash_mid_slice(task)
    task = operators.do_mark_recovering(task.id, actor="system:reaper", max_recoveries=3)
    assert task.status == "dead_lettered" and task.mcp_status == "working"
    assert task.error["code"] == "max_recoveries_exceeded"
    assert task.status_text() == "held for operator: too many recoveries without progress"
    assert task.events.filter(type="dead_lettered").exists()
    assert leases.claim(task.id, worker_id="w", ttl=30) is None  # held, not runnable


class WorkerDied(BaseException):
    """The worker process dies in the middle of a step (SIGKILL, the OOM killer): nothing of
    the slice runs on, no checkpoint, no release; its lease expires held. A BaseException,
    so that the engine's handling of a step's errors cannot catch it."""


DIED: set[tuple[str, int]] = set()  # (task id, sequence): where a MortalAgent's worker died once


@register
class MortalAgent(Agent):
    """Kills the worker running step `dieAt[i]`: once each, or with `poison` every time."""

    name = "test_mortal"

    def start(self, input: dict[str, Any], goal: str) -> dict[str, Any]:
        return {"n": 0}

    def next_step(self, state: dict[str, Any]) -> str | None:
        return f"s{state['n'] + 1}" if state["n"] < 20 else None

    def run_step(self, ctx: StepContext, state: dict[str, Any]) -> dict[str, Any]:
        if ctx.sequence in ctx.input["dieAt"] and (ctx.input.get("poison") or (ctx.task_id, ctx.sequence) not in DIED):
            DIED.add((ctx.task_id, ctx.sequence))
            raise WorkerDied
        return {"n": state["n"] + 1}

    def result(self, state: dict[str, Any]) -> dict[str, Any]:
        return {"steps": state["n"]}


def mortal_task(persona, **input: Any) -> Task:
    task, _ = do_create_task(
        console(persona.tenant, "user:test"), agent="test_mortal", input=input, checkpoint_policy={"everySteps": 3}
    )
    return task


def die_in_a_slice(task: Task) -> Task:
    """A worker runs the task until a step kills it; the reaper finds its lease expired."""
    with pytest.raises(WorkerDied):
        engine.run_slice(task.id, worker_id="mortal")
    expire_lease(task)
    recovered = operators.do_mark_recovering(task.id, actor="system:reaper", max_recoveries=3)
    assert recovered is not None
    return recovered


def test_a_task_that_gets_further_after_each_lost_worker_is_never_dead_lettered(alice, settings):
    """Workers lost at four far-apart steps, one more than max_recoveries: each time the task
    got beyond the furthest step it had committed before, so it is delayed, not held."""
    settings.RUNTIME_SLICE_STEPS = 100
    task = mortal_task(alice, dieAt=[4, 8, 12, 16])
    seen = [die_in_a_slice(task) for _ in range(4)]
    assert [(t.status, t.recoveries, t.recoveries_in_a_row, t.steps_done) for t in seen] == [
        ("recovering", n, 1, steps) for n, steps in ((1, 3), (2, 7), (3, 11), (4, 15))
    ]
    assert task_snapshot(seen[-1])["recoveriesInARow"] == 1
    assert run_to_end(task, worker="w2")[-1] is engine.SliceOutcome.DONE
    task.refresh_from_db()
    assert (task.status, task.result, task.recoveries) == ("completed", {"steps": 20}, 4)
    record = AuditRecord.objects.filter(task=task, to_status="recovering").last()
    assert record.data == {"recoveries": 4, "inARow": 1, "stepsDone": 15}
    assert "recovery 4, 1 in a row without progress beyond step 15" in record.reason
    assert verify_chain(task) is None


def test_a_step_that_kills_every_worker_is_dead_lettered_after_max_recoveries_and_redrive_resets(alice, settings):
    """The poison step 5 comes after checkpoint 3: each worker re-runs step 4 (committed
    before, no progress) and dies at 5 again. The first loss made progress (from nothing to
    step 4), the next three none: the fourth recovery in a row holds the task."""
    settings.RUNTIME_SLICE_STEPS = 100
    task = mortal_task(alice, dieAt=[5], poison=True)
    seen = [die_in_a_slice(task) for _ in range(4)]
    assert [(t.status, t.recoveries_in_a_row, t.steps_done) for t in seen] == [
        ("recovering", 1, 4),
        ("recovering", 2, 4),
        ("recovering", 3, 4),
        ("dead_lettered", 4, 4),
    ]
    assert set(Step.objects.filter(task=task, sequence=4).values_list("attempt", flat=True)) == {1, 2, 3, 4}
    held = seen[-1]
    assert held.error["code"] == "max_recoveries_exceeded"
    assert "recovery 4, 4 in a row without progress beyond step 4 exceeds max_recoveries=3" in held.error["message"]
    assert held.status_text() == "held for operator: too many recoveries without progress"
    assert task_snapshot(held)["recoveriesInARow"] == 4
    assert AuditRecord.objects.get(task=task, to_status="dead_lettered").data["inARow"] == 4

    # A redrive starts the count afresh (as it always reset recoveries): the poison step
    # kills again, and the count goes 1, 2, ... from the redrive's high-water mark.
    redriven = operators.do_redrive_task(task.id, who=console(task.tenant, "admin:op"), reason="try again")
    assert (redriven.recoveries, redriven.recoveries_in_a_row, redriven.recovered_at_step) == (0, 0, 4)
    assert [(t.status, t.recoveries, t.recoveries_in_a_row) for t in (die_in_a_slice(task), die_in_a_slice(task))] == [
        ("recovering", 1, 1),
        ("recovering", 2, 2),
    ]
    task.refresh_from_db()
    assert verify_chain(task) is None


def test_a_task_past_its_ttl_fails_with_the_reason(alice):
    task, _ = do_create_task(console(alice.tenant, "user:test"), agent="noop", input={"steps": 5}, ttl_seconds=60)
    assert task.expires_at is not None
    lease = leases.claim(task.id, worker_id="busy", ttl=30)
    Task.objects.filter(id=task.id).update(expires_at=timezone.now() - timedelta(seconds=1))
    expired = operators.do_expire_task(task.id, actor="system:reaper")
    assert expired.status == "failed" and expired.error["code"] == "expired"
    assert "TTL" in AuditRecord.objects.get(task=task, to_status="failed").reason
    assert not leases.renew(lease, ttl=30)  # the worker that held it is fenced out


STATE_KEY = {"value": "n"}  # the state's shape "in the code": v1 says "n", v2 says "count"


@register
class ShapeShiftingAgent(Agent):
    name = "test_shape_shifting"

    def start(self, input: dict[str, Any], goal: str) -> dict[str, Any]:
        return {STATE_KEY["value"]: 0}

    def next_step(self, state: dict[str, Any]) -> str | None:
        return "tick" if state[STATE_KEY["value"]] < 10 else None

    def run_step(self, ctx: StepContext, state: dict[str, Any]) -> dict[str, Any]:
        return {STATE_KEY["value"]: state[STATE_KEY["value"]] + 1}

    def result(self, state: dict[str, Any]) -> dict[str, Any]:
        return {"ticks": state[STATE_KEY["value"]]}


def test_a_version_1_checkpoint_resumes_after_the_code_moved_to_version_2(alice, settings, monkeypatch):
    settings.RUNTIME_SLICE_STEPS = 4
    task, _ = do_create_task(console(alice.tenant, "user:test"), agent="test_shape_shifting", input={})
    assert engine.run_slice(task.id, worker_id="v1") is engine.SliceOutcome.CONTINUE
    assert Checkpoint.objects.get(task=task).schema_version == 1

    # The code moves on: state v2 renames "n" to "count", with a registered migration.
    monkeypatch.setattr(codec, "CURRENT_SCHEMA_VERSION", 2)
    monkeypatch.setitem(STATE_KEY, "value", "count")
    monkeypatch.setattr(codec, "MIGRATIONS", {})  # registered the way the code would, undone after the test

    @codec.migration(1)
    def rename_n(state: dict, agent: str) -> dict:
        return {"count": state["n"]} if agent == "test_shape_shifting" else state

    run_to_end(task, worker="v2")
    task.refresh_from_db()
    assert task.status == "completed" and task.result == {"ticks": 10}
    assert Step.objects.filter(task=task).count() == 10  # nothing re-ran
    assert list(Checkpoint.objects.filter(task=task).values_list("schema_version", flat=True)) == [1, 2, 2]


def test_a_checkpoint_without_a_migration_path_dead_letters(alice, settings, monkeypatch):
    settings.RUNTIME_SLICE_STEPS = 4
    task = new_task(alice, steps=10)
    engine.run_slice(task.id, worker_id="v1")
    monkeypatch.setattr(codec, "CURRENT_SCHEMA_VERSION", 2)
    engine.run_slice(task.id, worker_id="v2")
    task.refresh_from_db()
    assert task.status == "dead_lettered" and "no migration from checkpoint schema_version 1" in task.error["message"]


def test_a_cancel_accepted_while_a_worker_held_the_task_ends_it_when_the_worker_is_lost(alice, settings):
    """Cancel always wins: accepted while w1 held the task, the cancel waits for w1's next
    safe point, which never comes (w1 died). The reaper, finding the lease expired, ends
    the task as cancelled: no recovery counted, no recovering status, no dead letter, and
    nothing runs again."""
    settings.RUNTIME_SLICE_STEPS = 2
    task = new_task(alice, steps=5)
    assert engine.run_slice(task.id, worker_id="w0") is engine.SliceOutcome.CONTINUE  # 2 steps, handed on
    assert leases.claim(task.id, worker_id="w1", ttl=60) is not None  # w1 takes it, then dies
    do_cancel_task(task.id, who=console(alice.tenant, "admin:op"), reason="not needed")
    assert Task.objects.get(id=task.id).status == "working"  # asked for, at w1's safe point
    steps = Step.objects.filter(task=task).count()
    expire_lease(task)

    reaped = operators.do_mark_recovering(task.id, actor="system:reaper", max_recoveries=0)

    assert reaped is not None
    task = Task.objects.get(id=task.id)
    assert (task.status, task.recoveries, task.lease_owner) == ("cancelled", 0, None)
    assert not AuditRecord.objects.filter(task=task, to_status__in=["recovering", "dead_lettered"]).exists()
    assert AuditRecord.objects.get(task=task, to_status="cancelled").reason == "not needed"
    assert list(task.steering_commands.values_list("type", "status")) == [("cancel", "applied")]
    assert not task.events.filter(type="recovering").exists()
    assert engine.run_slice(task.id, worker_id="w2") is engine.SliceOutcome.DROPPED
    assert Step.objects.filter(task=task).count() == steps
    assert verify_chain(task) is None


def test_a_lease_expired_across_a_database_restart_is_not_logged_as_a_lost_worker(alice, caplog):
    """The worker may well be alive: the database was down longer than its lease, so no
    renewal could land. The reaper's log and metric say so, never "worker lost"."""
    from runtime_site.metrics import RECOVERIES

    task = new_task(alice)
    assert leases.claim(task.id, worker_id="w1", ttl=30) is not None
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_postmaster_start_time()")
        started = cursor.fetchone()[0]
    # Last renewed just before the server (re)started, as a lease is during an outage.
    Task.objects.filter(id=task.id).update(lease_expires_at=started + timedelta(seconds=1))
    counted = {label: RECOVERIES.labels(label)._value.get() for label in ("working", "recovering")}

    with caplog.at_level(logging.INFO):
        tasks.scan_leases()

    lines = [r.getMessage() for r in caplog.records if task.id.hex[:8] in r.getMessage().replace("-", "")]
    assert lines and not [line for line in lines if "worker lost" in line], lines
    assert [line for line in lines if "restart of the database" in line and "not a recovery" in line], lines
    assert {label: RECOVERIES.labels(label)._value.get() for label in counted} == counted
    task = Task.objects.get(id=task.id)
    assert (task.status, task.recoveries, task.infra_faults, task.lease_owner) == ("queued", 0, 1, None)


def test_a_redrive_withdraws_a_cancel_that_never_landed(alice, settings):
    """REST's /cancel, MCP's tasks/cancel and the admin's send the cancel command: accepted
    while a worker held the task, it waits for that worker's safe point. The worker held
    the task for an operator instead (infrastructure faults without progress); an
    operator's redrive runs it again, and the old command must not end it at the first
    safe point."""
    settings.RUNTIME = {**settings.RUNTIME, "runtime": {**settings.RUNTIME["runtime"], "max_infra_faults": 1}}
    task = new_task(alice, steps=3)
    assert leases.claim(task.id, worker_id="w1", ttl=60) is not None
    who = console(alice.tenant, "admin:op")
    do_cancel_task(task.id, who=who, reason="not needed")
    with transaction.atomic():
        held = Task.objects.select_for_update().get(id=task.id)
        fields = held.drop_lease(fence=False)
        assert operators.count_infrastructure_fault(held, actor="worker:w1", diagnosis="database down", fields=fields)
    assert Task.objects.get(id=task.id).status == "dead_lettered"
    operators.do_redrive_task(task.id, who=who, reason="needed after all")
    assert run_to_end(task, worker="w2")[-1] is engine.SliceOutcome.DONE
    task = Task.objects.get(id=task.id)
    assert (task.status, task.steps_done, task.cancel_requested) == ("completed", 3, False)
    assert list(task.steering_commands.values_list("type", "status", "outcome")) == [
        ("cancel", "rejected", "withdrawn: an operator ran the task again")
    ]
    assert verify_chain(task) is None


def test_redrive_resumes_a_dead_letter_from_its_last_good_checkpoint(alice, settings):
    settings.RUNTIME_SLICE_STEPS = 5
    task = new_task(alice, steps=20)
    engine.run_slice(task.id, worker_id="w1")  # checkpoint at 5
    engine.run_slice(task.id, worker_id="w1")  # checkpoint at 10
    bad = Checkpoint.objects.get(task=task, sequence=10)
    Checkpoint.objects.filter(id=bad.id).update(checksum="0" * 64)
    engine.run_slice(task.id, worker_id="w2")
    task.refresh_from_db()
    assert task.status == "dead_lettered"

    with pytest.raises(IllegalTransition):
        operators.do_close_task(new_task(alice).id, who=console(alice.tenant, "admin:op"), reason="not dead")
    task = operators.do_redrive_task(task.id, who=console(task.tenant, "admin:op"), reason="bad disk replaced")
    assert task.status == "recovering" and task.error is None and task.recoveries == 0
    record = AuditRecord.objects.get(task=task, action="transition", to_status="recovering")
    assert (record.actor, record.reason) == ("admin:op", "bad disk replaced")
    assert record.data == {"redriveFrom": 5, "discardedCheckpoints": [10]}
    run_to_end(task, worker="w3")
    task.refresh_from_db()
    assert task.status == "completed" and task.result == {"steps": 20}
    # steps 6-10 ran again from checkpoint 5, visibly, as second attempts
    assert set(Step.objects.filter(task=task, attempt=2).values_list("sequence", flat=True)) == set(range(6, 11))
    assert verify_chain(task) is None


def test_close_fails_a_dead_letter_for_good(alice):
    task = new_task(alice)
    for _ in range(4):
        crash_mid_slice(task)
        operators.do_mark_recovering(task.id, actor="system:reaper", max_recoveries=3)
    task = operators.do_close_task(task.id, who=console(task.tenant, "admin:op"), reason="customer withdrew")
    assert task.status == "failed" and task.is_terminal
    assert AuditRecord.objects.filter(task=task, actor="admin:op", reason="customer withdrew").exists()


def test_release_lease_fences_the_holder_and_requeues(alice):
    task = new_task(alice)
    held = leases.claim(task.id, worker_id="stuck", ttl=300)
    task = operators.do_release_lease(task.id, who=console(task.tenant, "admin:op"), reason="host is gone")
    assert task.lease_owner is None and task.lease_epoch == held.epoch + 1
    assert not leases.renew(held, ttl=30)
    record = AuditRecord.objects.get(task=task, action="lease_released")
    assert record.data == {"owner": "stuck"} and record.actor == "admin:op"
    with pytest.raises(NoLease):
        operators.do_release_lease(task.id, who=console(task.tenant, "admin:op"), reason="again")


def test_a_lease_its_slice_could_not_give_back_is_given_back_by_the_retry_as_an_infrastructure_fault(alice):
    """engine._abandon could not reach the database to give the lease back; the retry it sent
    carries that lease and gives it back, live or expired, counted as the infrastructure
    fault: not left to run out and be counted as a lost worker."""
    task = new_task(alice, steps=3)
    abandoned = leases.claim(task.id, worker_id="cut-off", ttl=30)
    assert abandoned is not None
    assert leases.claim(task.id, worker_id="retry", ttl=30) is None  # live: the retry alone cannot take it
    given = operators.do_give_back(abandoned, actor="worker:retry")
    assert given is not None and given.lease_owner is None and given.lease_epoch == abandoned.epoch + 1
    task.refresh_from_db()
    assert (task.recoveries, task.infra_faults) == (0, 1)
    assert operators.do_give_back(abandoned, actor="worker:retry") is None  # once: that lease is gone
    # Once taken over (or recovered), another slice's lease is nobody's to give back for it.
    taken = leases.claim(task.id, worker_id="next", ttl=30)
    assert taken is not None
    assert operators.do_give_back(abandoned, actor="worker:retry") is None
    assert Task.objects.get(id=task.id).lease_owner == "next"
    assert verify_chain(Task.objects.get(id=task.id)) is None
