"""Faults in-process against real PostgreSQL: crashes repeated inside one range of steps,
and infrastructure errors inside a step or its commit (issue 12)."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import botocore.exceptions
import kombu.exceptions
import psycopg
import pytest
import redis.exceptions
from django.db import IntegrityError, InterfaceError, OperationalError, connection, transaction

from tasks_app import engine, faults, leases, operators, tasks
from tasks_app.access import console
from tasks_app.actions import do_create_task
from tasks_app.agents.base import Agent, StepContext, register
from tasks_app.audit import verify_chain
from tasks_app.models import AuditRecord, Step, Task
from tasks_app.selectors import task_snapshot
from tasks_app.tests.test_engine import expire_lease, run_to_end

pytestmark = pytest.mark.django_db


class Killed(BaseException):
    """Stands in for SIGKILL: the engine catches no BaseException, so the slice dies where it
    is, holding its lease, and commits nothing more."""


class CountingAgent(Agent):
    """`steps` steps named s1, s2, ...: the shape the fault agents below share (not registered)."""

    input_schema = {"type": "object"}

    def start(self, input: dict[str, Any], goal: str) -> dict[str, Any]:
        return {"done": 0, "total": input["steps"]}

    def next_step(self, state: dict[str, Any]) -> str | None:
        return f"s{state['done'] + 1}" if state["done"] < state["total"] else None


CRASHED: Counter[str] = Counter()  # per task: how many of its planned crashes happened


@register
class CrashingAgent(CountingAgent):
    """`steps` steps; its worker "dies" (Killed) on reaching each sequence of `crashAt` in turn."""

    name = "test_crashing"

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
    assert operators.do_mark_recovering(task.id, actor="system:reaper") is not None
    return shown


def attempts(task: Task) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for sequence, attempt in (
        Step.objects.filter(task=task).order_by("sequence", "attempt").values_list("sequence", "attempt")
    ):
        out.setdefault(sequence, []).append(attempt)
    return out


def test_crashes_repeated_inside_one_range_of_steps_rerun_them_as_new_attempts(alice):
    # Checkpoint at 10; the first worker dies in step 14 (11-13 committed after the
    # checkpoint), the second while re-running step 12, inside the same range.
    task, _ = do_create_task(
        console(alice.tenant, "user:test"),
        agent="test_crashing",
        input={"steps": 20, "crashAt": [14, 12]},
        checkpoint_policy={"everySteps": 10},
    )
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
    task, _ = do_create_task(
        console(alice.tenant, "user:test"),
        agent="test_crashing",
        input={"steps": 12, "crashAt": [9]},
        checkpoint_policy={"everySteps": 5},
    )
    crash_then_recover(task)  # steps 1-8 committed, checkpoint at 5
    Task.objects.filter(id=task.id).update(steps_done=6)
    run_to_end(task, worker="survivor")
    task.refresh_from_db()
    assert task.status == "completed", task.error
    assert attempts(task) == {**{s: [1] for s in range(1, 13)}, 6: [1, 2], 7: [1, 2], 8: [1, 2]}


def terminate_backend(pid: int) -> None:
    """pg_terminate_backend from another connection (another thread gets its own)."""

    def kill() -> None:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_terminate_backend(%s)", [pid])
        connection.close()

    thread = threading.Thread(target=kill)
    thread.start()
    thread.join()


def backend_pid() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        return cursor.fetchone()[0]


FAULTED: Counter[str] = Counter()


@register
class DatabaseFaultAgent(CountingAgent):
    """`steps` steps; at step `faultAt` (once) the database drops the worker's connection:
    "step" while the step itself still needs it (as a ledger write would), "commit" just
    before the engine commits the step."""

    name = "test_db_fault"

    def run_step(self, ctx: StepContext, state: dict[str, Any]) -> dict[str, Any]:
        if ctx.sequence == ctx.input["faultAt"] and not FAULTED[ctx.task_id]:
            FAULTED[ctx.task_id] += 1
            if ctx.input["where"] == "step":  # in a transaction of the step's own, as ledger writes are
                with transaction.atomic(), connection.cursor() as cursor:
                    cursor.execute("SELECT pg_terminate_backend(pg_backend_pid())")
            else:
                terminate_backend(backend_pid())
        return {**state, "done": state["done"] + 1}

    def result(self, state: dict[str, Any]) -> dict[str, Any]:
        return {"steps": state["done"]}


@pytest.mark.django_db(transaction=True)  # the fault drops the database connection, which would end a test transaction
@pytest.mark.parametrize("where", ["step", "commit"])
def test_a_database_connection_dropped_in_a_step_or_its_commit_delays_the_task_and_never_fails_it(alice, where):
    task, _ = do_create_task(
        console(alice.tenant, "user:test"),
        agent="test_db_fault",
        input={"steps": 8, "faultAt": 6, "where": where},
        checkpoint_policy={"everySteps": 4},
    )
    outcome = engine.run_slice(task.id, worker_id="w1")

    task.refresh_from_db()  # the connection was reset: this reconnects
    assert task.status == "working" and task.error is None
    assert outcome is engine.SliceOutcome.RETRY  # the wrapper rings again after a backoff
    assert task.lease_owner is None  # given back at once, not left to expire
    assert task.infra_faults == 1 and task.recoveries == 0  # counted, but not as a crash
    assert task_snapshot(task)["infrastructureFaults"] == 1
    fault = AuditRecord.objects.get(task=task, action="infrastructure_fault")
    assert fault.actor == "worker:w1" and "OperationalError" in fault.reason
    assert Step.objects.filter(task=task).count() == 5  # step 6 was not written

    assert run_to_end(task, worker="w2")[-1] is engine.SliceOutcome.DONE
    task.refresh_from_db()
    assert task.status == "completed" and task.result == {"steps": 8}
    assert attempts(task) == {**{s: [1] for s in range(1, 9)}, 5: [1, 2]}  # from checkpoint 4
    assert verify_chain(task) is None


@pytest.mark.django_db(transaction=True)  # the fault drops the database connection, which would end a test transaction
def test_the_slice_wrapper_survives_a_dead_connection_and_rings_again(alice):
    task, _ = do_create_task(console(alice.tenant, "user:test"), agent="noop", input={"steps": 2})
    terminate_backend(backend_pid())  # the connection dies just before the claim
    tasks.run_task_slice(str(task.id))  # the claim meets the dead connection: no exception escapes
    task.refresh_from_db()
    assert task.status == "queued" and task.lease_owner is None and task.lease_epoch == 0
    tasks.run_task_slice(str(task.id))  # the retry finds a fresh connection
    assert Task.objects.get(id=task.id).status == "completed"


def in_another_connection(sql: str) -> None:
    """`sql` from a connection of its own, as a deploy's migration would run beside workers."""

    def run() -> None:
        with connection.cursor() as cursor:
            cursor.execute(sql)
        connection.close()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive()


