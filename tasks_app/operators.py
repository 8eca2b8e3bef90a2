"""Recovery and operator actions (DESIGN §4 beat jobs, the seed's §9).

The reaper (beat) and operators change tasks that no live worker holds. Each of these
actions moves the lease epoch, so a worker that lost its lease (killed, frozen, cut off)
fails its fence on its next write and can never commit again. An operator also settles
a ledger entry whose effect is unknown (do_resolve_unknown), after checking the remote.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any
from uuid import UUID

from django.conf import settings
from django.db import connection, transaction
from django.db.models.functions import Now

from checkpoints_app.actions import discard_back_to_last_good
from ledger_app.actions import ToolFailed, settle_interrupted
from ledger_app.models import EffectStatus, LedgerEntry
from runtime_site.metrics import RECOVERIES
from steering_app.actions import STEERING_FIELDS, apply_pending, do_enqueue_command, withdraw_cancel
from steering_app.models import CommandType, InputRequest, InputStatus
from tasks_app import events, leases
from tasks_app.access import check_role
from tasks_app.actions import TRANSITION_FIELDS, transition
from tasks_app.agents import tools
from tasks_app.agents.questions import confirmation_key
from tasks_app.audit import record_audit
from tasks_app.auth import Principal
from tasks_app.errors import CommandRefused, IllegalTransition, NoLease, VersionConflict
from tasks_app.models import Role, Task
from tasks_app.queue import enqueue_slice_on_commit
from tasks_app.states import CLAIMABLE, TERMINAL, Status

if TYPE_CHECKING:
    from tasks_app.leases import Lease

logger = logging.getLogger(__name__)


def expired_lease_ids(limit: int = 500) -> list[UUID]:
    return list(
        Task.objects.filter(status__in=CLAIMABLE, lease_owner__isnull=False, lease_expires_at__lt=Now())
        .order_by("lease_expires_at")
        .values_list("id", flat=True)[:limit]
    )


def expired_ttl_ids(limit: int = 500) -> list[UUID]:
    return list(
        Task.objects.filter(expires_at__lt=Now())
        .exclude(status__in=TERMINAL)
        .order_by("expires_at")
        .values_list("id", flat=True)[:limit]
    )


@transaction.atomic(durable=True)
def do_mark_recovering(task_id: UUID, *, actor: str, max_recoveries: int | None = None) -> Task | None:
    """A runnable task whose lease expired lost its worker: count a recovery and hand it to
    the next worker, or dead-letter it when it has crashed workers too often; a cancel
    asked for meanwhile ends it instead (_recover). A lease that expired across a restart
    of the database lost no worker: an infrastructure fault, logged as one. Each outcome
    logs its own diagnosis (the reaper only calls this)."""
    task = (
        Task.objects.select_for_update()
        .filter(id=task_id, status__in=CLAIMABLE, lease_owner__isnull=False, lease_expires_at__lt=Now())
        .first()
    )
    if task is None:
        return None  # renewed, released or already handled by another scan: nothing to do
    started = _database_started_at()
    if (
        started
        and task.lease_expires_at
        and task.lease_expires_at < started + timedelta(seconds=settings.RUNTIME_LEASE_SECONDS)
    ):
        # Last renewed before the database server (re)started: no holder, alive or not,
        # could renew it while the server was down. The restart is the fault, not the
        # worker: counted as an infrastructure fault, never a recovery, or every outage
        # longer than a lease cost each running task one of its max_recoveries (four
        # restarts dead-lettered healthy tasks).
        lost = task.lease_owner
        leases.take_away(task)
        diagnosis = f"the lease of {lost} expired across a restart of the database at {started.isoformat()}"
        if task.cancel_requested:  # cancel always wins: nobody needs to run it again to end it
            logger.warning("task %s: %s; the cancel asked for applies now", task_id, diagnosis)
            return _cancel_now(task, actor=actor)
        if count_infrastructure_fault(task, actor=actor, diagnosis=diagnosis, fields=list(Task.LEASE_FIELDS)):
            return task  # held for an operator (count_infrastructure_fault logged why)
        logger.warning(
            "task %s: %s: its worker may live (it is fenced out), an infrastructure fault, not a recovery; "
            "re-enqueued (infrastructure faults %s)",
            task_id,
            diagnosis,
            task.infra_faults,
        )
        enqueue_slice_on_commit(task.id, task.priority)
        return task
    lost = f"lease of {task.lease_owner} expired"
    leases.take_away(task)
    task = _recover(task, actor=actor, lost=lost, max_recoveries=max_recoveries)
    if task.status != Status.CANCELLED:
        status, recoveries, in_a_row = task.status, task.recoveries, task.recoveries_in_a_row

        def counted() -> None:
            RECOVERIES.labels(status).inc()
            logger.warning(
                "task %s: worker lost (%s), now %s (recoveries %s, %s in a row without progress)",
                task_id,
                lost,
                status,
                recoveries,
                in_a_row,
            )

        transaction.on_commit(counted)
    return task


@transaction.atomic(durable=True)
def do_give_back(lease: Lease, *, actor: str) -> Task | None:
    """For the slice that held `lease`, abandoned it to an infrastructure fault and could not
    give it back (engine._abandon: the database was out of reach): give it back now, live
    or expired, counted as the infrastructure fault it was. Its holder runs it no more (the
    slice ended), and the epoch names that slice alone, so nobody else is fenced out. Left
    to expire, the lease was the reaper's, or the next claimer's, to count as a lost worker:
    every blip that cut a give-back cost a recovery, four in a row dead-lettered a healthy
    task. None: given back, recovered or taken over meanwhile; nothing of that slice's."""
    task = (
        Task.objects.select_for_update()
        .filter(id=lease.task_id, status__in=CLAIMABLE, lease_epoch=lease.epoch, lease_owner=lease.worker_id)
        .first()
    )
    if task is None:
        return None
    diagnosis = f"{lease.worker_id} abandoned its slice to an infrastructure fault and could not give the lease back"
    if count_infrastructure_fault(task, actor=actor, diagnosis=diagnosis, fields=leases.take_away(task)):
        return task  # held for an operator (count_infrastructure_fault logged why)
    logger.warning("task %s: %s; given back for it (infrastructure faults %s)", task.id, diagnosis, task.infra_faults)
    return task


