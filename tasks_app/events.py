"""Task events: stored with the task's monotonic seq in the transaction of the change,
redacted (tasks_app.redaction), and published to streams only after it commits.

Stream fan-out reads these rows; a client that sees a gap in seq re-reads the snapshot.
"""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.db.models import F

from tasks_app.models import Task, TaskEvent
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


def emit(task: Task, event_type: str, data: dict[str, Any]) -> TaskEvent:
    """In-transaction helper: allocate the next seq and store the event with the change."""
    assert transaction.get_connection().in_atomic_block, "emit inside the change's transaction"
    Task.objects.filter(id=task.id).update(event_seq=F("event_seq") + 1)
    seq = Task.objects.values_list("event_seq", flat=True).get(id=task.id)
    task.event_seq = seq
    return store(task, seq, [(event_type, data)])[0]


def store(task: Task, first_seq: int, items: list[tuple[str, dict[str, Any]]]) -> list[TaskEvent]:
    """Store events whose seqs [first_seq, first_seq + len(items)) the caller already
    allocated on the task row in this transaction (the engine folds that into its fence)."""
    for event_type, _ in items:
        assert event_type in EVENT_TYPES, event_type
    rows = TaskEvent.objects.bulk_create(
        [
            TaskEvent(
                tenant_id=task.tenant_id,
                task_id=task.id,
                seq=seq,
                type=event_type,
                data={"seq": seq, "taskId": str(task.id), **redact(data)},
            )
            for seq, (event_type, data) in enumerate(items, start=first_seq)
        ]
    )
    # Published only once the change is committed; never from inside the transaction.
    task_id = task.id

    def publish_rows() -> None:
        for row in rows:
            publish.publish(task_id, row.type, row.data)

    transaction.on_commit(publish_rows)
    return rows
