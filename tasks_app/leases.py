"""Leases: who may run a task right now (DESIGN §4, STYLE 2.4).

A claim is one conditional UPDATE on the database clock that also increments the
task's lease_epoch. Every later write of the slice is fenced on that epoch, so a worker
whose lease was taken over (frozen, partitioned) can never commit again.
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, cast
from uuid import UUID

from django.conf import settings
from django.db import close_old_connections, connection, models, transaction
from django.db.models import Count, DateTimeField, ExpressionWrapper, F, Q, Subquery
from django.db.models.functions import Coalesce, Greatest, Now
from django.db.models.lookups import LessThan
from django.db.models.sql import UpdateQuery

from runtime_site import dbpool
from tasks_app import kills, telemetry
from tasks_app.models import Task, TaskQuerySet, Tenant, from_rows
from tasks_app.queue import enqueue_slice
from tasks_app.states import CLAIMABLE, Status

logger = logging.getLogger(__name__)


class AtCapacity(Exception):  # a signal, not an error
    """The task's tenant already runs runtime.max_concurrent_tasks slices: not now. Carries the
    tenant, whose waiting tasks the turned-away task rings once it is marked (wait_for_turn)."""

    def __init__(self, tenant_id: int, limit: int) -> None:
        super().__init__(f"tenant {tenant_id} runs its maximum of {limit} tasks")
        self.tenant_id = tenant_id


class LeaseLost(Exception):
    def __init__(self, task_id: UUID) -> None:
        super().__init__(f"lease on task {task_id} was lost")
        self.task_id = task_id


@dataclass(frozen=True)
class Lease:
    task_id: UUID
    worker_id: str
    epoch: int


def deadline(seconds: float) -> ExpressionWrapper:
    # The database clock for every lease comparison: worker clock skew cannot make two
    # workers both believe they hold the lease.
    return ExpressionWrapper(Now() + timedelta(seconds=seconds), output_field=DateTimeField())


def claim(task_id: UUID, *, worker_id: str, ttl: float) -> Lease | None:
    """Take the lease if nobody holds it. None: held (live or lost), not runnable, or done.
    AtCapacity: its tenant is at runtime.max_concurrent_tasks (0: no limit).

    A lease that expired in its holder's hands is never taken here: its holder is lost
    (or frozen), and only a recovery (operators.do_mark_recovering, the reaper's, or the
    engine's on a message its lost holder left) hands the task on, counted. A claim that
    took it over unseen let a step that kills every worker running it run for ever: an
    at-least-once broker gives the dead worker's message to the next one, whose claim
    counted nothing, so max_recoveries was never reached."""
    claimed = claim_task(task_id, worker_id=worker_id, ttl=ttl)
    return claimed[0] if claimed else None


def claim_task(task_id: UUID, *, worker_id: str, ttl: float) -> tuple[Lease, Task] | None:
    """claim(), and the task row as the claim left it, read back by the claiming UPDATE
    itself (RETURNING): one statement, or with a tenant limit two in one transaction."""
    claimed = claim_and_read(task_id, worker_id=worker_id, ttl=ttl, then=None)
    return claimed[:2] if claimed else None


def claim_and_read(
    task_id: UUID, *, worker_id: str, ttl: float, then: tuple[str, Sequence[Any]] | None
) -> tuple[Lease, Task, tuple[Any, ...] | None] | None:
    """claim_task(), and `then`, the read (SQL and its parameters, one row) that the claimer
    makes next, sent after the claim in the claim's own message where the claim is one
    (_one_round_trip_claims): a statement of its own there, it sees everything committed
    before the claim, as it would sent after it. Its row, or None where it was not sent (the
    caller reads it itself then)."""
    limit = settings.RUNTIME["runtime"]["max_concurrent_tasks"]
    values: dict[str, Any] = {
        "lease_owner": worker_id,
        "lease_expires_at": deadline(ttl),
        "lease_epoch": F("lease_epoch") + 1,
        "waiting_turn_since": None,
    }
    read = None
    if _one_round_trip_claims():
        rows, read = _claim_in_one_round_trip(task_id, worker_id, ttl, limit, then)
    elif not limit:
        rows = _claimable().filter(id=task_id).update_returning(**values)
    else:
        with transaction.atomic():
            rows = _claim_within_capacity(task_id, limit, values)
    if not rows:
        return None  # another worker got there first, or there is nothing to do: normal
    task = rows[0]
    return Lease(task_id, worker_id, task.lease_epoch), task, read


def _one_round_trip_claims() -> bool:
    """PostgreSQL with client-side binding (Django's default): statements separated by
    semicolons go in one execute(), as one message, run in one transaction."""
    conn = transaction.get_connection()
    if conn.vendor != "postgresql":
        return False
    import psycopg

    conn.ensure_connection()
    return issubclass(conn.connection.cursor_factory, psycopg.ClientCursor)


def _claim_in_one_round_trip(
    task_id: UUID, worker_id: str, ttl: float, limit: int, then: tuple[str, Sequence[Any]] | None
) -> tuple[list[Task], tuple[Any, ...] | None]:
    """The claim of claim_task as one round trip and one transaction, in SQL written here: the
    ORM's claim took four (BEGIN, the tenant's turn, the UPDATE, COMMIT), and building its
    queries was a third of a one-step slice's CPU time (py-spy). The same statements in
    the same order: with a tenant limit, the tenant's row is locked first (FOR NO KEY
    UPDATE, as _claim_within_capacity), and the claiming UPDATE, a statement of its own,
    takes its snapshot once the turn is ours (READ COMMITTED: one per statement, also
    within one message), so it counts every claim committed before. A statement after it
    tells a task turned away at capacity from one that is not claimable; the caller's read
    (`then`), if any, comes last.

    Outside a transaction of the caller's, the claim commits without waiting for its WAL
    flush (synchronous_commit off, for this transaction only): a slice's one durable
    commit is its step's. Nothing leaves the worker on a claim alone: the first durable
    write after it (a step, a ledger row before a call, a renewal before one) flushes the
    WAL up to itself, the claim included, and if the database crashed before that, the
    claim is gone and so is the lease, so the fence (epoch and owner) refuses every write
    of the slice, as after a takeover. What the claim cost beside a bare hop was this
    second flush per slice (bench/slices.py)."""
    conn = transaction.get_connection()
    table = conn.ops.quote_name(Task._meta.db_table)
    fields = Task._meta.concrete_fields
    back = ", ".join(conn.ops.quote_name(f.column) for f in fields)
    claimable = "status = ANY(%s) AND lease_owner IS NULL"  # as _claimable()
    statuses = [str(s) for s in CLAIMABLE]
    params: list[Any] = []
    sql = []
    if limit:
        tenants = conn.ops.quote_name(Tenant._meta.db_table)
        sql.append(
            f"SELECT id FROM {tenants} WHERE id = (SELECT tenant_id FROM {table} WHERE id = %s) FOR NO KEY UPDATE"  # noqa: S608
        )
        params.append(task_id)
    update = (
        f"UPDATE {table} SET lease_owner = %s,"  # noqa: S608 (names from the model; values are parameters)
        # clock_timestamp(): STATEMENT_TIMESTAMP() is when the message arrived, before the
        # wait for the tenant's turn, which would come off the lease.
        " lease_expires_at = clock_timestamp() + make_interval(secs => %s),"
        f" lease_epoch = lease_epoch + 1, waiting_turn_since = NULL WHERE id = %s AND {claimable}"
    )
    params += [worker_id, float(ttl), task_id, statuses]
    if limit:
        update += (
            f" AND (SELECT COUNT(*) FROM {table} AS other WHERE other.tenant_id = {table}.tenant_id"  # noqa: S608
            " AND other.lease_owner IS NOT NULL AND other.lease_expires_at > STATEMENT_TIMESTAMP()"
            " AND other.id <> %s) < %s"
        )
        params += [task_id, limit]
    sql.append(f"{update} RETURNING {back}")
    if limit:
        sql.append(f"SELECT EXISTS (SELECT 1 FROM {table} WHERE id = %s AND {claimable})")  # noqa: S608
        params += [task_id, statuses]
    if then is not None:
        sql.append(then[0])
        params += then[1]
    lazy = not conn.in_atomic_block
    if lazy:
        sql.insert(0, "SET LOCAL synchronous_commit TO OFF")
    turned_away: int | None = None  # the tenant whose limit turned the claim away
    read = None
    with transaction.mark_for_rollback_on_error(), conn.cursor() as cursor:
        cursor.execute("; ".join(sql), params)
        if lazy:
            cursor.nextset()
        tenant = cursor.fetchone() if limit else None
        if limit:
            cursor.nextset()
        rows = cursor.fetchall()
        if limit:
            cursor.nextset()
            if not rows and tenant is not None and cursor.fetchone()[0]:
                turned_away = tenant[0]
        if then is not None:
            cursor.nextset()
            read = cursor.fetchone()
    if turned_away is not None:
        raise AtCapacity(turned_away, limit)
    return from_rows(Task, [f.attname for f in fields], rows), read


def _claim_within_capacity(task_id: UUID, limit: int, values: dict[str, Any]) -> list[Task]:
    """Claims of one tenant take turns on its row (FOR NO KEY UPDATE: creating tasks, which
    only key-share it, goes on), so the count of running slices cannot be raced past: the
    claiming UPDATE counts them in a statement that starts once the turn is ours, and so
    sees every claim committed before (READ COMMITTED: a snapshot per statement)."""
    tenant_id = (
        Tenant.objects.select_for_update(no_key=True)
        .filter(id__in=Task.objects.filter(id=task_id).values("tenant_id"))
        .values_list("id", flat=True)
        .first()
    )
    if tenant_id is None:
        return []  # no such task
    leased = Task.objects.for_tenant(tenant_id).filter(lease_owner__isnull=False, lease_expires_at__gt=Now())
    running = leased.exclude(id=task_id).order_by().values("tenant_id").annotate(n=Count("*")).values("n")
    rows: list[Task] = (
        _claimable()
        .filter(id=task_id)
        .filter(LessThan(Coalesce(Subquery(running), 0), limit))
        .update_returning(**values)
    )
    if not rows and _claimable().filter(id=task_id).exists():
        raise AtCapacity(tenant_id, limit)
    return rows


def _claimable() -> TaskQuerySet:
    """Runnable and held by nobody (no owner, no expiry: Task.drop_lease clears both). An
    expired lease still has its owner: a recovery's to hand on (claim)."""
    return Task.objects.filter(status__in=CLAIMABLE, lease_owner__isnull=True)