def _database_started_at() -> datetime | None:
    """When the PostgreSQL server last started (None elsewhere: SQLite has no server)."""
    if connection.vendor != "postgresql":
        return None
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_postmaster_start_time()")
        started: datetime = cursor.fetchone()[0]
    return started


def count_infrastructure_fault(task: Task, *, actor: str, diagnosis: str, fields: list[str]) -> bool:
    """On a locked row whose lease was just given back or dropped (`fields`, saved here):
    count an infrastructure fault, never a recovery, and audit it. After
    runtime.max_infra_faults in a row without a new step the task is held for an operator
    (dead-lettered with the diagnosis, which a redrive clears) instead of retried unseen
    for ever. True: held."""
    task.infra_faults += 1
    in_a_row = _faults_without_progress(task) + 1
    record_audit(
        task,
        actor=actor,
        action="infrastructure_fault",
        before_version=task.state_version,
        reason=diagnosis[:500],
        data={"infraFaults": task.infra_faults, "inARow": in_a_row, "stepsDone": task.steps_done},
    )
    fields = ["infra_faults", "updated_at", *fields]
    limit = settings.RUNTIME["runtime"]["max_infra_faults"]
    held = bool(limit) and in_a_row >= limit
    if held:
        reason = f"{in_a_row} infrastructure faults in a row without a new step; the last: {diagnosis}"
        logger.error("task %s: held for operator: %s", task.id, reason)
        task.error = {"code": "infrastructure_faults", "message": reason[:1000]}
        task.status_message = "held for operator: infrastructure faults without progress"
        transition(task, Status.DEAD_LETTERED, actor=actor, reason=reason[:500])
        fields += [*TRANSITION_FIELDS, "error"]
    task.save(update_fields=fields)
    return held


