"""Retention (beat): what the database no longer needs to keep (DESIGN §4, beat job d).

- Events: a stream client that reconnects after `stream.retention_seconds` re-reads the
  snapshot instead of replaying (docs/streaming.md: a gap means "re-read the snapshot").
  So progress events older than that are dropped (the snapshot supersedes them), and so
  are all events of tasks that ended longer ago than that. Logs of live tasks stay.
- Checkpoints: the newest `checkpoint.keep` of each task stay (recovery needs the newest
  good one, an operator's redrive the newest that verifies); older ones go.
Steps, ledger entries and the audit chain are never trimmed here.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db.models import F, QuerySet, Window
from django.db.models.functions import RowNumber
from django.utils import timezone

from checkpoints_app.models import Checkpoint
from tasks_app.models import TaskEvent
from tasks_app.states import TERMINAL

BATCH = 5000  # rows per statement: short transactions beside running work


def trim_events(*, retention_seconds: float | None = None) -> int:
    retention = settings.RUNTIME["stream"]["retention_seconds"] if retention_seconds is None else retention_seconds
    cutoff = timezone.now() - timedelta(seconds=retention)
    stale = TaskEvent.objects.filter(
        task__status__in=TERMINAL, task__finished_at__lt=cutoff
    ) | TaskEvent.objects.filter(type="progress", created_at__lt=cutoff)
    return _delete_in_batches(TaskEvent, stale.values_list("id", flat=True))


def trim_checkpoints(*, keep: int | None = None) -> int:
    keep = settings.RUNTIME["checkpoint"]["keep"] if keep is None else keep
    ranked = Checkpoint.objects.annotate(
        rank=Window(RowNumber(), partition_by=[F("task_id")], order_by=[F("sequence").desc(), F("id").desc()])
    )
    return _delete_in_batches(Checkpoint, ranked.filter(rank__gt=keep).values_list("id", flat=True))


def _delete_in_batches(model: type[TaskEvent] | type[Checkpoint], ids_query: QuerySet[Any, Any]) -> int:
    total = 0
    while ids := list(ids_query[:BATCH]):
        total += model.objects.filter(id__in=ids).delete()[0]
        if len(ids) < BATCH:
            break
    return total
