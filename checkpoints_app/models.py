from __future__ import annotations

from django.db import models

from tasks_app.models import Task, Tenant


class Checkpoint(models.Model):
    """Rebuildable business state at a step boundary (the brief's §8), never a process image."""

    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT)
    task = models.ForeignKey(Task, on_delete=models.CASCADE, related_name="checkpoints")
    sequence = models.IntegerField()  # the step sequence this state is *after*
    step_name = models.CharField(max_length=200)  # the last step it includes
    schema_version = models.IntegerField()
    plan_version = models.IntegerField()
    next_step = models.CharField(max_length=200, blank=True)  # "" when the plan is done
    state = models.JSONField()
    artifact_refs = models.JSONField(default=list)
    steering_cursor = models.BigIntegerField(default=0)
    reason = models.CharField(max_length=30)  # every_steps, interval, slice_end, terminal, ...
    checksum = models.CharField(max_length=64)
    # Set by an operator's redrive on checkpoints newer than the last good one: never loaded again.
    discarded = models.BooleanField(default=False)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        # latest_checkpoint(): the newest checkpoint of one task. Not unique on sequence: a
        # pause with no step since the last checkpoint records a second one at the same step.
        indexes = [models.Index(fields=["task", "-sequence", "-id"], name="checkpoint_latest")]
        ordering = ["task", "sequence", "id"]
