"""Ringing the doorbell: a Celery message says only "task X may have work"."""

from __future__ import annotations

import logging
import time
from uuid import UUID

from django.db import transaction

logger = logging.getLogger(__name__)


def enqueue_slice(task_id: UUID | str, priority: int | None, *, countdown: float = 0,
                  faults_in_a_row: int = 0) -> None:
    from runtime_site.metrics import READY_AT_HEADER
    from tasks_app.tasks import run_task_slice  # tasks imports the engine, which imports us

    # faults_in_a_row: infrastructure faults just before this slice; its backoff grows with them.
    kwargs = {"faults_in_a_row": faults_in_a_row} if faults_in_a_row else None
    # When the message is due: the queue's age and the slice's start latency are measured from it.
    # celery-types wants priority and countdown set and headers of str; Celery takes None for unset, and any JSON.
    run_task_slice.apply_async(args=(str(task_id),), kwargs=kwargs,
                               priority=priority, countdown=countdown or None,  # type: ignore[arg-type]
                               headers={READY_AT_HEADER: time.time() + countdown})  # type: ignore[dict-item]


def enqueue_slice_on_commit(task_id: UUID, priority: int) -> None:
    # robust: a broker outage must not turn a committed change into a 500. The lease
    # scanner re-finds the task once it has stalled (the database never forgets work).
    transaction.on_commit(lambda: enqueue_slice(task_id, priority), robust=True)
