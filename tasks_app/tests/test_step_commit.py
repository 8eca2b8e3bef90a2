"""A create, a slice's claim and a step's commit, counted in round trips (issue 14), and what
they write: the same rows, events and audit chain however few statements write them."""

from __future__ import annotations

import tracemalloc
import uuid
from typing import Any
from uuid import UUID

import psycopg
import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from checkpoints_app.models import Checkpoint
from conftest import database_url, purge_queues, wait_until
from runtime_site import dbpool
from runtime_site.celery import app
from steering_app.actions import do_enqueue_command
from steering_app.tests.test_accept_under_lock import in_thread, waiting_for_a_lock
from tasks_app import engine, leases, telemetry
from tasks_app.access import console
from tasks_app.actions import do_create_task
from tasks_app.agents.base import Agent, StepContext, register
from tasks_app.audit import verify_chain
from tasks_app.models import AuditRecord, Step, Task, TaskEvent, TenantDailyUsage
from tasks_app.queue import ABOUT_HEADER, carried_about
from tasks_app.selectors import task_snapshot
from tasks_app.tests.test_engine import run_to_end

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def prepared_after_five_runs(settings):
    """The default whatever the environment says (RUNTIME_DB_PREPARE_THRESHOLD=0 or off): the
    counts below read captured statements, and a statement run prepared is captured as Django's
    "QUERY = ... - PARAMS = ...", not as its text."""
    settings.RUNTIME_DB_PREPARE_THRESHOLD = 5


@register
class BusyStepsAgent(Agent):
    """Steps that write everything a step can: a log line, a cost, an audit record at
    `auditAt`; at `commandAt` a command is accepted on the task while the step runs; at
    `chattyAt`, `lines` more log lines."""

    name = "test_busy_steps"
    input_schema = {"type": "object"}

    def start(self, input: dict[str, Any], goal: str) -> dict[str, Any]:
        return {"n": 0, **input}

    def next_step(self, state: dict[str, Any]) -> str | None:
        return f"s{state['n'] + 1}" if state["n"] < state["steps"] else None

    def run_step(self, ctx: StepContext, state: dict[str, Any]) -> dict[str, Any]:
        n = state["n"] + 1
        ctx.log(f"step {n}")
        if n == state.get("chattyAt"):
            for i in range(state["lines"]):
                ctx.log(f"line {i}")
        ctx.report_cost(0.5)
        if n in state.get("auditAt", []):
            ctx.audit("model_switched", reason="a -> b", to="b")
        if n == state.get("commandAt"):  # someone steers the task mid-step: the audit chain moves on
            version = Task.objects.values_list("state_version", flat=True).get(id=ctx.task_id)
            task = Task.objects.select_related("tenant").get(id=ctx.task_id)
            do_enqueue_command(
                UUID(ctx.task_id),
                who=console(task.tenant, "user:test"),
                command_id=str(uuid.uuid4()),
                type="set_priority",
                payload={"priority": 3},
                expected_version=version,
            )
        return {**state, "n": n}

    def result(self, state: dict[str, Any]) -> dict[str, Any]:
        return {"steps": state["n"]}


def busy(persona, **input: Any) -> Task:
    task, _ = do_create_task(console(persona.tenant, "user:test"), agent="test_busy_steps", input=input)
    return task


def writes(queries: CaptureQueriesContext) -> list[str]:
    return [q["sql"].split()[0] for q in queries.captured_queries]


@pytest.fixture
def quotas_on(settings):
    limits = {**settings.RUNTIME.get("limits", {}), "cost_per_tenant_day": 1000}
    settings.RUNTIME = {**settings.RUNTIME, "limits": limits}