def wait_for_turn(task_id: UUID, *, tenant_id: int) -> None:
    """Turned away at capacity (its message is dropped): remember it, so that whatever frees
    a turn rings it (the stall scanner is the backstop). Then, once the mark is committed,
    look for a free turn once more: the running task the claim counted may have ended
    between the claim and the mark, and its end, finding nobody marked, rang nobody; the
    task would have waited for the stall scanner (or for ever, were none running)."""
    Task.objects.filter(id=task_id, waiting_turn_since__isnull=True).update(waiting_turn_since=Now())
    ring_waiting_on_commit(tenant_id)


def take_away(task: Task, *, fence: bool = True) -> list[str]:
    """The lease of `task` (its locked or fenced row) dropped other than by the end of its
    slice: a recovery, a kill, a cancel over a lost holder, an operator's release, a
    give-back after an infrastructure fault, an expiry (fence: Task.drop_lease). A slice that
    ends rings its tenant's tasks turned away at capacity (tasks_app.tasks); here no slice
    ends to do so, or not soon, so the turn freed rings them once this commits. Returns the
    fields to save."""
    if task.lease_owner is not None:  # a turn it held (or that ran out in its holder's hands)
        ring_waiting_on_commit(task.tenant_id)
    return task.drop_lease(fence=fence)