@pytest.mark.django_db(transaction=True)  # the migration runs from another connection, which must see the rows
def test_a_prepared_commit_that_a_migration_outdated_delays_the_task_and_never_fails_it(alice, settings):
    settings.RUNTIME_SLICE_STEPS = 8
    settings.RUNTIME_DB_PREPARE_THRESHOLD = 5  # whatever the environment says: prepared by the sixth step
    task, _ = do_create_task(console(alice.tenant, "user:test"), agent="noop", input={"steps": 20})
    assert engine.run_slice(task.id, worker_id="w1") is engine.SliceOutcome.CONTINUE
    with connection.cursor() as cursor:  # a step's commit runs prepared (runtime_site.dbpool.bound_cursor)
        cursor.execute("SELECT statement FROM pg_prepared_statements WHERE statement LIKE 'WITH fence AS (UPDATE%%'")
        assert cursor.fetchall()
    # A migration changes a column the commit reads back: PostgreSQL refuses to run the
    # prepared statement ("cached plan must not change result type").
    table = Task._meta.db_table
    in_another_connection(f"ALTER TABLE {table} ALTER COLUMN priority TYPE bigint")
    try:
        outcomes = [engine.run_slice(task.id, worker_id="w1") for _ in range(2)]
        task.refresh_from_db()
        assert task.status == "working" and task.error is None
        assert engine.SliceOutcome.RETRY in outcomes and task.infra_faults <= 1
        assert run_to_end(task)[-1] is engine.SliceOutcome.DONE
    finally:
        in_another_connection(f"ALTER TABLE {table} ALTER COLUMN priority TYPE integer")
    task.refresh_from_db()
    assert task.status == "completed" and task.steps_done == 20
    assert sorted(attempts(task)) == list(range(1, 21))  # the refused commit wrote nothing; the rest ran again


