"""Celery wrappers only: all logic is in the engine and the leases module."""

from __future__ import annotations

import logging
from uuid import UUID

from celery import shared_task
from django.conf import settings

from tasks_app import engine, leases, recovery, retention
from tasks_app.models import Task
from tasks_app.queue import enqueue_slice

logger = logging.getLogger(__name__)


@shared_task(name="tasks.run_task_slice", acks_late=True, ignore_result=True)
def run_task_slice(task_id: str) -> None:
    outcome = engine.run_slice(UUID(task_id), worker_id=engine.worker_identity())
    if outcome in (engine.SliceOutcome.CONTINUE, engine.SliceOutcome.POLL):
        # After the slice's last commit, never before: no pre-built chains (DESIGN §4).
        # Waiting on a remote task, the next look is a poll interval away (if that
        # message is lost, the lease scanner finds the task stalled and re-enqueues it).
        priority = Task.objects.values_list("priority", flat=True).get(id=task_id)
        delay = settings.RUNTIME["tools"]["remote_poll_seconds"] if outcome is engine.SliceOutcome.POLL else 0
        enqueue_slice(task_id, priority, countdown=delay)
    if outcome in (engine.SliceOutcome.CONTINUE, engine.SliceOutcome.POLL, engine.SliceOutcome.DONE):
        # Turns of a capacity-limited tenant may be free: ring the tasks it turned away
        # (should a ring be lost, the lease scanner re-finds them after stall_seconds).
        for waiting, waiting_priority in leases.next_waiting(UUID(task_id)):
            enqueue_slice(waiting, waiting_priority)


@shared_task(name="tasks.scan_leases", ignore_result=True)
def scan_leases() -> None:
    """Beat job: the broker may lose messages; the database never forgets running work."""
    for task_id in recovery.expired_lease_ids():
        if task := recovery.do_mark_recovering(task_id, actor="system:reaper"):
            logger.warning("task %s: worker lost, now %s (recoveries %s)", task_id, task.status, task.recoveries)
    for task_id, priority in leases.stalled(stall_seconds=settings.RUNTIME_STALL_SECONDS,
                                            recovering_seconds=settings.RUNTIME_LEASE_SECONDS):
        logger.info("task %s: no lease and no progress, re-enqueued (message lost)", task_id)
        enqueue_slice(task_id, priority)
    for task_id in recovery.expired_ttl_ids():
        recovery.do_expire_task(task_id, actor="system:reaper")


@shared_task(name="tasks.trim", ignore_result=True)
def trim() -> None:
    """Beat job: retention of events and checkpoints (tasks_app/retention.py)."""
    events, checkpoints = retention.trim_events(), retention.trim_checkpoints()
    if events or checkpoints:
        logger.info("retention: trimmed %s events and %s checkpoints", events, checkpoints)