def _faults_without_progress(task: Task) -> int:
    """The infrastructure faults that ended the task's latest audit records, all at its
    current high-water mark: a new step raises it, and any other record (a redrive, a
    steering command) breaks the run. Read from the audit chain: no clock is compared."""
    limit = settings.RUNTIME["runtime"]["max_infra_faults"] or 1
    count = 0
    for action, data in task.audit_records.order_by("-seq").values_list("action", "data")[:limit]:
        if action != "infrastructure_fault" or data.get("stepsDone") != task.steps_done:
            break
        count += 1
    return count


@transaction.atomic(durable=True)
def do_abandon_step(lease: Lease, *, step: str, seconds: float) -> Task | None:
    """A step ran past its deadline (an agent's step_seconds, else runtime.step_seconds):
    its worker, still holding the lease, gives the task up as if it had crashed (the epoch
    moves; a recovery is counted, a dead letter past max_recoveries) and records which
    step overran which deadline. None: the lease was lost already; its holder decides."""
    task = (
        Task.objects.select_for_update()
        .filter(id=lease.task_id, lease_epoch=lease.epoch, lease_owner=lease.worker_id)
        .first()
    )
    if task is None:
        return None
    leases.take_away(task)
    return _recover(
        task,
        actor=f"worker:{lease.worker_id}",
        lost=f"step {step} ran past its deadline of {seconds:g}s on {lease.worker_id}",
        cause={"code": "step_deadline_exceeded", "step": step, "deadlineSeconds": seconds},
    )


def _recover(
    task: Task, *, actor: str, lost: str, max_recoveries: int | None = None, cause: dict[str, Any] | None = None
) -> Task:
    """On a locked row whose lease was just dropped: count the recovery and enqueue the
    next slice, or dead-letter it once it is the (max_recoveries + 1)th in a row without
    progress. `lost` says what happened, `cause` (audited, and kept in the dead letter's
    error) what an operator should look at."""
    if task.cancel_requested:
        # A cancel (or a kill, which waited for a call that had to finish: kills.must_finish)
        # was accepted while this worker held the task, for its next safe point. The worker
        # is lost, so it will never stop the task: cancel always wins, and applies now,
        # rather than after a recovery that re-runs the task (or dead-letters it) first.
        logger.warning("task %s: %s; the cancel asked for applies now", task.id, lost)
        return _cancel_now(task, actor=actor)
    max_recoveries = settings.RUNTIME["runtime"]["max_recoveries"] if max_recoveries is None else max_recoveries
    task.recoveries += 1
    # Progress: a step committed beyond the high-water mark of the last recovery. Re-running
    # the steps after an older checkpoint up to it is none, so a step that kills every worker
    # that runs it (a poison step) counts in a row however far back its checkpoint is; a long
    # task that loses a worker now and then, each time further on, starts again at one.
    progressed = task.steps_done > task.recovered_at_step
    task.recoveries_in_a_row = 1 if progressed else task.recoveries_in_a_row + 1
    task.recovered_at_step = task.steps_done
    fields = [*TRANSITION_FIELDS, *Task.LEASE_FIELDS, "recoveries", "recoveries_in_a_row", "recovered_at_step"]
    data: dict[str, Any] = {
        "recoveries": task.recoveries,
        "inARow": task.recoveries_in_a_row,
        "stepsDone": task.steps_done,
        **({"cause": cause} if cause else {}),
    }
    count = (
        f"recovery {task.recoveries}, {task.recoveries_in_a_row} in a row without progress"
        f" beyond step {task.steps_done}"
    )
    if task.recoveries_in_a_row > max_recoveries:
        reason = f"{lost}; {count} exceeds max_recoveries={max_recoveries}"
        task.status_message = "held for operator: too many recoveries without progress"
        task.error = {"code": "max_recoveries_exceeded", "message": reason, **({"cause": cause} if cause else {})}
        transition(task, Status.DEAD_LETTERED, actor=actor, reason=reason, data=data)
        fields.append("error")
    else:
        reason = f"{lost} ({count}, at most {max_recoveries})"
        if task.status == Status.RECOVERING:  # the recovering worker died too: no status change
            record_audit(
                task, actor=actor, action="recovery", before_version=task.state_version, reason=reason, data=data
            )
        else:
            transition(task, Status.RECOVERING, actor=actor, reason=reason, data=data)
        events.emit(
            task,
            "recovering",
            {"recoveries": task.recoveries, "recoveriesInARow": task.recoveries_in_a_row, "reason": reason},
        )
        enqueue_slice_on_commit(task.id, task.priority)
    task.save(update_fields=fields)
    return task


