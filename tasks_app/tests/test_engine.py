"""The engine in-process against real PostgreSQL: leases, fencing, checkpoints, safe points."""

from __future__ import annotations

import hashlib
import json
import threading
from datetime import timedelta
from itertools import pairwise
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.db import connection, transaction
from django.utils import timezone

from checkpoints_app.models import Checkpoint
from conftest import wait_until
from steering_app.actions import do_cancel_task
from tasks_app import engine, leases, operators
from tasks_app.access import console
from tasks_app.actions import do_create_task
from tasks_app.agents.base import Agent, StepContext, register
from tasks_app.audit import verify_chain
from tasks_app.models import AuditRecord, Step, Task, Tenant

pytestmark = pytest.mark.django_db


@register
class ExplodingAgent(Agent):
    name = "test_exploding"
    input_schema = {"type": "object", "properties": {"explodeAt": {"type": "integer"}}}

    def start(self, input: dict[str, Any], goal: str) -> dict[str, Any]:
        return {"n": 0, "at": input.get("explodeAt", 2)}

    def next_step(self, state: dict[str, Any]) -> str | None:
        return f"s{state['n'] + 1}" if state["n"] < 5 else None

    def run_step(self, ctx: StepContext, state: dict[str, Any]) -> dict[str, Any]:
        if state["n"] + 1 == state["at"]:
            raise RuntimeError("disk on fire")
        return {**state, "n": state["n"] + 1}

    def result(self, state: dict[str, Any]) -> dict[str, Any]:
        return {}


def new_task(persona, steps=25, **kwargs) -> Task:
    task, _ = do_create_task(console(persona.tenant, "user:test"), agent="noop", input={"steps": steps}, **kwargs)
    return task


def run_to_end(task: Task, worker: str = "w1") -> list[engine.SliceOutcome]:
    outcomes = []
    while True:
        outcomes.append(engine.run_slice(task.id, worker_id=worker))
        if outcomes[-1] is not engine.SliceOutcome.CONTINUE:
            return outcomes


def expire_lease(task: Task) -> None:
    Task.objects.filter(id=task.id).update(lease_expires_at=timezone.now() - timedelta(seconds=1))


@pytest.mark.django_db(transaction=True)  # two threads, two connections
def test_a_claim_that_waited_for_its_tenants_turn_holds_its_lease_for_the_whole_ttl(alice):
    """The lease runs `ttl` from when the claim took it, not from when its message reached
    the database: every statement of one message shares a STATEMENT_TIMESTAMP(), so a claim
    that waited on its tenant's row (runtime.max_concurrent_tasks) got a lease short by the
    wait, already over when the wait outlasted the ttl."""
    task = new_task(alice)
    locked, release, claimed = threading.Event(), threading.Event(), []

    def tenant_turn_holder() -> None:
        with transaction.atomic():
            Tenant.objects.select_for_update(no_key=True).get(id=task.tenant_id)
            locked.set()
            release.wait(30)
        connection.close()

    def claimer() -> None:
        claimed.append(leases.claim(task.id, worker_id="w", ttl=1))
        connection.close()

    holder = threading.Thread(target=tenant_turn_holder)
    holder.start()
    assert locked.wait(30)
    claiming = threading.Thread(target=claimer)
    claiming.start()

    def waiting_on_a_lock() -> bool:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                " AND wait_event_type = 'Lock' AND query LIKE %s",
                ["%FOR NO KEY UPDATE%"],
            )
            return cursor.fetchone()[0] == 1

    wait_until(waiting_on_a_lock, timeout=30, what="the claim to wait for its tenant's turn")
    with connection.cursor() as cursor:  # a wait longer than the ttl (the fault), on the database's clock
        cursor.execute("SELECT pg_sleep(1.2), clock_timestamp()")
        turn_given_at = cursor.fetchone()[1]
    release.set()
    holder.join()
    claiming.join()
    assert claimed and claimed[0] is not None
    task.refresh_from_db()
    assert task.lease_expires_at >= turn_given_at + timedelta(seconds=1), (task.lease_expires_at, turn_given_at)