def test_a_step_with_events_cost_audit_and_checkpoint_is_one_statement(alice, settings, quotas_on):
    settings.RUNTIME_SLICE_STEPS = 3
    task, _ = do_create_task(
        console(alice.tenant, "user:test"),
        agent="test_busy_steps",
        input={"steps": 8, "auditAt": [4, 5]},
        checkpoint_policy={"everySteps": 2},
    )
    assert engine.run_slice(task.id, worker_id="w1") is engine.SliceOutcome.CONTINUE  # steps 1-3
    with CaptureQueriesContext(connection) as queries:
        assert engine.run_slice(task.id, worker_id="w1") is engine.SliceOutcome.CONTINUE  # steps 4-6
    # Each step: its row, its log event, its cost against the day, an audit record (4, 5), a
    # checkpoint (5, 6) with its event, and the last one the lease given back: one statement.
    assert writes(queries).count("WITH") == 3
    assert not {"INSERT", "DELETE"} & set(writes(queries))
    # The claim (a transaction: the tenant limit) is one message, with no savepoint around it.
    assert writes(queries).count("SAVEPOINT") == 0
    assert engine.run_slice(task.id, worker_id="w1") is engine.SliceOutcome.DONE
    task.refresh_from_db()
    assert task.status == "completed" and task.cost == 4.0
    assert TenantDailyUsage.objects.get(tenant=alice.tenant).cost == 4.0
    switched = AuditRecord.objects.filter(task=task, action="model_switched").order_by("seq")
    assert [r.data for r in switched] == [{"step": 4, "to": "b"}, {"step": 5, "to": "b"}]
    assert verify_chain(task) is None
    seqs = list(TaskEvent.objects.filter(task=task).order_by("seq").values_list("seq", "data"))
    assert [seq for seq, _ in seqs] == list(range(1, len(seqs) + 1))
    assert all(data["seq"] == seq and data["taskId"] == str(task.id) for seq, data in seqs)
    logs = TaskEvent.objects.filter(task=task, type="log").order_by("seq")
    assert [e.data["message"] for e in logs] == [f"step {n}" for n in range(1, 9)]
    checkpoints = Checkpoint.objects.filter(task=task).order_by("sequence")
    assert [(c.sequence, c.reason) for c in checkpoints] == [
        (2, "every_steps"),
        (3, "slice_end"),
        (5, "every_steps"),
        (6, "slice_end"),
        (8, "every_steps"),
    ]


def test_a_step_whose_audit_chain_moved_meanwhile_commits_in_a_transaction(alice, settings, quotas_on):
    # A command accepted mid-step writes its audit record: the step's own record, chained to
    # the head the slice saw, would not fit, so its commit goes the long way.
    settings.RUNTIME_SLICE_STEPS = 1000
    task = busy(alice, steps=3, auditAt=[2], commandAt=2)
    assert engine.run_slice(task.id, worker_id="w1") is engine.SliceOutcome.DONE
    task.refresh_from_db()
    assert task.status == "completed" and task.priority == 3 and task.cost == 1.5
    assert TenantDailyUsage.objects.get(tenant=alice.tenant).cost == 1.5
    assert Step.objects.filter(task=task).count() == 3
    actions = list(AuditRecord.objects.filter(task=task).order_by("seq").values_list("action", flat=True))
    assert actions.count("model_switched") == 1
    assert actions.index("steering_accepted") < actions.index("model_switched")
    assert verify_chain(task) is None


def test_a_step_that_logged_more_values_than_a_bound_statement_carries_commits(alice, settings):
    # Six values an event: its commit has more than the 65535 that binding them apart from
    # the statement allows (runtime_site.dbpool.bound_cursor). Sent that way, psycopg refused
    # it as an OperationalError: an infrastructure fault, the same step again, for ever.
    settings.RUNTIME_SLICE_STEPS = 1000
    lines = dbpool.MAX_BOUND_VALUES // 6 + 1
    task = busy(alice, steps=3, chattyAt=2, lines=lines)
    assert run_to_end(task)[-1] is engine.SliceOutcome.DONE
    task.refresh_from_db()
    assert task.status == "completed" and task.infra_faults == 0
    assert TaskEvent.objects.filter(task=task, type="log").count() == 3 + lines
    seqs = list(TaskEvent.objects.filter(task=task).order_by("seq").values_list("seq", flat=True))
    assert seqs == list(range(1, len(seqs) + 1))


def test_a_connection_keeps_no_copy_of_the_orm_statements_it_ran(alice):
    # The ORM writes values into its statements and never prepares them; a connection that
    # counted them towards preparing (psycopg's prepare_threshold) kept its last hundred
    # alive, values and all: 1 MB statements held 100 MB per connection.
    task = busy(alice, steps=1)
    connection.ensure_connection()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(20):  # twenty statements of 1 MB, each its own
            Task.objects.filter(id=task.id).update(goal=f"{i} " + "x" * 1_000_000)
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert kept < 5_000_000, f"{kept} bytes kept"
    # The step's statements still run prepared: the heavy one is prepared by its sixth run.
    assert run_to_end(busy(alice, steps=12))[-1] is engine.SliceOutcome.DONE
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_prepared_statements WHERE statement LIKE 'WITH fence AS (UPDATE%%'")
        assert cursor.fetchone()[0] >= 1


