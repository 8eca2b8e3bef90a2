"""Reads. The snapshot comes from one function, so REST, MCP and events never drift."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from django.db import transaction
from django.db.models import Exists, OuterRef, Prefetch, QuerySet, Subquery

from tasks_app.models import Task


@contextmanager
def one_snapshot() -> Iterator[None]:
    """The reads inside see the database as of one moment. Out of a transaction each query
    sees what was committed when it started: a task read input_required, then its open
    questions read after an answer committed in between, showed input_required with none.
    On PostgreSQL a REPEATABLE READ, READ ONLY transaction (its snapshot is taken at its
    first query); on SQLite a DEFERRED one (WAL: its snapshot is taken at its first read).
    Not the embedded profile's IMMEDIATE, which takes the database's write lock at BEGIN: a
    read waited behind every worker's step for it, up to the busy timeout, and held it
    while it rendered (tests/test_embedded_reads.py). Inside a transaction already it adds
    nothing: that one decides."""
    conn = transaction.get_connection()
    if conn.in_atomic_block:
        yield
        return
    with ExitStack() as snapshot:
        if conn.vendor == "sqlite":
            conn.ensure_connection()  # connecting sets transaction_mode from OPTIONS: before it is swapped
            mode, conn.transaction_mode = conn.transaction_mode, "DEFERRED"
            try:
                snapshot.enter_context(transaction.atomic())  # BEGIN DEFERRED
            finally:
                conn.transaction_mode = mode
        else:
            snapshot.enter_context(transaction.atomic())
        if conn.vendor == "postgresql":
            with conn.cursor() as cursor:  # before any query, or PostgreSQL refuses it
                cursor.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        yield


def task_urls(task: Task) -> dict[str, str]:
    base = f"/runtime/tasks/{task.id}"
    return {
        "statusUrl": base,
        "streamUrl": f"{base}/events",
        "resultUrl": f"{base}/result",
        "artifactsUrl": f"{base}/artifacts",
    }


def task_ack(task: Task) -> dict[str, Any]:
    """What an act tells a caller that may not read the task (a cancel): that it took, the
    task's status and version (what acting again needs), and where a key that may read it."""
    return {
        "taskId": str(task.id),
        "status": task.mcp_status,
        "runtimeStatus": task.status,
        "stateVersion": task.state_version,
        **task_urls(task),
    }


def with_snapshot(tasks: QuerySet[Task], *, prefetch_inputs: bool = False) -> QuerySet[Task]:
    """`tasks` with what task_snapshot reads beside the row, in the row's own query: the
    newest checkpoint's sequence and whether an input request is open (its rows are read
    only then). A snapshot read is one query instead of three; with prefetch_inputs (a
    list) the open requests of a whole page come in one more query, not one per task."""
    from checkpoints_app.models import Checkpoint
    from steering_app.models import InputRequest, InputStatus

    tasks = tasks.annotate(
        snapshot_last_checkpoint=Subquery(_last_checkpoint(Checkpoint.objects.filter(task_id=OuterRef("id")))[:1]),
        snapshot_inputs_open=Exists(InputRequest.objects.filter(task_id=OuterRef("id"), status=InputStatus.OPEN)),
    )
    if prefetch_inputs:
        tasks = tasks.prefetch_related(
            Prefetch(
                "input_requests",
                to_attr="snapshot_open_inputs",
                queryset=(InputRequest.objects.filter(status=InputStatus.OPEN).order_by("id")),
            )
        )
    return tasks


def _last_checkpoint(checkpoints: QuerySet[Any]) -> QuerySet[Any]:
    return checkpoints.filter(discarded=False).order_by("-sequence", "-id").values_list("sequence", flat=True)


# The Task fields task_snapshot() reads, with event_seq and tenant for a stream's start: what
# a read that builds only a snapshot loads (tasks_app/api/lean.py). A test fails when
# task_snapshot() reads one more.
SNAPSHOT_FIELDS = [
    "id",
    "agent",
    "status",
    "status_message",
    "progress",
    "phase",
    "state_version",
    "plan_version",
    "steps_done",
    "cost",
    "recoveries",
    "recoveries_in_a_row",
    "infra_faults",
    "priority",
    "cancel_requested",
    "error",
    "goal",
    "constraints",
    "event_seq",
    "tenant",
    "created_at",
    "updated_at",
    "expires_at",
]


UNREAD: Any = object()  # task_snapshot's knowns not given: read them


def task_snapshot(task: Task, *, last_checkpoint: int | None = UNREAD, no_open_inputs: bool = False) -> dict[str, Any]:
    """`last_checkpoint` (the newest checkpoint's sequence, None: none) and `no_open_inputs`
    (True: the task has no open input request): what the caller knows already, not read."""
    from checkpoints_app.models import Checkpoint
    from steering_app.models import InputRequest, InputStatus

    if last_checkpoint is not UNREAD:
        last = last_checkpoint
    elif hasattr(task, "snapshot_last_checkpoint"):  # read by with_snapshot()
        last = task.snapshot_last_checkpoint
    else:
        last = _last_checkpoint(Checkpoint.objects.filter(task_id=task.id)).first()
    inputs: Any
    if no_open_inputs:
        inputs = []
    elif hasattr(task, "snapshot_open_inputs"):
        inputs = task.snapshot_open_inputs
    elif getattr(task, "snapshot_inputs_open", True):
        inputs = InputRequest.objects.filter(task_id=task.id, status=InputStatus.OPEN).order_by("id")
    else:
        inputs = []
    return {
        "taskId": str(task.id),
        "agent": task.agent,
        "status": task.mcp_status,
        "runtimeStatus": task.status,
        "statusMessage": task.status_text(),
        "progress": round(task.progress, 4),
        "phase": task.phase,
        "stateVersion": task.state_version,
        "planVersion": task.plan_version,
        "stepsDone": task.steps_done,
        "cost": task.cost,
        "lastCheckpoint": last,
        "recoveries": task.recoveries,
        "recoveriesInARow": task.recoveries_in_a_row,  # what runtime.max_recoveries caps
        "infrastructureFaults": task.infra_faults,
        "priority": task.priority,
        "cancelRequested": task.cancel_requested,
        "error": task.error,
        "goal": task.goal,
        "constraints": task.constraints,
        "inputRequests": [{"key": r.key, "prompt": r.prompt, "schema": r.answer_schema} for r in inputs],
        "createdAt": task.created_at.isoformat() if task.created_at else None,
        "updatedAt": task.updated_at.isoformat() if task.updated_at else None,
        "expiresAt": task.expires_at.isoformat() if task.expires_at else None,
        **task_urls(task),
    }