@pytest.mark.django_db(transaction=True)  # two threads, two connections: each must see the other's commits
def test_exactly_one_of_two_racing_claims_wins(alice):
    task = new_task(alice)
    barrier, results = threading.Barrier(2), []

    def contender(name: str) -> None:
        barrier.wait()
        results.append(leases.claim(task.id, worker_id=name, ttl=30))
        connection.close()

    threads = [threading.Thread(target=contender, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [r for r in results if r is not None]
    assert len(winners) == 1 and winners[0].epoch == 1


def test_a_held_lease_is_claimed_only_once_a_recovery_has_counted_its_holder_lost(alice):
    task = new_task(alice)
    first = leases.claim(task.id, worker_id="a", ttl=30)
    assert first is not None
    assert leases.claim(task.id, worker_id="b", ttl=30) is None
    expire_lease(task)
    # Expired, its holder lost: not claimable until a recovery has counted it and let go.
    assert leases.claim(task.id, worker_id="b", ttl=30) is None
    assert Task.objects.get(id=task.id).recoveries == 0
    assert operators.do_mark_recovering(task.id, actor="system:reaper") is not None
    second = leases.claim(task.id, worker_id="b", ttl=30)
    assert second is not None and second.epoch == first.epoch + 2  # the recovery's fence, then the claim
    assert Task.objects.get(id=task.id).recoveries == 1
    assert not leases.renew(first, ttl=30)  # the zombie's heartbeat fails ...
    with pytest.raises(leases.LeaseLost), transaction.atomic():
        leases.fenced(first)  # ... and so does any write it attempts


def test_a_zombie_slice_commits_nothing_after_a_takeover(alice, settings):
    settings.RUNTIME_SLICE_STEPS = 3
    task = new_task(alice, steps=10)
    assert engine.run_slice(task.id, worker_id="w1") is engine.SliceOutcome.CONTINUE
    zombie = leases.claim(task.id, worker_id="zombie", ttl=30)
    run = engine._load(zombie)
    expire_lease(task)
    assert operators.do_mark_recovering(task.id, actor="system:reaper") is not None
    assert leases.claim(task.id, worker_id="new", ttl=30) is not None
    steps_before = Step.objects.filter(task=task).count()
    with pytest.raises(leases.LeaseLost):
        engine._commit_step(run, StepContext(str(task.id), "", {}, "noop-4", 4, None), run.state, timezone.now(), 1.0)
    assert Step.objects.filter(task=task).count() == steps_before


def test_a_step_with_nothing_else_to_write_is_one_statement(alice, settings):
    """Fence, progress and step row in one round trip, its own transaction (was five:
    BEGIN, the fenced UPDATE, a SELECT of the row back, the step INSERT, COMMIT)."""
    from django.test.utils import CaptureQueriesContext

    settings.RUNTIME_SLICE_STEPS = 1000

    def statements(steps: int) -> int:
        task = new_task(alice, steps=steps, checkpoint_policy={"everySteps": 1000})
        with CaptureQueriesContext(connection) as queries:
            assert engine.run_slice(task.id, worker_id="w1") is engine.SliceOutcome.DONE
        assert Step.objects.filter(task=task).count() == steps
        return len(queries.captured_queries)

    assert statements(15) - statements(5) == 10


def test_checkpoints_follow_the_policy_and_carry_valid_checksums(alice, settings):
    settings.RUNTIME_SLICE_STEPS = 7  # slice ends add checkpoints of their own
    task = new_task(alice, steps=25, checkpoint_policy={"everySteps": 5})
    outcomes = run_to_end(task)
    assert outcomes[-1] is engine.SliceOutcome.DONE and len(outcomes) == 4
    task.refresh_from_db()
    assert task.status == "completed" and task.result == {"steps": 25}
    cps = list(Checkpoint.objects.filter(task=task).order_by("sequence"))
    assert [(c.sequence, c.reason) for c in cps] == [
        (5, "every_steps"),
        (7, "slice_end"),
        (12, "every_steps"),
        (14, "slice_end"),
        (19, "every_steps"),
        (21, "slice_end"),
        (25, "terminal"),
    ]
    for cp in cps:  # recomputed here, independently of the codec
        fields = {
            "task": str(task.id),
            "sequence": cp.sequence,
            "step_name": cp.step_name,
            "schema_version": cp.schema_version,
            "plan_version": cp.plan_version,
            "next_step": cp.next_step,
            "state": cp.state,
            "artifact_refs": cp.artifact_refs,
            "steering_cursor": cp.steering_cursor,
        }
        canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        assert hashlib.sha256(canonical.encode()).hexdigest() == cp.checksum
        assert cp.state["done"] == cp.sequence
    assert Step.objects.filter(task=task).count() == 25
    assert set(Step.objects.filter(task=task).values_list("attempt", flat=True)) == {1}


def test_an_altered_checkpoint_is_never_loaded(alice, settings):
    settings.RUNTIME_SLICE_STEPS = 5
    task = new_task(alice, steps=20)
    assert engine.run_slice(task.id, worker_id="w1") is engine.SliceOutcome.CONTINUE
    cp = Checkpoint.objects.get(task=task)
    Checkpoint.objects.filter(id=cp.id).update(state={**cp.state, "done": 15})  # a forged shortcut
    assert engine.run_slice(task.id, worker_id="w2") is engine.SliceOutcome.DONE
    task.refresh_from_db()
    assert task.status == "dead_lettered" and task.mcp_status == "working"
    assert task.error["code"] == "checkpoint_corrupt" and "checksum" in task.error["message"]
    assert "held for operator" in task.status_text()
    assert Step.objects.filter(task=task).count() == 5  # nothing ran from the forged state
    assert task.lease_owner is None
    assert task.events.filter(type="dead_lettered").exists()
    assert verify_chain(task) is None


def test_a_checkpoint_from_an_unknown_schema_version_dead_letters(alice, settings):
    from checkpoints_app import codec

    settings.RUNTIME_SLICE_STEPS = 5
    task = new_task(alice, steps=20)
    engine.run_slice(task.id, worker_id="w1")
    cp = Checkpoint.objects.get(task=task)
    fields = {
        "task": str(task.id),
        "sequence": cp.sequence,
        "step_name": cp.step_name,
        "schema_version": 99,
        "plan_version": cp.plan_version,
        "next_step": cp.next_step,
        "state": cp.state,
        "artifact_refs": cp.artifact_refs,
        "steering_cursor": cp.steering_cursor,
    }
    Checkpoint.objects.filter(id=cp.id).update(schema_version=99, checksum=codec.checksum(fields))
    engine.run_slice(task.id, worker_id="w2")
    task.refresh_from_db()
    assert task.status == "dead_lettered" and "schema_version 99" in task.error["message"]


def test_cancel_requested_under_a_live_lease_lands_at_the_next_safe_point(alice, settings):
    settings.RUNTIME_SLICE_STEPS = 4
    task = new_task(alice, steps=20)
    engine.run_slice(task.id, worker_id="w1")
    held = leases.claim(task.id, worker_id="busy", ttl=30)
    task = do_cancel_task(task.id, who=console(alice.tenant, "user:test"), reason="wrong corpus")
    assert task.status == "working" and task.cancel_requested  # asked, not yet applied
    assert held is not None
    expire_lease(task)  # the busy worker is lost: w2's message finds its lease run out
    assert engine.run_slice(task.id, worker_id="w2") is engine.SliceOutcome.DROPPED
    task.refresh_from_db()
    # w2 recovered it, as the reaper would, and the cancel asked for won: no step re-ran.
    assert task.status == "cancelled" and task.steps_done == 4 and task.lease_owner is None
    assert AuditRecord.objects.filter(task=task, to_status="cancelled", reason="wrong corpus").exists()
    assert verify_chain(task) is None


def test_a_failing_step_fails_the_task_with_a_diagnosable_reason(alice):
    task, _ = do_create_task(console(alice.tenant, "user:test"), agent="test_exploding", input={"explodeAt": 3})
    assert engine.run_slice(task.id, worker_id="w1") is engine.SliceOutcome.DONE
    task.refresh_from_db()
    assert task.status == "failed"
    assert task.error == {"code": "step_failed", "step": "s3", "sequence": 3, "message": "RuntimeError: disk on fire"}
    assert Step.objects.filter(task=task).count() == 2


def test_a_message_for_a_finished_task_is_dropped(alice):
    task = new_task(alice, steps=3)
    run_to_end(task)
    assert engine.run_slice(task.id, worker_id="late") is engine.SliceOutcome.DROPPED
    assert Step.objects.filter(task=task).count() == 3


def test_every_terminal_chain_verifies_and_an_edited_record_is_named(alice):
    task = new_task(alice, steps=3)
    run_to_end(task)
    call_command("verify_audit")  # no error
    record = AuditRecord.objects.get(task=task, seq=2)
    AuditRecord.objects.filter(id=record.id).update(reason="nothing to see here")
    with pytest.raises(CommandError) as excinfo:
        call_command("verify_audit")
    assert f"task {task.id}: record 2" in str(excinfo.value)
    assert "edited" in str(excinfo.value)


def test_a_deleted_audit_record_breaks_the_chain(alice):
    task = new_task(alice, steps=3)
    run_to_end(task)
    AuditRecord.objects.filter(task=task, seq=2).delete()
    link = verify_chain(Task.objects.get(id=task.id))
    assert link is not None and link.seq == 2 and "missing" in link.problem


@pytest.mark.parametrize(
    ("budget", "extra", "steps_done", "needle"),
    [
        ({"maxSteps": 4}, {}, 4, "steps 4 of 4"),
        ({"maxCost": 1.0}, {"costPerStep": 0.25}, 4, "cost 1 of 1"),
    ],
)
def test_the_safe_point_stops_a_task_whose_budget_is_used_up(alice, budget, extra, steps_done, needle):
    task, _ = do_create_task(
        console(alice.tenant, "user:test"), agent="noop", input={"steps": 10, **extra}, budget=budget
    )
    run_to_end(task)
    task.refresh_from_db()
    assert task.status == "failed" and task.error["code"] == "budget_exhausted"
    assert needle in task.error["message"] and task.steps_done == steps_done


def test_a_budget_that_is_not_reached_changes_nothing(alice):
    task, _ = do_create_task(
        console(alice.tenant, "user:test"),
        agent="noop",
        input={"steps": 4, "costPerStep": 0.5},
        budget={"maxSteps": 4, "maxCost": 3},
    )
    run_to_end(task)
    task.refresh_from_db()
    assert task.status == "completed" and task.cost == 2.0


def test_configured_budget_defaults_apply_unless_the_task_says_otherwise(alice, settings):
    settings.RUNTIME = {**settings.RUNTIME, "budget": {**settings.RUNTIME["budget"], "max_steps": 3}}
    capped = new_task(alice, steps=5)
    own = new_task(alice, steps=5, budget={"maxSteps": 10})
    run_to_end(capped)
    run_to_end(own)
    capped.refresh_from_db()
    own.refresh_from_db()
    assert capped.status == "failed" and "maxSteps" in capped.error["message"] and capped.steps_done == 3
    assert own.status == "completed"


def test_a_tenant_at_its_concurrency_limit_waits_its_turn(alice, settings):
    settings.RUNTIME = {**settings.RUNTIME, "runtime": {**settings.RUNTIME["runtime"], "max_concurrent_tasks": 1}}
    first, second = new_task(alice, steps=3), new_task(alice, steps=3)
    held = leases.claim(first.id, worker_id="w1", ttl=30)
    assert held is not None
    assert leases.next_waiting(first.id) == []  # nobody turned away yet: nothing to ring
    assert engine.run_slice(second.id, worker_id="w2") is engine.SliceOutcome.AT_CAPACITY
    assert Task.objects.get(id=second.id).lease_owner is None
    assert leases.next_waiting(first.id) == []  # first still runs: no turn is free
    Task.objects.filter(id=first.id).update(lease_owner=None, lease_expires_at=None)  # its slice ended
    assert leases.next_waiting(first.id) == [(second.id, second.priority)]  # the freed turn goes to second
    run_to_end(second)
    second.refresh_from_db()
    assert second.status == "completed" and second.waiting_turn_since is None
    assert leases.next_waiting(first.id) == []


def test_concurrency_limited_tasks_never_overlap_on_real_workers(alice, settings, processes):
    from conftest import wait_until

    processes.worker(
        concurrency=2,
        RUNTIME_MAX_CONCURRENT_TASKS="1",
        RUNTIME_SLICE_STEPS="2",
        RUNTIME_SCAN_SECONDS="1",
        RUNTIME_STALL_SECONDS="30",
    )
    processes.beat(RUNTIME_SCAN_SECONDS="1", RUNTIME_STALL_SECONDS="30")
    tasks = [
        do_create_task(console(alice.tenant, "user:test"), agent="noop", input={"steps": 6, "sleepMs": 30})[0]
        for _ in range(3)
    ]
    wait_until(
        lambda: Task.objects.filter(id__in=[t.id for t in tasks], status="completed").count() == 3,
        timeout=25,
        what="all three tasks (handed their turns along, not left to the stall scanner)",
    )
    spans = sorted(Step.objects.filter(task__in=tasks).values_list("started_at", "finished_at", "task_id"))
    for (_, end, a), (start, _, b) in pairwise(spans):
        assert a == b or start >= end, "two tasks of the tenant ran at once"


def test_a_command_applied_over_a_lost_holders_expired_lease_fences_the_holder_out(alice):
    """A pause finds the task's lease run out in its holder's hands, before the reaper came
    by: nobody is mid-step, so it applies now (paused). The holder was frozen, not dead:
    thawed, it renewed its lease on the paused task and committed the step it was in, the
    epoch being still its own. Applying a command there takes the task from its holder, so it
    moves the epoch; the lease stays, expired, for a recovery to count (after a resume)."""
    from steering_app.actions import do_enqueue_command

    task = new_task(alice, steps=10)
    held = leases.claim(task.id, worker_id="frozen", ttl=30)
    assert held is not None and engine._load(held) is not None
    expire_lease(task)
    version = Task.objects.get(id=task.id).state_version
    do_enqueue_command(
        task.id,
        who=console(alice.tenant, "user:test"),
        command_id="p1",
        type="pause",
        payload={},
        expected_version=version,
    )
    paused = Task.objects.get(id=task.id)
    assert paused.status == "paused"
    assert not leases.renew(held, ttl=30)  # the thawed holder's heartbeat fails ...
    with pytest.raises(leases.LeaseLost), transaction.atomic():
        leases.fenced(held)  # ... and so does any write of the step it was in
    # Resumed: the lost holder is counted, once, by the recovery that hands the task on.
    do_enqueue_command(
        task.id,
        who=console(alice.tenant, "user:test"),
        command_id="r1",
        type="resume",
        payload={},
        expected_version=paused.state_version,
    )
    # The resume's message finds the lease run out in the lost holder's hands: recovered.
    assert engine.run_slice(task.id, worker_id="w2") is engine.SliceOutcome.DROPPED
    assert Task.objects.get(id=task.id).status == "recovering"
    run_to_end(task, worker="w2")  # the recovery's message
    task.refresh_from_db()
    assert task.status == "completed" and task.recoveries == 1, (task.status, task.recoveries)
    assert verify_chain(task) is None
