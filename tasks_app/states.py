"""The task state machine: data plus one function (DESIGN §3)."""

from __future__ import annotations

from django.db import models


class Status(models.TextChoices):
    QUEUED = "queued"
    WORKING = "working"
    PAUSING = "pausing"
    PAUSED = "paused"
    INPUT_REQUIRED = "input_required"
    RECOVERING = "recovering"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    DEAD_LETTERED = "dead_lettered"


# Terminal: nothing ever changes afterwards. dead_lettered is *held* for an operator,
# who may redrive it from its last good checkpoint or close it, so it is not terminal.
TERMINAL = frozenset({Status.COMPLETED, Status.FAILED, Status.CANCELLED})

# A worker may claim a task in these states (queued → working happens at the first claim;
# pausing → paused needs a worker to reach a safe point and checkpoint).
CLAIMABLE = frozenset({Status.QUEUED, Status.WORKING, Status.RECOVERING, Status.PAUSING})

# Read it as: "from X you may go to any of ...". Anything else is a bug or a stale request.
ALLOWED_TRANSITIONS: dict[str, frozenset[str]] = {
    Status.QUEUED: frozenset(
        {Status.WORKING, Status.RECOVERING, Status.PAUSED, Status.CANCELLED, Status.FAILED, Status.DEAD_LETTERED}
    ),
    Status.WORKING: frozenset(
        {
            Status.INPUT_REQUIRED,
            Status.PAUSING,
            Status.PAUSED,
            Status.RECOVERING,
            Status.COMPLETED,
            Status.FAILED,
            Status.CANCELLED,
            Status.DEAD_LETTERED,
        }
    ),
    # A pausing task may reach an approval point first: the pause then lands there.
    Status.PAUSING: frozenset(
        {
            Status.PAUSED,
            Status.WORKING,
            Status.INPUT_REQUIRED,
            Status.RECOVERING,
            Status.CANCELLED,
            Status.FAILED,
            Status.DEAD_LETTERED,
        }
    ),
    Status.PAUSED: frozenset({Status.WORKING, Status.INPUT_REQUIRED, Status.CANCELLED, Status.FAILED}),
    Status.INPUT_REQUIRED: frozenset({Status.WORKING, Status.PAUSED, Status.CANCELLED, Status.FAILED}),
    Status.RECOVERING: frozenset(
        {Status.WORKING, Status.PAUSED, Status.DEAD_LETTERED, Status.CANCELLED, Status.FAILED}
    ),
    Status.DEAD_LETTERED: frozenset({Status.RECOVERING, Status.FAILED, Status.CANCELLED}),  # redrive / close
    # The one way back from a terminal status: an operator redrives a task killed by mistake
    # (operators.do_redrive_task allows it for killed tasks only).
    Status.CANCELLED: frozenset({Status.RECOVERING}),
}

# MCP knows five statuses, and a terminal one may never change afterwards; everything
# that is still in motion (or can be redriven) shows as "working" with a status message.
MCP_STATUS: dict[str, str] = {
    Status.QUEUED: "working",
    Status.WORKING: "working",
    Status.PAUSING: "working",
    Status.PAUSED: "working",
    Status.RECOVERING: "working",
    Status.DEAD_LETTERED: "working",
    Status.INPUT_REQUIRED: "input_required",
    Status.COMPLETED: "completed",
    Status.FAILED: "failed",
    Status.CANCELLED: "cancelled",
}


def can_transition(from_status: str, to_status: str) -> bool:
    return to_status in ALLOWED_TRANSITIONS.get(from_status, frozenset())


def to_mcp_status(status: str) -> str:
    return MCP_STATUS[status]