def test_a_one_step_slice_commits_its_step_and_its_yield_at_once(alice, settings):
    settings.RUNTIME_SLICE_STEPS = 1
    task, _ = do_create_task(console(alice.tenant, "user:test"), agent="noop", input={"steps": 3})
    assert engine.run_slice(task.id, worker_id="w1") is engine.SliceOutcome.CONTINUE
    with CaptureQueriesContext(connection) as queries:
        assert engine.run_slice(task.id, worker_id="w1") is engine.SliceOutcome.CONTINUE
    # The step, its progress, the slice-end checkpoint and the lease given back: one statement.
    assert writes(queries).count("WITH") == 1 and "INSERT" not in writes(queries)
    task.refresh_from_db()
    assert task.lease_owner is None and task.lease_expires_at is None and task.steps_done == 2
    assert list(Checkpoint.objects.filter(task=task).values_list("sequence", "reason")) == [
        (1, "slice_end"),
        (2, "slice_end"),
    ]
    assert list(TaskEvent.objects.filter(task=task).order_by("seq").values_list("type", flat=True))[-4:] == [
        "progress",
        "checkpoint",
        "progress",
        "checkpoint",
    ]
    assert engine.run_slice(task.id, worker_id="w1") is engine.SliceOutcome.DONE  # the last step completes at once
    task.refresh_from_db()
    assert task.status == "completed" and task.result == {"steps": 3}


def test_a_claim_is_one_round_trip_also_with_a_tenant_limit(alice, settings):
    task, _ = do_create_task(console(alice.tenant, "user:test"), agent="noop", input={"steps": 3})
    settings.RUNTIME = {**settings.RUNTIME, "runtime": {**settings.RUNTIME["runtime"], "max_concurrent_tasks": 0}}
    with CaptureQueriesContext(connection) as queries:
        claimed = leases.claim_task(task.id, worker_id="w1", ttl=30)
    assert claimed is not None and writes(queries) == ["UPDATE"]
    lease, row = claimed
    assert (row.lease_epoch, row.lease_owner, row.status) == (1, "w1", "queued") and lease.epoch == 1
    Task.objects.filter(id=task.id).update(lease_owner=None, lease_expires_at=None)
    settings.RUNTIME = {**settings.RUNTIME, "runtime": {**settings.RUNTIME["runtime"], "max_concurrent_tasks": 5}}
    with CaptureQueriesContext(connection) as queries:
        claimed = leases.claim_task(task.id, worker_id="w2", ttl=30)
    assert claimed is not None and claimed[0].epoch == 2
    # The tenant's turn, then the claiming UPDATE, as statements of their own in one message.
    [claim] = [q["sql"] for q in queries.captured_queries]
    assert [part.split()[0] for part in claim.split("; ")] == ["SELECT", "UPDATE", "SELECT"]
    assert "FOR NO KEY UPDATE" in claim.split("; ")[0]


def test_a_task_starts_working_in_one_statement_and_reads_once(alice, settings):
    settings.RUNTIME_SLICE_STEPS = 1
    task, _ = do_create_task(console(alice.tenant, "user:test"), agent="noop", input={"steps": 2})
    with CaptureQueriesContext(connection) as queries:
        assert engine.run_slice(task.id, worker_id="w1") is engine.SliceOutcome.CONTINUE
    # The claim with one read of the checkpoint, steps, ledger and answers in its message, the
    # start (status, audit record, snapshot event) in one statement, and the step with the
    # slice's yield in one.
    assert writes(queries) == ["SELECT", "WITH", "WITH"]
    claim = queries.captured_queries[0]["sql"].split("; ")
    assert "UPDATE" in claim[-3] and "checkpoints_app_checkpoint" in claim[-1]  # the tenant limit's check between
    task.refresh_from_db()
    assert task.status == "working" and task.started_at is not None and task.steps_done == 1
    assert verify_chain(task) is None
    transition = AuditRecord.objects.get(task=task, action="transition", to_status="working")
    assert (transition.from_status, transition.reason, transition.after_version) == ("queued", "first slice", 2)
    snapshot = TaskEvent.objects.filter(task=task, type="task.snapshot").latest("seq")
    assert snapshot.data["runtimeStatus"] == "working" and snapshot.data["stateVersion"] == 2
    assert snapshot.data["lastCheckpoint"] is None and snapshot.data["inputRequests"] == []
    assert list(TaskEvent.objects.filter(task=task).order_by("seq").values_list("seq", flat=True)) == list(
        range(1, task.event_seq + 1)
    )


