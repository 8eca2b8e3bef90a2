"""Task events: stored with the task's monotonic seq in the transaction of the change,
redacted (tasks_app.redaction), and published to streams only after it commits.

Stream fan-out reads these rows; a client that sees a gap in seq re-reads the snapshot.
"""

from __future__ import annotations

from typing import Any

from django.db import connection, transaction
from django.db.models import F

from tasks_app import leases
from tasks_app.models import AuditRecord, Task, TaskEvent
from tasks_app.redaction import redact
from tasks_app.streams import publish

EVENT_TYPES = frozenset(
    {
        "task.snapshot",
        "progress",
        "log",
        "artifact",
        "checkpoint",
        "steering.applied",
        "steering.rejected",
        "input_required",
        "recovering",
        "dead_lettered",
        "terminal",
    }
)


def emit(task: Task, event_type: str, data: dict[str, Any], *, audit: AuditRecord | None = None) -> TaskEvent:
    """In-transaction helper: allocate the next seq and store the event with the change.
    `audit`: the change's audit record (tasks_app.audit.next_record, not saved), written with
    the event and the chain's new head in the same statement, as record_audit would alone."""
    assert transaction.get_connection().in_atomic_block, "emit inside the change's transaction"
    [row] = prepare(task, [(event_type, data)])
    chain = {"audit_seq": audit.seq, "audit_head": audit.hash} if audit is not None else {}
    audited = [leases.Row(audit)] if audit is not None else []
    if leases.one_statement_writes():  # the seq and the row (and the record) in one statement
        computed = numbered_in_sql(row, f"{leases.FENCE}.event_seq")
        written = leases.held_write(
            task,
            {"event_seq": leases.Add(1), **chain},
            returning=("event_seq",),
            rows=[*audited, leases.Row(row, computed=computed)],
        )
        task.event_seq = written["event_seq"]
        publish_on_commit(task.id, numbered([row], task.event_seq))
        return row
    if audit is not None:
        leases.held_write(task, chain, rows=audited)
    ((seq,),) = Task.objects.filter(id=task.id).update_returning(["event_seq"], event_seq=F("event_seq") + 1)
    task.event_seq = seq
    return store(task, seq, [(event_type, data)])[0]


def store(task: Task, first_seq: int, items: list[tuple[str, dict[str, Any]]]) -> list[TaskEvent]:
    """Store events whose seqs [first_seq, first_seq + len(items)) the caller already
    allocated on the task row in this transaction (the engine folds that into its fence)."""
    rows = TaskEvent.objects.bulk_create(numbered(prepare(task, items), first_seq))
    publish_on_commit(task.id, rows)
    return rows


def prepare(task: Task, items: list[tuple[str, dict[str, Any]]]) -> list[TaskEvent]:
    """The rows of `items`, redacted and not saved, with no seq yet (numbered gives them
    theirs): `data` holds the payload alone until then."""
    for event_type, _ in items:
        assert event_type in EVENT_TYPES, event_type
    return [TaskEvent(tenant_id=task.tenant_id, task_id=task.id, type=t, data=redact(data)) for t, data in items]


def numbered(rows: list[TaskEvent], first_seq: int) -> list[TaskEvent]:
    """Give prepared rows their seqs, first_seq and on, and the data a stream client sees."""
    for seq, row in enumerate(rows, start=first_seq):
        row.seq, row.data = seq, {"seq": seq, "taskId": str(row.task_id), **row.data}
    return rows


def numbered_in_sql(row: TaskEvent, seq_sql: str) -> dict[str, tuple[str, list[Any]]]:
    """What numbered() does, in PostgreSQL, for a row inserted by the statement that
    allocates its seq (tasks_app.leases.Row.computed): `seq_sql` computes the seq there.
    jsonb's `||` lets the payload's keys win, as the dict in numbered() does."""
    payload = TaskEvent._meta.get_field("data").get_db_prep_save(row.data, connection)
    return {
        "seq": (seq_sql, []),
        "data": (
            f"jsonb_build_object('seq', {seq_sql}, 'taskId', CAST(%s AS text)) || CAST(%s AS jsonb)",
            [str(row.task_id), payload],
        ),
    }


def publish_on_commit(task_id: Any, rows: list[TaskEvent]) -> None:
    """Published only once the change is committed; never from inside the transaction."""

    def publish_rows() -> None:
        publish.publish_all(task_id, [(row.type, row.data) for row in rows])

    transaction.on_commit(publish_rows)