@pytest.mark.parametrize("forget", ["DISCARD ALL", "DEALLOCATE ALL"])
@pytest.mark.django_db(transaction=True)  # the fault drops the database connection, which would end a test transaction
def test_prepared_statements_the_server_forgot_delay_the_task_and_never_fail_it(alice, settings, forget):
    # Run on the worker's connection (by an agent's own SQL, say), these end the statements
    # psycopg knows prepared: the next step's commit names one the server no longer has.
    settings.RUNTIME_SLICE_STEPS = 8
    settings.RUNTIME_DB_PREPARE_THRESHOLD = 5
    task, _ = do_create_task(console(alice.tenant, "user:test"), agent="noop", input={"steps": 20})
    assert engine.run_slice(task.id, worker_id="w1") is engine.SliceOutcome.CONTINUE
    with connection.cursor() as cursor:
        cursor.execute(forget)
    outcomes = run_to_end(task)
    if outcomes[-1] is engine.SliceOutcome.RETRY:  # at worst an infrastructure fault: a new connection, the step again
        outcomes += run_to_end(task)
    assert outcomes[-1] is engine.SliceOutcome.DONE
    task.refresh_from_db()
    assert task.status == "completed" and task.steps_done == 20 and task.infra_faults <= 1
    assert sorted(attempts(task)) == list(range(1, 21))


@pytest.mark.parametrize(
    ("error", "infrastructure"),
    [
        (OperationalError("server closed the connection unexpectedly"), True),
        (InterfaceError("connection already closed"), True),
        (psycopg.errors.AdminShutdown("terminating connection due to administrator command"), True),
        (redis.exceptions.ConnectionError("Connection refused"), True),
        (kombu.exceptions.OperationalError("Error 111 connecting to 127.0.0.1:6379"), True),
        (botocore.exceptions.EndpointConnectionError(endpoint_url="http://minio:9000"), True),
        (botocore.exceptions.ClientError({"ResponseMetadata": {"HTTPStatusCode": 503}}, "PutObject"), True),
        (botocore.exceptions.ClientError({"ResponseMetadata": {"HTTPStatusCode": 403}}, "PutObject"), False),
        (IntegrityError("duplicate key value violates unique constraint"), False),
        (RuntimeError("disk on fire"), False),
    ],
)
def test_only_infrastructure_errors_are_classified_as_such(error, infrastructure):
    assert faults.is_infrastructure_error(error) is infrastructure
    wrapped = RuntimeError("the agent wrapped it")
    wrapped.__cause__ = error  # raise ... from error
    assert faults.is_infrastructure_error(wrapped) is infrastructure


def wrapped_by_django(error: psycopg.Error) -> Exception:
    """`error` as Django raises it: its DB-API class's wrapper, raised from the driver's."""
    from django.db import utils

    wrapper = getattr(utils, type(error).__mro__[1].__name__)
    django_error = wrapper(str(error))
    django_error.__cause__ = error
    return django_error


