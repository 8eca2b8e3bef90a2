from __future__ import annotations

from typing import Any

from django.db import transaction

from checkpoints_app import codec
from checkpoints_app.models import Checkpoint
from tasks_app.models import Task


def _fields(cp: Checkpoint) -> dict[str, Any]:
    """What the checksum covers: everything recovery relies on."""
    return {
        "task": str(cp.task_id),
        "sequence": cp.sequence,
        "step_name": cp.step_name,
        "schema_version": cp.schema_version,
        "plan_version": cp.plan_version,
        "next_step": cp.next_step,
        "state": cp.state,
        "artifact_refs": cp.artifact_refs,
        "steering_cursor": cp.steering_cursor,
    }


def record_checkpoint(
    task: Task,
    *,
    sequence: int,
    step_name: str,
    next_step: str,
    state: dict[str, Any],
    artifact_refs: list[str],
    reason: str,
    plan_version: int,
    steering_cursor: int = 0,
) -> Checkpoint:
    """In-transaction helper: the caller's (fenced) transaction commits it with the step."""
    assert transaction.get_connection().in_atomic_block, "record_checkpoint needs the caller's transaction"
    cp = new_checkpoint(
        task,
        sequence=sequence,
        step_name=step_name,
        next_step=next_step,
        state=state,
        artifact_refs=artifact_refs,
        reason=reason,
        plan_version=plan_version,
        steering_cursor=steering_cursor,
    )
    cp.save()
    return cp


def new_checkpoint(
    task: Task,
    *,
    sequence: int,
    step_name: str,
    next_step: str,
    state: dict[str, Any],
    artifact_refs: list[str],
    reason: str,
    plan_version: int,
    steering_cursor: int = 0,
) -> Checkpoint:
    """The checkpoint record_checkpoint saves, with its checksum, not saved: for a write
    that inserts it in a statement of its own (tasks_app.leases.fenced_write)."""
    cp = Checkpoint(
        tenant_id=task.tenant_id,
        task=task,
        sequence=sequence,
        step_name=step_name,
        schema_version=codec.CURRENT_SCHEMA_VERSION,
        plan_version=plan_version,
        next_step=next_step,
        state=state,
        artifact_refs=artifact_refs,
        steering_cursor=steering_cursor,
        reason=reason,
    )
    cp.checksum = codec.checksum(_fields(cp))
    return cp


def latest_checkpoint(task: Task) -> Checkpoint | None:
    return Checkpoint.objects.filter(task=task, discarded=False).order_by("-sequence", "-id").first()


def load_state(cp: Checkpoint, *, agent: str) -> dict[str, Any]:
    """Verified, upgraded state of a checkpoint; raises codec.CheckpointCorrupt."""
    return codec.verify_and_upgrade(_fields(cp), cp.checksum, agent=agent)


def discard_back_to_last_good(task: Task) -> tuple[Checkpoint | None, list[int]]:
    """In-transaction helper for a redrive: mark every checkpoint newer than the newest one
    that verifies as discarded. Returns (that good checkpoint or None, discarded sequences)."""
    assert transaction.get_connection().in_atomic_block, "discard inside the redrive's transaction"
    discarded: list[int] = []
    for cp in Checkpoint.objects.filter(task=task, discarded=False).order_by("-sequence", "-id"):
        if is_valid(cp, agent=task.agent):
            return cp, discarded
        discarded.append(cp.sequence)
        Checkpoint.objects.filter(id=cp.id).update(discarded=True)
    return None, discarded


def is_valid(cp: Checkpoint, *, agent: str) -> bool:
    try:
        load_state(cp, agent=agent)
    except codec.CheckpointCorrupt:
        return False
    return True