def ring_waiting_on_commit(tenant_id: int) -> None:
    """ring_waiting(tenant_id) once the caller's transaction commits (at once outside one)."""
    if settings.RUNTIME["runtime"]["max_concurrent_tasks"]:
        # robust: a broker or database outage must not undo or fail what committed; the stall
        # scanner re-finds the waiting tasks.
        transaction.on_commit(functools.partial(ring_waiting, tenant_id), robust=True)


def ring_waiting(tenant_id: int) -> None:
    """A turn of the tenant may be free: ring its tasks turned away at capacity, as many as
    there are free turns (should a ring be lost, the stall scanner re-finds them)."""
    with telemetry.detached():  # other tasks' messages: not in the trace of what freed the turn
        for task_id, priority in waiting_for_turns(tenant_id):
            enqueue_slice(task_id, priority)


def next_waiting(task_id: UUID, *, tenant_id: int | None = None) -> list[tuple[UUID, int]]:
    """After a slice of `task_id` (of `tenant_id`, if the caller knows) ended: its tenant's
    tasks turned away at capacity, most urgent first, as many as there are free turns.
    Nobody turned away: nothing rung."""
    if tenant_id is None:
        tenant_id = Task.objects.filter(id=task_id).values_list("tenant_id", flat=True).first()
    if tenant_id is None:  # the task is gone: nobody of its tenant to ring
        return []
    return waiting_for_turns(tenant_id)


def waiting_for_turns(tenant_id: int) -> list[tuple[UUID, int]]:
    """The tenant's tasks turned away at capacity, most urgent first, as many as there are
    free turns now (none without a limit)."""
    limit = settings.RUNTIME["runtime"]["max_concurrent_tasks"]
    if not limit:
        return []
    conn = transaction.get_connection()
    if conn.vendor == "postgresql":
        return _next_waiting_sql(tenant_id, limit, conn)
    waiting = Task.objects.filter(
        tenant_id=tenant_id, waiting_turn_since__isnull=False, status__in=CLAIMABLE, lease_owner__isnull=True
    ).order_by("priority", "waiting_turn_since")
    if not waiting.exists():
        return []
    running = Task.objects.for_tenant(tenant_id).filter(lease_owner__isnull=False, lease_expires_at__gt=Now()).count()
    return list(waiting.values_list("id", "priority")[: max(limit - running, 0)])


def _next_waiting_sql(tenant_id: int, limit: int, conn: Any) -> list[tuple[UUID, int]]:
    """next_waiting's reads as one statement, in SQL written here: it runs at the end of
    every slice, where the ORM's three queries (anyone waiting? how many run? who?) took
    three round trips and building them a tenth of a one-step slice's CPU time."""
    table = conn.ops.quote_name(Task._meta.db_table)
    sql = (
        f"SELECT id, priority FROM {table} WHERE tenant_id = %s AND waiting_turn_since IS NOT NULL"  # noqa: S608 (names from the model; values are parameters)
        " AND status = ANY(%s) AND lease_owner IS NULL ORDER BY priority, waiting_turn_since"
        f" LIMIT GREATEST(%s - (SELECT COUNT(*) FROM {table} WHERE tenant_id = %s AND lease_owner IS NOT NULL"
        " AND lease_expires_at > STATEMENT_TIMESTAMP()), 0)"
    )
    params = [tenant_id, [str(s) for s in CLAIMABLE], limit, tenant_id]
    with dbpool.bound_cursor(conn, params) as cursor:
        cursor.execute(sql, params)
        return [(row[0], row[1]) for row in cursor.fetchall()]