@pytest.mark.parametrize(
    ("sqlstate", "cause"),
    [
        ("08006", "the database is unreachable"),
        ("53300", "out of resources"),
        ("57014", "statement timed out"),
        ("57P01", "ended the session"),
        ("57P03", "starting up or shutting down"),
        ("25P03", "idle in a transaction"),
        ("25P04", "transaction timed out"),
        ("40001", "serialization failure"),
        ("40P01", "deadlocked"),
        ("55P03", "lock was not available"),
        ("58000", "system error"),
        ("58030", "I/O error"),
        ("54000", None),  # a statement too complex: the same again on a retry
        ("55000", None),  # object not in prerequisite state: about the statement
        ("23505", None),  # a unique violation
        ("42601", None),  # a syntax error: a bug
    ],
)
def test_database_errors_are_classified_by_their_sqlstate_however_they_are_wrapped(sqlstate, cause):
    """One classification (faults.infrastructure_fault) for the engine and the web edges: a
    SQLSTATE of the moment (the connection, resources, an operator, a timeout, a conflict) is
    a fault to retry, named; one about the statement is not, though Django and psycopg class
    several of both as OperationalError."""
    error = psycopg.errors.lookup(sqlstate)("from the server")
    for raised in (error, wrapped_by_django(error)):
        found = faults.infrastructure_fault(raised)
        assert (found is None) if cause is None else (cause in (found or "")), (sqlstate, found)
        assert faults.is_infrastructure_error(raised) is (cause is not None)


def test_connection_errors_without_a_sqlstate_are_faults_named_for_what_failed():
    from psycopg_pool import PoolTimeout

    from runtime_site.dbpool import NoAnswer, StalePlan

    assert faults.infrastructure_fault(NoAnswer("no answer")) == "the database did not answer in time"
    assert faults.infrastructure_fault(PoolTimeout("none free")) == "no database connection was free in time"
    assert "went stale" in (faults.infrastructure_fault(wrapped_by_django(StalePlan("a migration"))) or "")
    closed = psycopg.OperationalError("the connection is closed")
    assert faults.infrastructure_fault(wrapped_by_django(closed)) == "the database is unreachable"
    assert faults.infrastructure_fault(psycopg.ProgrammingError("a bad query")) is None
    assert faults.infrastructure_fault(redis.exceptions.ConnectionError("refused")) == "Redis is unreachable"
    from tasks_app.oauth import IssuerUnavailable

    assert faults.infrastructure_fault(IssuerUnavailable()) == "the token issuer is unreachable"


def test_the_backoff_grows_with_faults_in_a_row_up_to_a_cap():
    assert [faults.backoff(n) for n in (1, 2, 3, 4, 5, 6, 7, 50)] == [1, 2, 4, 8, 16, 30, 30, 30]


@pytest.mark.django_db(transaction=True)  # the fault drops the database connection, which would end a test transaction
def test_a_cancel_after_a_slice_was_abandoned_settles_the_pause_it_left_pending(alice):
    # A pause is accepted while a worker holds the task (pending: it lands at the safe
    # point), then the slice is abandoned to an infrastructure fault and gives the lease back.
    # A cancel over REST now finds nobody holding the task: the task ends, and the pause
    # must not stay "pending" in the history for ever (a client waiting on it never returns).
    task, _ = do_create_task(console(alice.tenant, "user:test"), agent="noop", input={"steps": 5})
    lease = leases.claim(task.id, worker_id="w1", ttl=30)
    engine._start_working(lease, "queued", None)  # the slice is under way
    client = alice.client()
    version = client.get(f"/runtime/tasks/{task.id}").json()["stateVersion"]
    response = client.post(
        f"/runtime/tasks/{task.id}/steering",
        {"commandId": "pause-1", "type": "pause", "payload": {}, "expectedVersion": version},
        format="json",
    )
    assert response.status_code == 202 and response.json()["status"] == "pending", response.content
    engine._abandon(lease, OperationalError("server closed the connection unexpectedly"))

    response = client.post(f"/runtime/tasks/{task.id}/cancel", {"reason": "stop it"}, format="json")
    assert response.status_code in (200, 202), response.content
    snapshot = client.get(f"/runtime/tasks/{task.id}").json()
    assert snapshot["runtimeStatus"] == "cancelled"
    history = client.get(f"/runtime/tasks/{task.id}/steering").json()["results"]
    assert [c["status"] for c in history] != ["pending"], history
    assert all(c["status"] in ("applied", "rejected") for c in history), history
    assert verify_chain(Task.objects.get(id=task.id)) is None


