"""Celery wrappers only: all logic is in the engine and the leases module."""

from __future__ import annotations

import logging
from typing import Any
from uuid import UUID

from celery import shared_task
from django.conf import settings

from runtime_site import metrics
from tasks_app import audit, engine, faults, leases, operators, retention, telemetry
from tasks_app.models import Task
from tasks_app.queue import ABANDONED_HEADER, ABOUT_HEADER, carried_abandoned, carried_about, enqueue_slice

logger = logging.getLogger(__name__)


@shared_task(name="tasks.run_task_slice", acks_late=True, ignore_result=True, bind=True)
def run_task_slice(self: Any, task_id: str, faults_in_a_row: int = 0) -> None:
    metrics.observe_slice_start(self.request.get(metrics.READY_AT_HEADER))
    # A lease a slice before could not give back (queue.ABANDONED_HEADER): carried on by
    # every retry until one gives it back.
    abandoned = carried_abandoned(self.request.get(ABANDONED_HEADER))
    try:
        with telemetry.slice_of(task_id, carried_about(self.request.get(ABOUT_HEADER))) as span:
            lease = leases.Lease(UUID(task_id), *abandoned) if abandoned else None
            report = engine.run_slice_report(UUID(task_id), worker_id=engine.worker_identity(), abandoned=lease)
            abandoned = None  # given back, or found gone, before the claim
            span.set_attribute("runtime.slice.outcome", report.outcome.value)
            metrics.SLICES.labels(report.outcome.value).inc()
            if report.outcome is engine.SliceOutcome.RETRY:
                left = report.abandoned
                _retry_later(task_id, faults_in_a_row + 1, (left.worker_id, left.epoch) if left else None)
            else:
                _hand_on(task_id, report)  # in the slice's span: the next slice stays in the task's trace
    except Exception as exc:
        if not faults.is_infrastructure_error(exc):
            raise
        # Outside the slice's lease (the claim, or handing on after it): nothing to give back.
        logger.warning("task %s: infrastructure fault around the slice: %s: %s", task_id, type(exc).__name__, exc)
        faults.drop_connection()
        _retry_later(task_id, faults_in_a_row + 1, abandoned)


def _retry_later(task_id: str, faults_in_a_row: int, abandoned: tuple[str, int] | None = None) -> None:
    """Infrastructure faults delay a task, never fail it: ring again after a backoff that
    grows with each fault in a row. If the broker is what failed, the lease scanner
    re-finds the task (the database never forgets running work)."""
    priority = (run_task_slice.request.delivery_info or {}).get("priority")  # no database read: it may be down
    try:
        enqueue_slice(
            task_id,
            priority,
            countdown=faults.backoff(faults_in_a_row),
            faults_in_a_row=faults_in_a_row,
            abandoned=abandoned,
        )
    except Exception as exc:
        if not faults.is_infrastructure_error(exc):
            raise
        logger.warning("task %s: cannot re-enqueue (%s); the lease scanner will find it", task_id, exc)


def _hand_on(task_id: str, report: engine.SliceReport) -> None:
    outcome = report.outcome
    if outcome in (engine.SliceOutcome.CONTINUE, engine.SliceOutcome.POLL):
        # After the slice's last commit, never before: no pre-built chains (DESIGN §4).
        # Waiting on a remote task, the next look is a poll interval away (if that
        # message is lost, the lease scanner finds the task stalled and re-enqueues it).
        priority = report.priority
        if priority is None:  # not read back by the slice's last commit
            priority = Task.objects.values_list("priority", flat=True).get(id=task_id)
        delay = settings.RUNTIME["tools"]["remote_poll_seconds"] if outcome is engine.SliceOutcome.POLL else 0
        enqueue_slice(task_id, priority, countdown=delay)
    # Turns of a capacity-limited tenant may be free: ring the tasks it turned away (should a
    # ring be lost, the lease scanner re-finds them after stall_seconds). The tenant is known
    # to every slice that held its task.
    ended = (engine.SliceOutcome.CONTINUE, engine.SliceOutcome.POLL, engine.SliceOutcome.DONE)
    if outcome in ended and report.tenant_id is not None:
        leases.ring_waiting(report.tenant_id)


@shared_task(name="tasks.scan_leases", ignore_result=True)
def scan_leases() -> None:
    """Beat job: the broker may lose messages; the database never forgets running work."""
    for task_id in operators.expired_lease_ids():
        operators.do_mark_recovering(task_id, actor="system:reaper")  # logs what it found
    for task_id, priority in leases.stalled(
        stall_seconds=settings.RUNTIME_STALL_SECONDS, recovering_seconds=settings.RUNTIME_LEASE_SECONDS
    ):
        logger.info("task %s: no lease and no progress, re-enqueued (message lost)", task_id)
        enqueue_slice(task_id, priority)
    for task_id in operators.expired_ttl_ids():
        operators.do_expire_task(task_id, actor="system:reaper")


@shared_task(name="tasks.trim", ignore_result=True)
def trim() -> None:
    """Beat job: retention of events and checkpoints (tasks_app/retention.py)."""
    events, checkpoints = retention.trim_events(), retention.trim_checkpoints()
    if events or checkpoints:
        logger.info("retention: trimmed %s events and %s checkpoints", events, checkpoints)


@shared_task(name="tasks.anchor_audit", ignore_result=True)
def anchor_audit() -> None:
    """Beat job: sign the grown audit chains' heads and write them outside the database."""
    if key := audit.anchor_heads():
        logger.info("audit: heads anchored in %s", key)
