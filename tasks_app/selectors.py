"""Reads. The snapshot comes from one function, so REST, MCP and events never drift."""

from __future__ import annotations

from typing import Any

from tasks_app.models import Task


def task_urls(task: Task) -> dict[str, str]:
    base = f"/runtime/tasks/{task.id}"
    return {"statusUrl": base, "streamUrl": f"{base}/events", "resultUrl": f"{base}/result",
            "artifactsUrl": f"{base}/artifacts"}


def task_snapshot(task: Task) -> dict[str, Any]:
    from checkpoints_app.models import Checkpoint
    from steering_app.models import InputRequest, InputStatus

    last = Checkpoint.objects.filter(task_id=task.id, discarded=False).order_by("-sequence", "-id").values_list(
        "sequence", flat=True).first()
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
        "infrastructureFaults": task.infra_faults,
        "priority": task.priority,
        "cancelRequested": task.cancel_requested,
        "error": task.error,
        "goal": task.goal,
        "constraints": task.constraints,
        "inputRequests": [
            {"key": r.key, "prompt": r.prompt, "schema": r.answer_schema}
            for r in InputRequest.objects.filter(task_id=task.id, status=InputStatus.OPEN).order_by("id")
        ],
        "createdAt": task.created_at.isoformat() if task.created_at else None,
        "updatedAt": task.updated_at.isoformat() if task.updated_at else None,
        "expiresAt": task.expires_at.isoformat() if task.expires_at else None,
        **task_urls(task),
    }