@register
class ForeignStoreAgent(Agent):
    """Its steps write to the agent's own S3 bucket at an endpoint that does not answer: a
    mistake of the agent's, that raises what the blob store raises when it is down."""

    name = "test_foreign_store"
    input_schema = {"type": "object"}

    def start(self, input: dict[str, Any], goal: str) -> dict[str, Any]:
        return {"done": 0}

    def next_step(self, state: dict[str, Any]) -> str | None:
        return "upload" if state["done"] < 3 else None

    def run_step(self, ctx: StepContext, state: dict[str, Any]) -> dict[str, Any]:
        if state["done"] == 1:
            raise botocore.exceptions.EndpointConnectionError(endpoint_url="http://customer-bucket.invalid")
        return {"done": state["done"] + 1}

    def result(self, state: dict[str, Any]) -> dict[str, Any]:
        return {"done": state["done"]}


@pytest.mark.django_db(transaction=True)  # the fault drops the database connection, which would end a test transaction
def test_infrastructure_faults_without_progress_are_held_for_an_operator_not_retried_for_ever(alice, settings):
    # What looks like an infrastructure fault may be the agent's own (its own client to a
    # wrong endpoint), or a part of ours that stays down: retried with backoff for ever, the
    # task would show "working" and never end. After max_infra_faults abandoned slices in a
    # row without a new step, it is held for an operator (dead-lettered, with the diagnosis),
    # who can redrive it.
    settings.RUNTIME = {**settings.RUNTIME, "runtime": {**settings.RUNTIME["runtime"], "max_infra_faults": 4}}
    task, _ = do_create_task(console(alice.tenant, "user:test"), agent="test_foreign_store", input={})
    for n in range(10):
        tasks.run_task_slice(str(task.id), faults_in_a_row=n)
        task.refresh_from_db()
        if task.status != "working":
            break
    assert task.status == "dead_lettered", (task.status, task.infra_faults)
    assert task.infra_faults == 4 and task.recoveries == 0
    assert task.error["code"] == "infrastructure_faults" and "EndpointConnectionError" in task.error["message"]
    assert task.lease_owner is None and "infrastructure" in task.status_message
    assert set(Step.objects.filter(task=task).values_list("sequence", flat=True)) == {1}  # re-runs only
    assert verify_chain(task) is None

    # The operator sees it, fixes the cause (here: nothing), and redrives: the count starts afresh.
    operators.do_redrive_task(task.id, who=console(task.tenant, "user:ops"), reason="endpoint fixed")
    tasks.run_task_slice(str(task.id))
    task.refresh_from_db()
    assert task.status == "working" and task.infra_faults == 5  # retried, not held again at once


@register
class HostileOutputAgent(Agent):
    """Two steps; the first reads a document with a NUL byte or a lone surrogate in it (as
    fetched content may have), or a number parsed as NaN or infinity, or a tree nested
    thousands deep, and puts a line of it (or the number, the tree) where the agent puts
    things: `where`."""

    name = "test_hostile_output"
    input_schema = {"type": "object"}

    def start(self, input: dict[str, Any], goal: str) -> dict[str, Any]:
        return {"done": 0, "lines": []}

    def next_step(self, state: dict[str, Any]) -> str | None:
        return f"read-{state['done'] + 1}" if state["done"] < 2 else None

    def run_step(self, ctx: StepContext, state: dict[str, Any]) -> dict[str, Any]:
        bad = ctx.input["bad"]
        if bad == "deep":  # a parser's tree of a hostile page, say: far past any recursion limit
            line: Any = "page 1"
            for _ in range(5000):
                line = [line]
        else:
            line = float(bad) if isinstance(bad, str) else "page 1" + chr(bad)
        if state["done"] == 0:
            match ctx.input["where"]:
                case "log":
                    ctx.log(line)
                case "summary":
                    ctx.summary["first"] = line
                case "state":
                    state = {**state, "lines": [line]}
        return {**state, "done": state["done"] + 1}

    def result(self, state: dict[str, Any]) -> dict[str, Any]:
        return {"done": state["done"]}


