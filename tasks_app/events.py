"""Task events: stored with the task's monotonic seq in the transaction of the change.

Stream fan-out reads these rows; a client that sees a gap in seq re-reads the snapshot.
"""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.db.models import F

from tasks_app.models import Task, TaskEvent

EVENT_TYPES = frozenset({
    "task.snapshot", "progress", "log", "artifact", "checkpoint", "steering.applied",
    "steering.rejected", "input_required", "recovering", "dead_lettered", "terminal",
})


def emit(task: Task, event_type: str, data: dict[str, Any]) -> TaskEvent:
    """In-transaction helper: allocate the next seq and store the event with the change."""
    assert event_type in EVENT_TYPES, event_type
    assert transaction.get_connection().in_atomic_block, "emit inside the change's transaction"
    Task.objects.filter(id=task.id).update(event_seq=F("event_seq") + 1)
    seq = Task.objects.values_list("event_seq", flat=True).get(id=task.id)
    task.event_seq = seq
    return TaskEvent.objects.create(
        tenant_id=task.tenant_id, task=task, seq=seq, type=event_type,
        data={"seq": seq, "taskId": str(task.id), **data},
    )