def _cancel_now(task: Task, *, actor: str) -> Task:
    """On a locked row whose lease was just dropped, with a cancel asked for: it ends now
    (commands pending before it apply first, in order). What the lost call left started is
    unknown, for the remote (by key) or a person to settle, as after a kill."""
    apply_pending(task, actor=actor, by_worker=False)
    # Every row up to the task's epoch: the row is locked and its lease dropped, so no
    # worker can start a call under a newer one.
    settle_interrupted(task.id, before_epoch=task.lease_epoch + 1)
    task.save(update_fields=STEERING_FIELDS)
    return task


@transaction.atomic(durable=True)
def do_expire_task(task_id: UUID, *, actor: str) -> Task | None:
    """Past its TTL or deadline: failed with the reason, whatever it was doing."""
    task = (
        Task.objects.select_for_update().filter(id=task_id, expires_at__lt=Now()).exclude(status__in=TERMINAL).first()
    )
    if task is None:
        return None
    leases.take_away(task)
    assert task.expires_at is not None  # the filter above
    reason = f"past its TTL/deadline ({task.expires_at.isoformat()})"
    task.error = {"code": "expired", "message": reason}
    transition(task, Status.FAILED, actor=actor, reason=reason)
    task.save(update_fields=[*TRANSITION_FIELDS, *Task.LEASE_FIELDS, "error"])
    return task


def _locked(task_id: UUID, who: Principal) -> Task:
    """The operator actions' task, locked, once `who` is allowed them (operator role)."""
    check_role(who, Role.OPERATOR)
    return Task.objects.select_for_update().for_tenant(who.tenant).get(id=task_id)


@transaction.atomic(durable=True)
def do_redrive_task(task_id: UUID, *, who: Principal, reason: str) -> Task:
    """Operator: run a dead-lettered task again from its last good checkpoint (or from the
    start when none verifies). Newer, failing checkpoints are discarded, never loaded.
    A killed task too, if the kill was a mistake (issue 18): its effects cut mid-call are
    unknown in the ledger and are reconciled before its step can call them again."""
    task = _locked(task_id, who)
    actor = who.actor
    killed = task.status == Status.CANCELLED and task.kill_requested
    if task.status != Status.DEAD_LETTERED and not killed:
        raise IllegalTransition(task.status, Status.RECOVERING)
    good, discarded = discard_back_to_last_good(task)
    leases.take_away(task)
    task.recoveries, task.recoveries_in_a_row, task.error, task.status_message = 0, 0, None, ""
    task.recovered_at_step = task.steps_done  # a recovery after the redrive counts from here
    withdrawn = withdraw_cancel(task, actor=actor)
    task.finished_at = None
    transition(
        task,
        Status.RECOVERING,
        actor=actor,
        reason=reason,
        data={"redriveFrom": good.sequence if good else None, "discardedCheckpoints": discarded},
    )
    task.save(
        update_fields=[
            *TRANSITION_FIELDS,
            *Task.LEASE_FIELDS,
            "recoveries",
            "recoveries_in_a_row",
            "recovered_at_step",
            "error",
            *withdrawn,
        ]
    )
    enqueue_slice_on_commit(task.id, task.priority)
    return task