def renew(lease: Lease, *, ttl: float, unless_killed: bool = True) -> bool:
    """False means the lease is lost, or its task was killed (tasks_app.kills): write and
    send nothing more of the step. unless_killed=False: a killed task whose call in flight
    must finish keeps its lease until the call is recorded."""
    held = Task.objects.filter(id=lease.task_id, lease_epoch=lease.epoch, lease_owner=lease.worker_id)
    if unless_killed:
        held = held.filter(kill_requested=False)
    return held.update(lease_expires_at=deadline(ttl)) == 1


def killed_while_held(lease: Lease) -> bool | None:
    """After a refused renewal: True, killed and still ours (a call that must finish is in
    flight); False, killed and fenced out; None, not killed (the lease is simply lost)."""
    row = Task.objects.filter(id=lease.task_id).values_list("kill_requested", "lease_epoch", "lease_owner").first()
    if row is None or not row[0]:
        return None
    return (row[1], row[2]) == (lease.epoch, lease.worker_id)


def confirm(lease: Lease) -> None:
    """Right before an external call: renew the lease on its fence, or LeaseLost. Rows
    are fenced, the wire is not; a worker frozen past its lease and thawed after a
    takeover stops here instead of sending. The epoch, not the clock, decides: an
    expired lease nobody has taken over is still ours, and this renewal keeps it so.
    What remains is the time between this statement and the bytes on the wire: an
    outbound client checks that too, right before it sends (still_confirmed)."""
    started = _clock()  # before the renewal: the lease runs at least ttl from here
    if not renew(lease, ttl=settings.RUNTIME_LEASE_SECONDS):
        if killed_while_held(lease) is not None:
            raise kills.StepKilled(f"task {lease.task_id} was killed")  # no call starts after a kill
        raise LeaseLost(lease.task_id)
    _confirmed.set((lease.task_id, started + settings.RUNTIME_LEASE_SECONDS * 0.9))


@contextlib.contextmanager
def sending(lease: Lease) -> Iterator[None]:
    """An external call under the lease: confirm() it, and until the call returns an
    outbound client's still_confirmed() holds the send to that renewal."""
    confirm(lease)
    try:
        yield
    finally:
        _confirmed.set(None)


def still_confirmed() -> None:
    """Called by an outbound client right before the bytes go out (an HTTP request hook):
    LeaseLost if the renewal confirm() made has run out since. A worker frozen (SIGSTOP, a
    paused container) between confirm() and the send wakes after that; by then its lease
    may have been taken over, and the new holder, finding the call's ledger row started
    and the remote without it, may have sent it itself (measured in bench/soak.py: a
    freeze there sent a key twice). Nothing can have taken an unexpired lease over (only
    an operator's explicit release), so a send inside it is one only we make. Outside a
    call (a reconcile's read) it checks nothing."""
    confirmed = _confirmed.get()
    if confirmed is not None and _clock() >= confirmed[1]:
        task_id = confirmed[0]
        logger.warning("task %s: the lease confirmed for a call ran out before the call was sent: not sent", task_id)
        raise LeaseLost(task_id)


def _clock() -> float:
    """Seconds that keep counting while the process is stopped (and, where the system has
    it, while the machine sleeps: CLOCK_BOOTTIME)."""
    return time.clock_gettime(BOOTTIME) if BOOTTIME is not None else time.monotonic()


BOOTTIME: int | None = getattr(time, "CLOCK_BOOTTIME", None)
# (task id, clock reading until which the lease confirmed for the call in hand is ours)
_confirmed: ContextVar[tuple[UUID, float] | None] = ContextVar("runtime_confirmed_lease", default=None)


def fenced(lease: Lease) -> Task:
    """The task row, locked, if we still hold the lease; else LeaseLost (the caller's
    transaction then rolls back whole). Call inside the safe point's transaction."""
    assert transaction.get_connection().in_atomic_block, "fence inside the write's transaction"
    task = (
        Task.objects.select_for_update()
        .filter(id=lease.task_id, lease_epoch=lease.epoch, lease_owner=lease.worker_id)
        .first()
    )
    if task is None:
        raise LeaseLost(lease.task_id)
    return task


def fenced_update(lease: Lease, **fields: Any) -> None:
    """Compare-and-set write of the task row on our lease epoch (the hot path's fence):
    zero rows means the lease was taken over, and the caller's transaction rolls back."""
    assert transaction.get_connection().in_atomic_block, "fence inside the write's transaction"
    if (
        Task.objects.filter(id=lease.task_id, lease_epoch=lease.epoch, lease_owner=lease.worker_id).update(
            updated_at=Now(), **fields
        )
        != 1
    ):
        raise LeaseLost(lease.task_id)


@dataclass(frozen=True)
class Row:
    """A row a fenced write inserts in its own statement, only if the fence held. `obj` gives
    the values; `computed` replaces some of them (by field name) with SQL over the task row
    as the write left it (FENCE.<column>, for the columns the write returns) and its
    parameters; `conflict` is an ON CONFLICT clause (an upsert)."""

    obj: models.Model
    computed: dict[str, tuple[str, list[Any]]] = field(default_factory=dict)
    conflict: str = ""


FENCE = "fence"  # the task row as a fenced write left it, in the SQL of Row.computed


