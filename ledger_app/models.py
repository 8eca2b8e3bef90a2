from __future__ import annotations

from django.db import models

from tasks_app.models import Task, Tenant


class EffectStatus(models.TextChoices):
    STARTED = "started"  # committed before the call; after a crash "unknown" (unless Tool.side_effect is False)
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    UNKNOWN = "unknown"  # a previous run may or may not have made the call; never re-run blindly
    PENDING = "pending"  # the remote took the call as a task (remote_ref): poll it, never call again


class LedgerEntry(models.Model):
    """One external side effect (DESIGN §6). The key is sent to the remote as its
    idempotency key."""

    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT)
    task = models.ForeignKey(Task, on_delete=models.CASCADE, related_name="ledger_entries")
    step_sequence = models.IntegerField()
    call_index = models.IntegerField()
    key = models.CharField(max_length=200, unique=True)  # "<task>:<step>:<call index>"
    tool = models.CharField(max_length=100)
    fingerprint = models.CharField(max_length=64)  # of the arguments: a re-run must ask the same
    status = models.CharField(max_length=10, choices=EffectStatus.choices)
    attempts = models.IntegerField(default=0)
    durations_ms = models.JSONField(default=list)
    result = models.JSONField(null=True, blank=True)
    error = models.JSONField(null=True, blank=True)
    remote_ref = models.CharField(max_length=500, blank=True)  # the remote's task id while pending
    lease_epoch = models.BigIntegerField()
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        # settle_interrupted(): a task's entries left started by a lost worker.
        indexes = [models.Index(fields=["task", "status"], name="ledger_task_status")]