def test_a_start_that_finds_the_task_moved_since_its_claim_takes_the_transaction(alice, settings):
    task, _ = do_create_task(console(alice.tenant, "user:test"), agent="noop", input={"steps": 2})
    lease, claimed = leases.claim_task(task.id, worker_id="w1", ttl=30)
    # A command accepted after the claim moved the version and the audit chain's head.
    do_enqueue_command(
        task.id,
        who=console(alice.tenant, "user:other"),
        command_id="p1",
        type="set_priority",
        payload={"priority": 3},
        expected_version=claimed.state_version,
    )
    started = engine._start_working(lease, "queued", None, claimed=claimed, inputs_open=False)
    task.refresh_from_db()
    assert (started.status, started.state_version) == ("working", task.state_version)
    assert task.status == "working" and verify_chain(task) is None


def created_rows_agree(task: Task) -> None:
    """The create's audit record and snapshot event say what its row says."""
    task.refresh_from_db()
    assert verify_chain(task) is None and (task.audit_seq, task.event_seq) == (1, 1)
    [record] = AuditRecord.objects.filter(task=task)
    assert (record.action, record.to_status, record.before_version, record.data) == (
        "created",
        "queued",
        0,
        {"agent": "noop"},
    )
    [event] = TaskEvent.objects.filter(task=task)
    assert (event.seq, event.type) == (1, "task.snapshot")
    assert event.data == {"seq": 1, "taskId": str(task.id), **task_snapshot(task)}  # its timestamps too


def test_a_create_writes_its_task_audit_record_and_snapshot_in_one_statement(alice, settings):
    assert settings.RUNTIME["limits"]["queued_tasks_per_tenant"]  # the default: a cap
    with CaptureQueriesContext(connection) as queries:
        task, created = do_create_task(console(alice.tenant, "user:test"), agent="noop", input={"steps": 2})
    # In a transaction (a savepoint in the test's): the queue cap's lock and count, then the one statement.
    assert created and [w for w in writes(queries) if w not in ("SAVEPOINT", "RELEASE")] == ["SELECT", "SELECT", "WITH"]
    created_rows_agree(task)


@pytest.mark.django_db(transaction=True)  # outside a transaction, as a request creates
def test_a_create_is_one_round_trip_and_a_key_raced_to_its_insert_answers_as_a_replay(alice, settings):
    settings.RUNTIME = {**settings.RUNTIME, "limits": {**settings.RUNTIME["limits"], "queued_tasks_per_tenant": 0}}
    who = console(alice.tenant, "user:test")
    with CaptureQueriesContext(connection) as queries:
        task, created = do_create_task(who, agent="noop", input={"steps": 2})
    assert created and writes(queries) == ["WITH"]  # no BEGIN, no COMMIT: a transaction of its own
    created_rows_agree(task)
    # Another session inserts the same key (and body) after the create looked for it and
    # before its insert: the insert waits on the key, fails once the other commits, and the
    # create answers with the other's task, as a replay.
    with psycopg.connect(database_url()) as other:
        other.execute("CREATE TEMP TABLE twin AS SELECT * FROM tasks_app_task WHERE id = %s", [task.id])
        other.execute("UPDATE twin SET id = gen_random_uuid(), idempotency_key = 'k1' RETURNING id")
        other.execute("INSERT INTO tasks_app_task SELECT * FROM twin")
        [(twin,)] = other.execute("SELECT id FROM twin").fetchall()
        thread, out = in_thread(lambda: do_create_task(who, agent="noop", input={"steps": 2}, idempotency_key="k1"))
        wait_until(waiting_for_a_lock, timeout=30, what="the create to wait on the key")
    thread.join(30)
    [(replayed, created)] = out
    assert (replayed.id, created) == (twin, False)
    assert not Task.objects.filter(idempotency_key="k1").exclude(id=twin).exists()


def test_the_creates_message_carries_what_labels_the_slice_which_then_reads_nothing_before_its_claim(
    alice, django_capture_on_commit_callbacks
):
    purge_queues()
    with django_capture_on_commit_callbacks(execute=True):
        task, _ = do_create_task(console(alice.tenant, "user:test"), agent="noop", input={"steps": 2})
    with app.connection_for_write() as conn:
        message = conn.default_channel.basic_get("steps", no_ack=True)
    assert message is not None and message.headers["argsrepr"] == repr([str(task.id)])
    carried = carried_about(message.headers.get(ABOUT_HEADER))
    assert carried == ("noop", "acme", "")
    with CaptureQueriesContext(connection) as queries, telemetry.slice_of(str(task.id), carried):
        pass
    assert writes(queries) == []
    # A message without it (or with something else there): the slice reads it.
    assert carried_about(None) is None and carried_about(["noop", "acme"]) is None