# What a fenced write may set a column to, besides a plain value:
@dataclass(frozen=True)
class Add:
    """The column plus `amount`."""

    amount: int | float


@dataclass(frozen=True)
class AtLeast:
    """The larger of the column and `value` (a counter never lowered)."""

    value: int


@dataclass(frozen=True)
class Deadline:
    """`seconds` from now on the database clock, as deadline()."""

    seconds: float


class Moved(Exception):  # a signal, not an error
    """A fenced write's `expect` no longer held: it wrote nothing, and the lease may well
    still be ours (someone else changed what was expected). Write another way."""


def one_statement_writes() -> bool:
    """Whether fenced_write can insert `rows` (PostgreSQL: INSERTs in a WITH; SQLite has none)."""
    return transaction.get_connection().vendor == "postgresql"


def fenced_write(
    lease: Lease,
    fields: dict[str, Any],
    *,
    returning: tuple[str, ...],
    insert: models.Model | None = None,
    rows: Sequence[Row] = (),
    expect: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """fenced_update in one statement that also reads the row back (`returning`: the
    values after the write) and, on PostgreSQL, inserts `insert` and `rows` only if the
    fence held: UPDATE ... RETURNING inside a CTE whose INSERTs select from it. Outside a
    transaction that statement is its own transaction, so a step commits in one round trip
    where BEGIN, UPDATE, SELECT, INSERT, COMMIT took five. Elsewhere (SQLite allows no write
    in a CTE), the UPDATE ... RETURNING and then the INSERT, in the caller's transaction or
    one of their own; `rows` need one_statement_writes().
    `expect`: more compare-and-set conditions on the task row (field: value); Moved when
    the write failed and they are why it may have (nothing is written then either).
    LeaseLost when the fence failed; nothing is written then."""
    conn = transaction.get_connection()
    inserts = [*([Row(insert)] if insert is not None else []), *rows]
    one_statement = bool(inserts) and conn.vendor == "postgresql"
    assert one_statement or not rows, "rows need one_statement_writes()"
    if not (one_statement or conn.in_atomic_block):
        with transaction.atomic(durable=True):
            return fenced_write(lease, fields, returning=returning, insert=insert, expect=expect)
    if conn.vendor == "postgresql":
        sql, params = _fenced_update_sql(lease, fields, expect or {}, conn)
    else:
        update = cast(
            UpdateQuery, _fence_query(lease).chain()
        )  # a copy with no values set (a clone would share its list)
        if expect:
            update.add_q(Q(**expect))
        update.add_update_values({"updated_at": Now(), **{name: _expression(name, v) for name, v in fields.items()}})
        sql, params = update.get_compiler(connection=conn).as_sql()
    back = _columns(Task, returning)
    sql, params = f"{sql} RETURNING {back}", list(params)
    if one_statement:
        parts = [f"WITH {FENCE} AS ({sql})"]
        for i, row in enumerate(inserts):
            insert_sql, insert_params = _insert_from_fence(row, conn)
            parts.append(f"r{i} AS ({insert_sql})")
            params += insert_params
        sql = f"{', '.join(parts)} SELECT {back} FROM {FENCE}"  # noqa: S608 (names from the models; values are parameters)
    with dbpool.bound_cursor(conn, params) as cursor:
        cursor.execute(sql, params)
        row = cursor.fetchone()
    if row is None:
        if expect:
            raise Moved(lease.task_id)
        raise LeaseLost(lease.task_id)
    if insert is not None and not one_statement:
        insert.save(force_insert=True)
    return dict(zip(returning, row, strict=True))


def held_write(
    task: Task, fields: dict[str, Any], *, returning: tuple[str, ...] = (), rows: Sequence[Row] = ()
) -> dict[str, Any]:
    """For a caller already holding the task row (its lock, or its fence in this
    transaction): write `fields` to it and insert `rows` in one statement on PostgreSQL (as
    fenced_write, with no fence to check); elsewhere the UPDATE and then the INSERTs. Unlike
    fenced_write it leaves updated_at alone: the bookkeeping of an audit record or an event
    (audit_seq, event_seq) is not a change of the task. Returns `returning` after the write.
    Two round trips were one in the steering accept's nine statements (issue 14)."""
    conn = transaction.get_connection()
    assert conn.in_atomic_block, "a held row is written inside its transaction"
    if conn.vendor != "postgresql":
        values = {name: _expression(name, value) for name, value in fields.items()}
        updated = Task.objects.filter(id=task.id).update_returning(list(returning or ("id",)), **values)
        for row in rows:
            assert not row.computed and not row.conflict, "computed rows need PostgreSQL"
            row.obj.save(force_insert=True)
        return dict(zip(returning, updated[0], strict=False))
    sql, params = _update_sql(task.id, fields, {}, {}, conn, touch=False)
    back = _columns(Task, returning or ("id",))
    sql = f"WITH {FENCE} AS ({sql} RETURNING {back})"
    for i, row in enumerate(rows):
        insert_sql, insert_params = _insert_from_fence(row, conn)
        sql += f", r{i} AS ({insert_sql})"
        params += insert_params
    with dbpool.bound_cursor(conn, params) as cursor:
        cursor.execute(f"{sql} SELECT {back} FROM {FENCE}", params)  # noqa: S608 (names from the models)
        back_row = cursor.fetchone()
    assert back_row is not None, f"task {task.id} is gone"
    return dict(zip(returning, back_row, strict=False))


def insert_task(task: Task, *, rows: Sequence[Row] = ()) -> None:
    """A new task's row, exactly as `task` holds it (its timestamps too: nothing is filled in
    on the way, so what the caller built from it, such as a snapshot, says what the row
    says), and `rows` that come with it (its first audit record and event). On PostgreSQL in
    one statement, the INSERTs in a WITH, which outside a transaction is one of its own: a
    create took six round trips (BEGIN, the task, the audit record with the chain's head, the
    event with its seq, COMMIT), all on the path of submit -> first step (bench/latency.py).
    Elsewhere (SQLite allows no write in a WITH), the INSERTs one by one in one transaction."""
    conn = transaction.get_connection()
    if conn.vendor != "postgresql":
        with transaction.atomic():
            task.save_base(raw=True, force_insert=True)  # raw: the values as they are, timestamps included
            for row in rows:
                assert not row.computed and not row.conflict, "computed rows need PostgreSQL"
                row.obj.save(force_insert=True)
        return
    table, names, _, columns = _insert_parts(Task)
    params = [column.get_db_prep_save(getattr(task, column.attname), conn) for column in columns]
    # VALUES, untyped: each value takes its column's type, and one too long is refused, not cut.
    values = ", ".join(["%s"] * len(columns))
    sql = f"WITH {FENCE} AS (INSERT INTO {table} ({names}) VALUES ({values}) RETURNING id)"  # noqa: S608 (names from the model)
    for i, row in enumerate(rows):
        insert_sql, insert_params = _insert_from_fence(row, conn)
        sql += f", r{i} AS ({insert_sql})"
        params += insert_params
    with transaction.mark_for_rollback_on_error(), dbpool.bound_cursor(conn, params) as cursor:
        cursor.execute(f"{sql} SELECT id FROM {FENCE}", params)  # noqa: S608 (names from the models)


def _fenced_update_sql(
    lease: Lease, fields: dict[str, Any], expect: dict[str, Any], conn: Any
) -> tuple[str, list[Any]]:
    """The fenced UPDATE in PostgreSQL, written here rather than by the ORM: building and
    compiling the query was most of a step's CPU time (py-spy). Values are parameters."""
    fence = {"lease_epoch": lease.epoch, "lease_owner": lease.worker_id}
    return _update_sql(lease.task_id, fields, fence, expect, conn, touch=True)


def _update_sql(
    task_id: UUID, fields: dict[str, Any], fence: dict[str, Any], expect: dict[str, Any], conn: Any, *, touch: bool
) -> tuple[str, list[Any]]:
    """UPDATE of the task row `task_id` (and `fence`/`expect`: column = value conditions),
    setting `fields`, and updated_at when `touch`."""
    sets: list[str] = ["updated_at = STATEMENT_TIMESTAMP()"] if touch else []
    params: list[Any] = []
    for name, value in fields.items():
        field, column = _column(name)
        if isinstance(value, Add):
            sets.append(f"{column} = {column} + %s")
            params.append(value.amount)
        elif isinstance(value, AtLeast):
            sets.append(f"{column} = GREATEST({column}, %s)")
            params.append(value.value)
        elif isinstance(value, Deadline):
            sets.append(f"{column} = STATEMENT_TIMESTAMP() + make_interval(secs => %s)")
            params.append(float(value.seconds))
        else:
            assert not hasattr(value, "resolve_expression"), f"{name}: a plain value, Add, AtLeast or Deadline"
            sets.append(f"{column} = %s")
            params.append(field.get_db_prep_save(value, conn))
    where = ["id = %s"]
    params.append(task_id)
    for name, value in {**fence, **expect}.items():
        field, column = _column(name)
        where.append(f"{column} = %s")
        params.append(field.get_db_prep_save(value, conn))
    table = conn.ops.quote_name(Task._meta.db_table)
    return f"UPDATE {table} SET {', '.join(sets)} WHERE {' AND '.join(where)}", params  # noqa: S608 (names from the model)


@functools.cache
def _column(name: str) -> tuple[models.Field[Any, Any], str]:
    field = cast("models.Field[Any, Any]", Task._meta.get_field(name))
    return field, connection.ops.quote_name(field.column or name)


def _expression(name: str, value: Any) -> Any:
    """A fenced write's value as the ORM writes it (databases other than PostgreSQL)."""
    if isinstance(value, Add):
        return F(name) + value.amount
    if isinstance(value, AtLeast):
        return Greatest(F(name), value.value)
    if isinstance(value, Deadline):
        return deadline(value.seconds)
    return value


def _insert_from_fence(row: Row, conn: Any) -> tuple[str, list[Any]]:
    """INSERT INTO <row's table> (...) SELECT <its values> FROM FENCE [ON CONFLICT ...]."""
    table, names, placeholders, columns = _insert_parts(type(row.obj))
    values, params = [], []
    for column, placeholder in zip(columns, placeholders, strict=True):
        if column.name in row.computed:
            sql, more = row.computed[column.name]
            values.append(f"({sql})")
            params += more
        else:
            values.append(placeholder)
            params.append(column.get_db_prep_save(column.pre_save(row.obj, add=True), conn))
    # Table, column names and placeholders come from the model (_insert_parts), values are parameters.
    return f"INSERT INTO {table} ({names}) SELECT {', '.join(values)} FROM {FENCE} {row.conflict}", params  # noqa: S608


# The SQL that does not change from step to step, built once (per slice, per model): the
# ORM's query building was most of a step's CPU time.


@functools.lru_cache(maxsize=16)
def _fence_query(lease: Lease) -> UpdateQuery:
    return cast(
        UpdateQuery,
        Task.objects.filter(id=lease.task_id, lease_epoch=lease.epoch, lease_owner=lease.worker_id).query.chain(
            UpdateQuery
        ),
    )


@functools.cache
def _columns(model: type[models.Model], names: tuple[str, ...]) -> str:
    return ", ".join(
        connection.ops.quote_name(cast("models.Field[Any, Any]", model._meta.get_field(name)).column or name)
        for name in names
    )


@functools.cache
def _insert_parts(model: type[models.Model]) -> tuple[str, str, list[str], list[models.Field[Any, Any]]]:
    """(table, column list, typed placeholder per column, fields) of an INSERT ... SELECT of
    one row: typed, since a SELECT list makes untyped literals text. A primary key the
    database numbers is left to it; one made in Python (a task's UUID) is a value."""
    quote = connection.ops.quote_name
    fields = [f for f in model._meta.concrete_fields if f is not model._meta.auto_field]
    return (
        quote(model._meta.db_table),
        ", ".join(quote(f.column or f.name) for f in fields),
        [f"CAST(%s AS {f.db_type(connection) or ''})" for f in fields],
        fields,
    )


def stalled(
    *, stall_seconds: float, recovering_seconds: float | None = None, limit: int = 500
) -> list[tuple[UUID, int]]:
    """Runnable tasks with no lease, untouched for stall_seconds: the broker lost their
    message (or it never left a crashed web process). Not a crash; nothing is counted.

    A recovering task waits only recovering_seconds: its message, rung by the reaper, is
    claimed at once by any free worker, so one still unclaimed most likely died with the
    worker (or broker) that held it; and recovering tasks are few, so ringing again
    early cannot flood a queue whose backlog is merely long. Queued and yielded tasks wait
    in such backlogs all the time: they keep the long interval.

    The rows are touched so the next scan leaves them alone for another interval.
    """

    def before(seconds: float) -> ExpressionWrapper:
        return ExpressionWrapper(Now() - timedelta(seconds=seconds), output_field=DateTimeField())

    due = Q(updated_at__lt=before(stall_seconds))
    if recovering_seconds is not None:
        due |= Q(status=Status.RECOVERING, updated_at__lt=before(recovering_seconds))
    rows = list(
        Task.objects.filter(due, status__in=CLAIMABLE, lease_owner__isnull=True)
        .order_by("priority", "updated_at")
        .values_list("id", "priority")[:limit]
    )
    if rows:
        Task.objects.filter(id__in=[task_id for task_id, _ in rows], lease_owner__isnull=True).update(updated_at=Now())
    return rows


class Heartbeat:
    """Renews the lease every `interval` seconds while a slice runs, from a thread of its
    own (and so its own DB connection). A failed renewal only raises the `lost` flag: the
    slice checks it before each step, and the fence stops any write anyway.

    Renewing must cost as little of the GIL as it can: the slice's thread may hold it for
    long stretches, and on a CPU-starved worker every handover waits until that thread
    is scheduled again (issue 12 #4, measured: one renewal 6 s late). So a renewal is one
    UPDATE on a connection kept from slice to slice (the heartbeat threads outlive the
    slices), with no reconnect or health-check query around it; and beats keep a fixed
    cadence, so a slow renewal does not push the next one later.

    It also holds the running step to its deadline (`watch`): renewing forever, it would
    let a hung step keep its task forever. Past it, `abandon(lease, step=, seconds=)` gives
    the task up (operators.do_abandon_step, an action a layer above this module: the engine
    passes it in)."""

    def __init__(
        self,
        lease: Lease,
        *,
        ttl: float,
        interval: float,
        abandon: Callable[..., Any],
        guard: kills.Guard | None = None,
    ) -> None:
        self.lease, self.ttl, self.interval, self.abandon = lease, ttl, interval, abandon
        self.guard = guard or kills.Guard(lease.task_id)  # the slice's: what a kill cuts
        self.lost = False
        self._stop = threading.Event()
        self._beating: Future[None] | None = None
        self._step: tuple[str, float, float] | None = None  # name, deadline in seconds, started (monotonic)

    def __enter__(self) -> Heartbeat:
        self._beating = _heartbeat_threads().submit(self._run)
        return self

    def __exit__(self, *exc: object) -> None:
        if recycle_stuck_processes:
            _watchdog(0)
        self._stop.set()
        assert self._beating is not None
        self._beating.result()

    def watch(self, step: str | None, seconds: float = 0) -> None:
        """The slice starts `step`, which may run `seconds` (0: no limit); None: the step
        returned, and nothing is watched until the next."""
        self._step = (step, seconds, time.monotonic()) if step else None
        if not recycle_stuck_processes:
            return
        # This thread abandons the step, if it gets the GIL: a step stuck in a C call that
        # holds it starves both the deadline and the renewals. The watchdog needs no GIL: a
        # lease length past the deadline (the heartbeat had its chance) it writes where the
        # step is stuck to the log and ends the process, which its pool replaces; the
        # lease, no longer renewed, has run out, and the reaper recovers the task as after
        # a crash.
        _watchdog(seconds + self.ttl if seconds else 0)

    def _run(self) -> None:
        beat = time.monotonic()
        try:
            while not self._stop.wait(max(beat + self.interval - time.monotonic(), 0)):
                beat = time.monotonic()
                step = self._step  # set by the slice's thread
                if step and step[1] and beat - step[2] > step[1]:
                    self._abandon(step)
                    return
                if step and self.guard.stuck(settings.RUNTIME["kill"]["grace_seconds"]):
                    logger.error("task %s: killed step %s did not stop", self.lease.task_id, step[0])
                    self._end_if_still_in(step)
                    return
                if self.lost:
                    continue  # killed and fenced out: nothing to renew; only a stuck step to watch for
                try:
                    if not renew(self.lease, ttl=self.ttl, unless_killed=not self.guard.killed):
                        if (held := killed_while_held(self.lease)) is not None:
                            self.guard.kill("lease")  # the doorbell was lost, or has not rung yet
                            self.lost = not held
                            continue
                        self.lost = True
                        logger.warning("lease on task %s lost (epoch %s)", self.lease.task_id, self.lease.epoch)
                        return
                except Exception:  # a DB blip: keep trying until the lease runs out
                    logger.exception("heartbeat for task %s failed", self.lease.task_id)
                    connection.close()  # the next beat connects afresh
        finally:
            # Kept for the next slice where the process keeps connections (workers:
            # CONN_MAX_AGE), closed elsewhere (tests, the web process).
            close_old_connections()

    def _abandon(self, watched: tuple[str, float, float]) -> None:
        """Past the step's deadline: stop renewing, give the task up as after a crash (the
        diagnosis audited), and end this process, which is stuck in the step, where its
        pool replaces it. The stuck thread cannot be stopped from here; should it ever
        return, the moved epoch stops its writes."""
        step, seconds, _ = watched
        self.lost = True
        logger.error("task %s: step %s ran past its deadline of %gs; abandoned", self.lease.task_id, step, seconds)
        try:
            self.abandon(self.lease, step=step, seconds=seconds)
        except Exception:  # the database is away: the lease, no longer renewed, expires instead
            logger.exception("task %s: could not record the abandoned step", self.lease.task_id)
        self._end_if_still_in(watched)

    def _end_if_still_in(self, watched: tuple[str, float, float]) -> None:
        """A step past its deadline, or killed and not stopping: end this process, stuck in
        it, where its pool replaces it."""
        if self._step is not watched:
            return  # the step returned meanwhile: the process is not stuck (the fence drops its slice)
        if recycle_stuck_processes:
            logger.error("process %s ends: its pool starts a fresh one", os.getpid())
            os.kill(os.getpid(), signal.SIGKILL)


# True in worker pool processes (runtime_site/celery.py), which their pool replaces when
# they end: a process stuck in an abandoned step ends itself. Elsewhere (tests calling the
# engine, a solo pool) the stuck thread is left alone.
recycle_stuck_processes = False
_alarm_handler_in: set[int] = set()  # the processes (pids) whose SIGALRM dumps and ends them


def _watchdog(seconds: float) -> None:
    """Arm (seconds > 0) or disarm this process's watchdog: when it fires, where each thread
    is goes to stderr and the process ends (the signal's default action). A kernel timer
    (SIGALRM) whose handler is faulthandler's, in C, so it needs no GIL; arming and
    disarming it is one system call. faulthandler.dump_traceback_later, used before,
    started and joined a thread at each call, twice a step: a tenth of a worker's time at
    short steps (py-spy), more on a busy machine, where each join waits to be scheduled.
    Signal handlers are set from the main thread only, where a prefork pool runs its tasks;
    elsewhere the thread-based watchdog does it."""
    if threading.current_thread() is not threading.main_thread():
        if seconds:
            faulthandler.dump_traceback_later(seconds, exit=True, file=2)
        else:
            faulthandler.cancel_dump_traceback_later()
        return
    if os.getpid() not in _alarm_handler_in:
        signal.signal(signal.SIGALRM, signal.SIG_DFL)  # the default action ends the process ...
        faulthandler.register(signal.SIGALRM, file=2, all_threads=True, chain=True)  # ... after the dump
        _alarm_handler_in.add(os.getpid())
    signal.setitimer(signal.ITIMER_REAL, seconds)


_executors: dict[int, ThreadPoolExecutor] = {}


def _heartbeat_threads() -> ThreadPoolExecutor:
    """This process's heartbeat threads (made after a pool forks): idle ones are reused,
    each keeping its database connection."""
    pid = os.getpid()
    if pid not in _executors:
        _executors.clear()
        _executors[pid] = ThreadPoolExecutor(max_workers=64, thread_name_prefix="heartbeat")
    return _executors[pid]
