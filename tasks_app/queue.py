"""Ringing the doorbell: a Celery message says only "task X may have work".

Sent by the task's stable name, not through the task object: tasks_app.tasks imports the
engine, which rings this doorbell, so importing it here would close a cycle.
"""

from __future__ import annotations

import logging
import time
from uuid import UUID

from celery import current_app
from django.db import transaction

from runtime_site.metrics import READY_AT_HEADER

logger = logging.getLogger(__name__)

SLICE_TASK = "tasks.run_task_slice"  # tasks_app.tasks.run_task_slice

# What a task was created with that labels its slices' spans and log lines (agent, tenant
# slug, traceparent: tasks_app.telemetry.slice_of), carried by the message when the sender
# has it at hand, so the worker need not read it before the claim: the create's message,
# on the path of submit -> first step. A message without it (from a sender that has not
# got it, or from a release before) makes the worker read it.
ABOUT_HEADER = "rt_about"
About = tuple[str, str, str]

# The lease a slice abandoned to an infrastructure fault and could not give back (the
# database was out of reach): [worker id, epoch], carried by the retries it sends, so the
# worker that runs one gives that lease back for it, counted as the infrastructure fault it
# was (operators.do_give_back). Without it the lease was left to expire and the reaper
# counted a lost worker: every blip that cut a give-back cost a recovery. A header, so a
# worker of a release before reads the message as it always did.
ABANDONED_HEADER = "rt_abandoned"


def enqueue_slice(
    task_id: UUID | str,
    priority: int | None,
    *,
    countdown: float = 0,
    faults_in_a_row: int = 0,
    about: About | None = None,
    abandoned: tuple[str, int] | None = None,
) -> None:
    # faults_in_a_row: infrastructure faults just before this slice; its backoff grows with them.
    kwargs = {"faults_in_a_row": faults_in_a_row} if faults_in_a_row else None
    # When the message is due: the queue's age and the slice's start latency are measured from it.
    headers: dict[str, object] = {READY_AT_HEADER: time.time() + countdown}
    if about is not None:
        headers[ABOUT_HEADER] = list(about)
    if abandoned is not None:
        headers[ABANDONED_HEADER] = list(abandoned)
    # ignore_result as run_task_slice declares it (apply_async would pass it on the same way).
    current_app.send_task(
        SLICE_TASK,
        args=[str(task_id)],
        kwargs=kwargs,
        priority=priority,
        countdown=countdown or None,
        headers=headers,
        ignore_result=True,
    )


def enqueue_slice_on_commit(task_id: UUID, priority: int, *, about: About | None = None) -> None:
    # robust: a broker outage must not turn a committed change into a 500. The lease
    # scanner re-finds the task once it has stalled (the database never forgets work).
    transaction.on_commit(lambda: enqueue_slice(task_id, priority, about=about), robust=True)


def carried_about(header: object) -> About | None:
    """What a message's ABOUT_HEADER carried, or None: none, or not three texts."""
    if isinstance(header, list | tuple) and len(header) == 3 and all(isinstance(item, str) for item in header):
        return (header[0], header[1], header[2])
    return None


def carried_abandoned(header: object) -> tuple[str, int] | None:
    """What a message's ABANDONED_HEADER carried, or None: none, or not a worker id and an epoch."""
    if (
        isinstance(header, list | tuple)
        and len(header) == 2
        and isinstance(header[0], str)
        and isinstance(header[1], int)
        and not isinstance(header[1], bool)
    ):
        return (header[0], header[1])
    return None