@transaction.atomic(durable=True)
def do_close_task(task_id: UUID, *, who: Principal, reason: str) -> Task:
    """Operator: give up on a dead-lettered task; it becomes failed for good."""
    task = _locked(task_id, who)
    actor = who.actor
    if task.status != Status.DEAD_LETTERED:
        raise IllegalTransition(task.status, Status.FAILED)
    transition(task, Status.FAILED, actor=actor, reason=reason)
    task.save(update_fields=TRANSITION_FIELDS)
    return task


@transaction.atomic(durable=True)
def do_release_lease(task_id: UUID, *, who: Principal, reason: str) -> Task:
    """Operator: take a lease away from a worker believed gone, without waiting for it to
    expire. Safe even if the worker lives: the epoch moves, so its next write fails."""
    task = _locked(task_id, who)
    actor = who.actor
    if task.lease_owner is None:
        raise NoLease(task.id)
    owner = task.lease_owner
    leases.take_away(task)
    record_audit(
        task,
        actor=actor,
        action="lease_released",
        before_version=task.state_version,
        reason=reason,
        data={"owner": owner},
    )
    task.save(update_fields=[*Task.LEASE_FIELDS, "updated_at"])
    if task.status in CLAIMABLE:
        enqueue_slice_on_commit(task.id, task.priority)
    return task


def do_resolve_unknown(entry_id: int, *, succeeded: bool, who: Principal, reason: str) -> LedgerEntry:
    """Operator, after checking the remote by hand: an unknown effect did (or did not)
    happen. Audited on the task's chain; a task waiting for this confirmation then gets
    the answer as an ordinary provide_input command (accepted, audited, applied)."""
    check_role(who, Role.OPERATOR)
    actor = who.actor
    with transaction.atomic(durable=True):
        entry = LedgerEntry.objects.select_for_update().get(id=entry_id, task__tenant=who.tenant)
        if entry.status not in (EffectStatus.UNKNOWN, EffectStatus.STARTED):
            raise ToolFailed(f"ledger entry {entry.key} is {entry.status}, not unknown")
        task = Task.objects.select_for_update().get(id=entry.task_id)
        entry.status = EffectStatus.SUCCEEDED if succeeded else EffectStatus.FAILED
        if succeeded:
            entry.result = tools.ANSWER_LOST if entry.result is None else entry.result
        else:
            entry.error = {"message": f"{entry.tool}: did not take effect (resolved by {actor})", "retryable": False}
        entry.save(update_fields=["status", "result", "error", "updated_at"])
        record_audit(
            task,
            actor=actor,
            action="ledger_resolved",
            before_version=task.state_version,
            reason=reason,
            data={"key": entry.key, "status": entry.status},
        )
    key = confirmation_key(entry.key)
    if InputRequest.objects.filter(task=task, key=key, status=InputStatus.OPEN).exists():  # a reserved key
        try:
            do_enqueue_command(
                task.id,
                who=who,
                command_id=f"resolve-{entry.id}",
                type=CommandType.PROVIDE_INPUT,
                payload={"key": key, "answer": tools.DONE if succeeded else tools.NOT_DONE},
                expected_version=Task.objects.values_list("state_version", flat=True).get(id=task.id),
                reason=reason,
            )
        except (VersionConflict, CommandRefused) as exc:
            # The effect itself is resolved above; the request stays open for a person to answer.
            logger.warning("resolved %s, but could not answer %s for the task: %s", entry.key, key, exc)
    return entry
