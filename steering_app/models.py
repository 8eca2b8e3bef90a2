from __future__ import annotations

import re

from django.db import models

from tasks_app.agents.questions import APPROVER_KINDS, QuestionKind
from tasks_app.models import Task, Tenant


class CommandType(models.TextChoices):
    PAUSE = "pause"
    RESUME = "resume"
    CANCEL = "cancel"
    ADJUST_GOAL = "adjust_goal"
    PROVIDE_INPUT = "provide_input"
    SET_PRIORITY = "set_priority"
    KILL = "kill"  # the emergency stop: aborts the running step (tasks_app.kills)


# A command id's shape, on every edge (REST, MCP, the dashboard, the admin): what
# steering_app.actions accepts. \Z: "$" would let a trailing newline in.
COMMAND_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,64}\Z")
COMMAND_ID_SHAPE = "1 to 64 of the characters A-Z a-z 0-9 . _ : -"


class CommandStatus(models.TextChoices):
    PENDING = "pending"
    APPLIED = "applied"
    REJECTED = "rejected"


class SteeringCommand(models.Model):
    """A person's instruction to a running task, applied at its next safe point (DESIGN §5)."""

    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT)
    task = models.ForeignKey(Task, on_delete=models.CASCADE, related_name="steering_commands")
    command_id = models.CharField(max_length=64)  # the client's; makes retries idempotent
    type = models.CharField(max_length=20, choices=CommandType.choices)
    payload = models.JSONField(default=dict)
    reason = models.CharField(max_length=500, blank=True)
    expected_version = models.BigIntegerField()
    version = models.BigIntegerField()  # the task's state_version once accepted: the apply order
    requested_by = models.CharField(max_length=200)
    status = models.CharField(max_length=10, choices=CommandStatus.choices, default=CommandStatus.PENDING)
    outcome = models.CharField(max_length=500, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    applied_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["task", "command_id"], name="steering_command_id_per_task"),
            models.UniqueConstraint(fields=["task", "version"], name="steering_version_per_task"),
        ]
        # apply_pending(): a task's pending commands in accepted order.
        indexes = [models.Index(fields=["task", "status", "version"], name="steering_pending")]


class InputStatus(models.TextChoices):
    OPEN = "open"
    ANSWERED = "answered"
    WITHDRAWN = "withdrawn"  # its task ended unanswered (tasks_app.actions.transition): nobody can answer it


class InputRequest(models.Model):
    """What an input_required task waits for. The key is stable and never reused (it is
    also the MCP inputRequests key)."""

    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT)
    task = models.ForeignKey(Task, on_delete=models.CASCADE, related_name="input_requests")
    key = models.CharField(max_length=200)
    # What the answer is for (tasks_app.agents.questions): an agent's question, or the
    # runtime's approval, confirmation or budget extension. Approvals and budget extensions
    # need the approver role (tasks_app.access.answer_refusal).
    kind = models.CharField(max_length=20, choices=QuestionKind.choices, default=QuestionKind.QUESTION)
    prompt = models.TextField()
    answer_schema = models.JSONField(default=dict)
    step_sequence = models.IntegerField()  # the step that asked
    status = models.CharField(max_length=10, choices=InputStatus.choices, default=InputStatus.OPEN)
    answer = models.JSONField(null=True, blank=True)
    answered_by = models.CharField(max_length=200, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    answered_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["task", "key"], name="input_key_per_task")]

    @property
    def needs_approver(self) -> bool:
        return self.kind in APPROVER_KINDS
