"""Hash-chained audit records, one chain per task (DESIGN §3).

Each record's hash covers its fields and the previous record's hash; the task row holds
the head. Rewriting, deleting or reordering any record breaks the chain at that point.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.db import transaction
from django.utils import timezone

from common.canonical import canonical_json, sha256_hex
from tasks_app.models import AuditRecord, Task
from tasks_app.redaction import redact

GENESIS = "0" * 64


def _hash(record: AuditRecord) -> str:
    return sha256_hex(canonical_json(record.chained_fields()))


def record_audit(
    task: Task, *, actor: str, action: str, before_version: int, from_status: str = "",
    to_status: str = "", reason: str = "", data: dict[str, Any] | None = None,
) -> AuditRecord:
    """In-transaction helper. The caller holds the task row (lock or fence) and saves nothing
    of the chain itself: this updates task.audit_seq/audit_head in the same transaction."""
    assert transaction.get_connection().in_atomic_block, "audit inside the change's transaction"
    record = AuditRecord(
        tenant_id=task.tenant_id, task=task, seq=task.audit_seq + 1, actor=actor, action=action,
        from_status=from_status, to_status=to_status, before_version=before_version,
        after_version=task.state_version, reason=redact(reason)[:1000], data=redact(data or {}),
        created_at=timezone.now(), prev_hash=task.audit_head or GENESIS,
    )
    record.hash = _hash(record)
    record.save()
    task.audit_seq, task.audit_head = record.seq, record.hash
    Task.objects.filter(id=task.id).update(audit_seq=record.seq, audit_head=record.hash)
    return record


@dataclass(frozen=True)
class BrokenLink:
    task_id: str
    seq: int | None
    problem: str

    def __str__(self) -> str:
        where = f"record {self.seq}" if self.seq is not None else "head"
        return f"task {self.task_id}: {where}: {self.problem}"


def verify_chain(task: Task) -> BrokenLink | None:
    """The first broken link of one task's chain, or None when it verifies."""
    prev, expected_seq = GENESIS, 1
    for record in AuditRecord.objects.filter(task=task).order_by("seq").iterator():
        if record.seq != expected_seq:
            return BrokenLink(str(task.id), expected_seq, f"missing (found {record.seq} next)")
        if record.prev_hash != prev:
            return BrokenLink(str(task.id), record.seq, "prev_hash does not match the previous record")
        if _hash(record) != record.hash:
            return BrokenLink(str(task.id), record.seq, "content does not match its hash (edited)")
        prev, expected_seq = record.hash, expected_seq + 1
    if task.audit_head != (prev if prev != GENESIS else ""):
        return BrokenLink(str(task.id), None, "task's audit head does not match the last record")
    return None