@pytest.mark.parametrize(
    "bad", [0x0, 0xD800, "nan", "-inf", "deep"], ids=["nul", "lone-surrogate", "nan", "infinity", "deep"]
)
@pytest.mark.parametrize("where", ["log", "summary", "state"])
def test_an_agent_output_the_database_cannot_store_fails_the_step_with_a_diagnosis(alice, where, bad):
    # Not a crash (the worker is fine) and not infrastructure: the agent's own output cannot
    # be stored. It must fail the step at once, saying why, not escape the slice, hold the
    # lease until it expires and crash-loop through recoveries into a misleading dead letter.
    task, _ = do_create_task(
        console(alice.tenant, "user:test"), agent="test_hostile_output", input={"where": where, "bad": bad}
    )
    outcome = engine.run_slice(task.id, worker_id="w1")
    task.refresh_from_db()
    assert outcome is engine.SliceOutcome.DONE
    assert task.status == "failed" and task.recoveries == 0 and task.lease_owner is None
    assert task.error["code"] == "step_failed" and task.error["step"] == "read-1", task.error
    assert "cannot be stored" in task.error["message"], task.error
    assert verify_chain(task) is None


@pytest.fixture
def role_without_a_slot() -> Any:
    """A login role PostgreSQL refuses every connection for want of a slot (CONNECTION LIMIT
    0: SQLSTATE 53300, as max_connections reached is), on the shared server without filling
    it; its connection string. Superusers are exempt from the limit, so it is none."""
    import uuid

    from django.db import connection as default

    name = f"noslot_{uuid.uuid4().hex[:12]}"
    with default.cursor() as cursor:
        cursor.execute(f"CREATE ROLE {name} LOGIN CONNECTION LIMIT 0")
    db = default.settings_dict
    try:
        yield f"host={db['HOST'] or '127.0.0.1'} port={db['PORT'] or 5432} dbname={db['NAME']} user={name}"
    finally:
        with default.cursor() as cursor:
            cursor.execute(f"DROP ROLE {name}")


@pytest.mark.django_db(transaction=True)  # the role is the server's, made and dropped outside a test transaction
def test_a_connection_refused_for_want_of_a_slot_is_named_so_not_unreachable(role_without_a_slot):
    # libpq gives a refused connection no SQLSTATE: the server's words are all there is. An
    # operator told "unreachable" looks at the network; the cause is max_connections.
    with pytest.raises(psycopg.OperationalError) as refused:
        psycopg.connect(role_without_a_slot)
    assert refused.value.sqlstate is None
    found = faults.infrastructure_fault(refused.value)
    assert found is not None and "no connection slot free" in found, found
    assert faults.infrastructure_fault(wrapped_by_django(refused.value)) == found


@pytest.mark.django_db(transaction=True)
def test_a_pool_that_cannot_connect_for_want_of_a_slot_names_that_not_a_busy_pool(role_without_a_slot):
    # The pool connects in its own threads and answers the request only "none free in time":
    # the cause is the connection it could not make, which the 503 names.
    from psycopg_pool import ConnectionPool, PoolTimeout

    from runtime_site.dbpool import DeadlineConnection

    pool = ConnectionPool(
        role_without_a_slot, connection_class=DeadlineConnection, min_size=1, open=False, reconnect_timeout=5
    )
    pool.open(wait=False)
    try:
        with pytest.raises(PoolTimeout) as timed_out:
            pool.getconn(timeout=1.5)
    finally:
        pool.close()
    found = faults.infrastructure_fault(timed_out.value)
    assert found is not None and "no connection slot free" in found, found
    # A connection made since: a pool timing out now is merely busy, and says so.
    from django.db import connection as default

    DeadlineConnection.connect(**default.get_connection_params()).close()
    assert faults.infrastructure_fault(PoolTimeout("none free")) == "no database connection was free in time"
