"""Steering (DESIGN §5): accept a command with a compare-and-set on the task's state_version,
apply it at the task's next safe point, never mid-step. Input requests live here too.

Accepting happens in the API's transaction. Applying happens there as well when nobody is
mid-step (the task is paused, waiting for input, or holds no live lease); otherwise the
engine applies pending commands, in accepted order, at its next safe point.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from typing import Any
from uuid import UUID

from django.db import transaction
from django.db.models import BooleanField, ExpressionWrapper, Q
from django.db.models.functions import Now
from django.utils import timezone

from common import json_safety
from common.schema import SchemaError, validate
from ledger_app.actions import settle_interrupted
from ledger_app.models import EffectStatus, LedgerEntry
from steering_app.models import (
    COMMAND_ID,
    COMMAND_ID_SHAPE,
    CommandStatus,
    CommandType,
    InputRequest,
    InputStatus,
    SteeringCommand,
)
from tasks_app import access, events, kills, leases
from tasks_app.access import answer_refusal, check_role
from tasks_app.actions import TRANSITION_FIELDS, transition
from tasks_app.agents import base as agents
from tasks_app.agents.questions import Answers
from tasks_app.audit import next_record
from tasks_app.auth import Principal
from tasks_app.errors import (
    AnswerConflict,
    CommandRefused,
    Forbidden,
    IllegalTransition,
    InvalidCommand,
    TaskNotFound,
    VersionConflict,
)
from tasks_app.models import Role, Task, Tenant
from tasks_app.queue import enqueue_slice_on_commit
from tasks_app.states import CLAIMABLE, TERMINAL, Status, can_transition


def _same_answer(a: Any, b: Any) -> bool:
    # As JSON, not as Python: True == 1 in Python, but an approval `true` is not the number 1.
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


_EMPTY = {"type": "object", "additionalProperties": False}
PAYLOAD_SCHEMAS: dict[str, dict[str, Any]] = {
    CommandType.PAUSE: _EMPTY,
    CommandType.RESUME: _EMPTY,
    CommandType.CANCEL: _EMPTY,
    CommandType.KILL: _EMPTY,  # the reason is the command's own, and required
    CommandType.ADJUST_GOAL: {
        "type": "object",
        "properties": {"goal": {"type": "string", "maxLength": 10_000}, "constraints": {"type": "object"}},
        "minProperties": 1,
        "additionalProperties": False,
    },
    CommandType.PROVIDE_INPUT: {
        "type": "object",
        "properties": {"key": {"type": "string", "minLength": 1, "maxLength": 200}, "answer": {}},
        "required": ["key", "answer"],
        "additionalProperties": False,
    },
    CommandType.SET_PRIORITY: {
        "type": "object",
        "properties": {"priority": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["priority"],
        "additionalProperties": False,
    },
}

# Everything apply_command may change on the task row.
STEERING_FIELDS = [*TRANSITION_FIELDS, *Task.CONTROL_FIELDS, *Task.LEASE_FIELDS]


def _validate(task: Task, type: str, payload: dict[str, Any], reason: str) -> None:
    if type == CommandType.KILL and not reason.strip():
        raise InvalidCommand("reason: a kill needs a reason (it is audited and shown on the task)")
    try:
        validate(payload, PAYLOAD_SCHEMAS[type], "payload")
    except SchemaError as exc:
        raise InvalidCommand(str(exc)) from None
    if type == CommandType.ADJUST_GOAL and "constraints" in payload:
        agent = agents.get_agent(task.agent)
        if agent.constraints_schema is None:
            raise InvalidCommand(f"agent {task.agent!r} cannot be re-aimed with constraints")
        try:
            validate(payload["constraints"], agent.constraints_schema, "payload constraints")
        except SchemaError as exc:
            raise InvalidCommand(str(exc)) from None
    if type == CommandType.PROVIDE_INPUT:
        # Under the task's row lock: of two answers racing, the second sees the first.
        standing = (
            SteeringCommand.objects.filter(
                task=task,
                type=CommandType.PROVIDE_INPUT,
                payload__key=payload["key"],
                status__in=[CommandStatus.PENDING, CommandStatus.APPLIED],
            )
            .order_by("id")
            .first()
        )
        if standing is not None:
            raise AnswerConflict(payload["key"], standing)
        request = InputRequest.objects.filter(task=task, key=payload["key"]).first()
        if request is None or request.status != InputStatus.OPEN:
            raise CommandRefused(f"no open input request {payload['key']!r} on this task")
        try:
            validate(payload["answer"], request.answer_schema, "payload answer")
        except SchemaError as exc:
            raise InvalidCommand(str(exc)) from None


def refusal(task: Task, type: str, *, applying: bool = False) -> str | None:
    """Why this command cannot be accepted (or, applying, apply) on the task as it is, or None."""
    if task.status in TERMINAL:
        return f"the task is {task.status}; it takes no more commands"
    if task.status == Status.DEAD_LETTERED and type not in (CommandType.CANCEL, CommandType.KILL):
        return "the task is held for an operator (dead-lettered); only cancel or kill applies"
    if type == CommandType.RESUME and task.status not in (Status.PAUSED, Status.PAUSING):
        return f"resume applies to a paused task; this one is {task.status}"
    # An accepted pause leaves the task "pausing" until it is applied.
    if type == CommandType.PAUSE and task.status in ((Status.PAUSED,) if applying else (Status.PAUSED, Status.PAUSING)):
        return f"the task is already {task.status}"
    return None


def acceptable(task: Task, commands: list[SteeringCommand]) -> set[str]:
    """The command types steering would accept now on `task`, knowing its `commands` (the
    pending ones among them count: a pause waiting, a resume after it): what a person is
    offered (the dashboard's forms). The accept itself decides again, under the row's lock."""
    pending = [c for c in commands if c.status == CommandStatus.PENDING]
    return {kind for kind in CommandType.values if _refusal_beside(pending, task, kind) is None}


def _lock(task_id: UUID, tenant: Tenant) -> Task:
    """The tenant's task, its row locked, and whether a worker holds a live lease on it (for
    _idle) in the same statement: on a wait for the lock, PostgreSQL reads the row again as
    its holder left it and works the expression out on that. Its clock is the statement's
    start, before any wait: a lease running out meanwhile still counts as held, which only
    leaves a command for the next safe point instead of applying it now."""
    held = ExpressionWrapper(Q(lease_owner__isnull=False, lease_expires_at__gt=Now()), output_field=BooleanField())
    try:
        return Task.objects.select_for_update(of=("self",)).annotate(_leased=held).get(id=task_id, tenant=tenant)
    except Task.DoesNotExist:
        raise TaskNotFound from None  # another tenant's task too: ids leak nothing


def _refusal_beside(pending: list[SteeringCommand], task: Task, type: str) -> str | None:
    """refusal(), knowing the commands waiting for the task's safe point. A task its worker
    claimed but has not started (queued) or is recovering shows no "pausing" for a pause
    accepted meanwhile; the pause waiting counts as asked for all the same: a resume may
    take it back, and a second pause has nothing to add. The other way round, a task shows
    "pausing" for the pause that made it so even once a resume waits after it: that pause is
    taken back, and a pause sent now asks again (it was refused, "already pausing", and the
    task went on working although a pause was the last thing asked); a second resume has
    nothing to add."""
    last = None  # the last pause or resume waiting (PAUSE: a pause not taken back)
    for command in pending:
        if command.type in (CommandType.PAUSE, CommandType.RESUME):
            last = command.type
    if last == CommandType.PAUSE and task.status in (Status.QUEUED, Status.RECOVERING, Status.WORKING):
        if type == CommandType.RESUME:
            return None
        if type == CommandType.PAUSE:
            return "a pause is already waiting for the task's next safe point"
    if last == CommandType.RESUME and task.status == Status.PAUSING:
        if type == CommandType.PAUSE:
            return None  # applied in order at the safe point: pause, resume, this pause
        if type == CommandType.RESUME:  # was accepted, then rejected at the safe point: "this one is working"
            return "a resume is already waiting for the task's next safe point"
    return refusal(task, type)


def _idle(task: Task) -> bool:
    """Nobody is mid-step: the task is at a safe point now."""
    if task.status in (Status.PAUSED, Status.INPUT_REQUIRED, Status.DEAD_LETTERED):
        return True
    leased = getattr(task, "_leased", None)  # read with the lock by _lock
    if leased is None:
        leased = Task.objects.filter(id=task.id, lease_owner__isnull=False, lease_expires_at__gt=Now()).exists()
    return not leased


def do_enqueue_command(
    task_id: UUID,
    *,
    who: Principal,
    command_id: str,
    type: str,
    payload: dict[str, Any],
    expected_version: int,
    reason: str = "",
) -> tuple[SteeringCommand, bool]:
    """Accept a command from `who` (compare-and-set on state_version) and apply it at once
    when the task is at a safe point. Returns (command, created); a known command_id returns
    the original command whatever happened since. Steering needs the operator role; an
    answer (provide_input) needs what answering its request needs (answer_refusal: the
    approver role and approve scope for an approval, the operator's for a question), as it
    does through REST's inputs and MCP: Forbidden otherwise."""
    if type == CommandType.PROVIDE_INPUT and isinstance(payload.get("key"), str):
        json_safety.check({"payload": payload})  # before the key reaches a query
        check_may_answer(who, access.task_to_act_on(who, task_id), payload["key"])
    else:
        check_role(who, Role.OPERATOR)
    return _enqueue_command(
        task_id,
        tenant=who.tenant,
        command_id=command_id,
        type=type,
        payload=payload,
        expected_version=expected_version,
        requested_by=who.actor,
        reason=reason,
        own_replays_only=True,
    )


@transaction.atomic(durable=True)
def _enqueue_command(
    task_id: UUID,
    *,
    tenant: Tenant,
    command_id: str,
    type: str,
    payload: dict[str, Any],
    expected_version: int,
    requested_by: str,
    reason: str = "",
    own_replays_only: bool = False,
) -> tuple[SteeringCommand, bool]:
    """own_replays_only: a command id the caller chose replays only the caller's own command.
    (do_answer_input's ids are the request's, the same for everyone, and a second answerer
    is meant to meet the answer that stands.)"""
    json_safety.check(
        {
            "commandId": command_id,
            "type": type,
            "payload": payload,
            "expectedVersion": expected_version,
            "requestedBy": requested_by,
            "reason": reason,
        }
    )  # the last line, whatever the edge
    # Checked here, not only by each edge's form: an id an edge let through (MCP's was cut to
    # fit and stringified whatever came) would be stored as something its caller never sent,
    # and a retry with the id it did send would not replay it.
    if not isinstance(command_id, str) or not COMMAND_ID.match(command_id):
        raise InvalidCommand(f"commandId: must be {COMMAND_ID_SHAPE}; got {str(command_id)[:80]!r}")
    # The row lock orders concurrent commands: exactly one of two with the same expected
    # version sees its version still current.
    task = _lock(task_id, tenant)
    # This command id's command if it is known, and the commands waiting for a safe point
    # (applied first if the task is at one now), in one query.
    known = list(
        SteeringCommand.objects.filter(Q(command_id=command_id) | Q(status=CommandStatus.PENDING), task=task).order_by(
            "version"
        )
    )
    if existing := next((c for c in known if c.command_id == command_id), None):
        if own_replays_only and existing.requested_by != requested_by:
            # Someone else's command: replaying it would hand this caller its payload and
            # reason (an answer, say) and call it accepted, with nothing of theirs done.
            raise CommandRefused(f"command id {command_id!r} is another caller's on this task; use a new one", task)
        return existing, False
    pending = [c for c in known if c.status == CommandStatus.PENDING]
    if refused := _refusal_beside(pending, task, type):
        raise CommandRefused(refused, task)
    if task.state_version != expected_version:
        raise VersionConflict(task)
    _validate(task, type, payload, reason)
    return _accept(
        task,
        command_id=command_id,
        type=type,
        payload=payload,
        requested_by=requested_by,
        reason=reason,
        pending=pending,
    )


def _accept(
    task: Task,
    *,
    command_id: str,
    type: str,
    payload: dict[str, Any],
    requested_by: str,
    reason: str,
    pending: list[SteeringCommand] | None = None,
) -> tuple[SteeringCommand, bool]:
    """On the locked row, once the command is known to be acceptable at the task's version
    now: record it (audited), apply it at once at a safe point, and save the row.
    `pending`: the task's pending commands, when the caller read them under this lock."""
    expected_version = before = task.state_version
    task.state_version += 1
    command = SteeringCommand(
        tenant_id=task.tenant_id,
        task=task,
        command_id=command_id,
        type=type,
        payload=payload,
        reason=reason[:500],
        expected_version=expected_version,
        requested_by=requested_by,
        version=task.state_version,
    )
    # Chained now, written with the row at the end (one statement for both).
    accepted = next_record(
        task,
        actor=requested_by,
        action="steering_accepted",
        before_version=before,
        reason=reason,
        data={"commandId": command_id, "type": type, "payload": payload},
    )
    enqueue = False
    if _idle(task):
        ran_out = task.lease_owner is not None
        if ran_out:
            # Idle because its holder's lease ran out (lost, or frozen) before the reaper
            # came by: applying the command takes the task from that holder, so the epoch
            # moves, or a frozen holder, thawed, renewed its lease and committed its step
            # on the task paused (or re-aimed) under it. The lease itself stays, expired,
            # for the recovery that hands the task on to count its holder lost.
            task.lease_epoch += 1
        # At a safe point now: what a worker left pending (a pause accepted just before its
        # slice ended) applies too, in accepted order, then this command.
        if pending is None:
            command.save()
            enqueue = apply_pending(task, actor=requested_by, by_worker=False)
            command.refresh_from_db(fields=["status", "outcome", "applied_at"])  # applied as its own row
        else:  # applied as this very object, unless a command before it ended the task
            if pending:  # such an end settles the commands it finds as rows: this one must be one
                command.save()
            # (else it is inserted as it is settled, _settle: one INSERT, not an INSERT and an UPDATE)
            enqueue = apply_pending(task, actor=requested_by, by_worker=False, pending=[*pending, command])
            if command.status == CommandStatus.PENDING:  # that end rejected it, as its own row
                command.refresh_from_db(fields=["status", "outcome", "applied_at"])
        if ran_out and task.lease_owner is not None and task.status not in CLAIMABLE:
            # Stopped (paused) over the run-out lease, which stays for a recovery to count:
            # its turn is free, and no slice of it ends to ring the tenant's tasks turned
            # away at capacity, so this does. (A cancel or kill took the lease away, and
            # rang: leases.take_away. A task still runnable rings at its recovery.)
            leases.ring_waiting_on_commit(task.tenant_id)
    elif type == CommandType.SET_PRIORITY:  # no business change: it may apply mid-step
        enqueue = apply_command(task, command, actor=requested_by)  # inserted as it is settled (_settle)
    elif type == CommandType.KILL:  # the emergency stop does not wait for the safe point
        command.save()
        _kill_running(task, command, actor=requested_by)
    else:
        if type == CommandType.PAUSE and can_transition(task.status, Status.PAUSING):
            # Acknowledged now; the worker pauses at its safe point. A task its worker has
            # claimed but not started yet (queued) or is recovering shows no "pausing": its
            # pause lands at the first safe point all the same (it was refused with a 409).
            transition(task, Status.PAUSING, actor=requested_by, reason=reason or "pause requested")
        elif type == CommandType.CANCEL:  # asked for now (the snapshot says so); applied at the safe point
            _request_cancel(task, reason or "cancelled")
        command.save()
    # The command's version is the task's version once this transaction is done: it orders
    # the commands of a task and is what the client sends as its next expectedVersion.
    if command.version != task.state_version:  # it moved on (applied now, with a transition)
        command.version = task.state_version
        SteeringCommand.objects.filter(id=command.id).update(version=command.version)
    task.steering_head = task.state_version
    task.updated_at = timezone.now()  # as the save's auto_now would
    # The row's steering fields, the accepted record and the chain's head: one statement,
    # where task.save() and record_audit() were two (issue 14).
    fields = {name: getattr(task, name) for name in STEERING_FIELDS}
    leases.held_write(
        task, {**fields, "audit_seq": task.audit_seq, "audit_head": task.audit_head}, rows=[leases.Row(accepted)]
    )
    if enqueue:
        enqueue_slice_on_commit(task.id, task.priority)
    return command, True


def apply_pending(
    task: Task, *, actor: str, by_worker: bool = True, pending: list[SteeringCommand] | None = None
) -> bool:
    """At a safe point, in its transaction on a locked or fenced row: apply pending commands
    in accepted order. by_worker=False unless the lease holder applies them and stays to
    let the lease go itself (otherwise an end drops it, which fences out any worker that
    still believes it holds the task). Returns True when the task became runnable and needs
    a slice. The caller saves STEERING_FIELDS.

    Cancel always wins: one applied here ends the task at its place in the order, whoever
    applies it (what waited before it is applied, what came after it rejected by the end);
    one asked for whose command is not among them (a kill that waited for a call) ends it
    after them, whatever came with it (a pause applied in the same breath would otherwise
    leave it paused, with nobody to finish the cancel).

    `pending`: the pending commands in accepted order, when the caller has them (read under
    the row's lock in this transaction); otherwise they are read here. Those after one that
    ends the task are settled by that ending (settle_on_end) as their own rows: a caller
    that goes on using one of these objects reads it back."""
    assert transaction.get_connection().in_atomic_block
    enqueue = False
    if pending is None:
        pending = list(SteeringCommand.objects.filter(task=task, status=CommandStatus.PENDING).order_by("version"))
    for command in pending:
        live = task.status not in TERMINAL
        enqueue = apply_command(task, command, actor=actor, by_worker=by_worker) or enqueue
        if live and task.status in TERMINAL:
            break  # this command ended the task, and the ending settled the others (settle_on_end)
    if task.cancel_requested and task.status not in TERMINAL:
        _cancel(task, actor=actor, by_worker=by_worker)
        enqueue = False
    return enqueue


def settle_on_end(task: Task, *, actor: str, by_command: object | None) -> None:
    """Steering's part of a task's ending (registered with tasks_app.actions.on_task_ended,
    so every transition to a terminal status runs it, in its transaction): the task waits
    for nothing any more.

    Its open questions are withdrawn, or every reader (the snapshot, the dashboard's approve
    buttons, MCP) would go on offering a question whose answer is refused. Every command
    still waiting for a safe point is settled now, audited and on the stream, as `actor`
    (DESIGN §5: every accepted command is applied or rejected). `by_command`, the cancel or
    kill whose applying ends the task (apply_command hands it to the transition), is applied,
    first: its own end does not reject it. The others will never reach a safe point: each is
    rejected by the ended task, in accepted order."""
    assert task.status in TERMINAL, task.status
    InputRequest.objects.filter(task_id=task.id, status=InputStatus.OPEN).update(status=InputStatus.WITHDRAWN)
    if by_command is not None:
        assert isinstance(by_command, SteeringCommand), by_command
        assert by_command.status == CommandStatus.PENDING, by_command.status
        # Applied at the version the ending moved from (transition() moves it by one).
        _settle(task, by_command, CommandStatus.APPLIED, "", actor, task.state_version - 1)
    for command in SteeringCommand.objects.filter(task=task, status=CommandStatus.PENDING).order_by("version"):
        refused = refusal(task, command.type, applying=True)
        assert refused is not None  # an ended task takes no more commands
        _settle(task, command, CommandStatus.REJECTED, refused, actor, task.state_version)


def apply_command(task: Task, command: SteeringCommand, *, actor: str, by_worker: bool = False) -> bool:
    """In-transaction helper on a locked or fenced row: apply one command or reject it with
    the reason; audited, with a steering.applied / steering.rejected event. Returns True
    when the task became runnable and needs a slice. The caller saves STEERING_FIELDS.
    by_worker: the lease holder applies it at its safe point (a cancel or kill it applies
    leaves the lease for it to let go of)."""
    before = task.state_version
    refused = refusal(task, command.type, applying=True)
    if command.type == CommandType.PROVIDE_INPUT and refused is None:
        open_request = InputRequest.objects.filter(
            task=task, key=command.payload["key"], status=InputStatus.OPEN
        ).first()
        refused = None if open_request else f"input request {command.payload['key']!r} is no longer open"
    if refused is not None:
        _settle(task, command, CommandStatus.REJECTED, refused, actor, before)
        return False
    enqueue = False
    match command.type:
        case CommandType.PAUSE:
            transition(task, Status.PAUSED, actor=actor, reason=command.reason or "paused")
            task.status_message = f"paused by {command.requested_by}"
        case CommandType.RESUME:
            waiting = InputRequest.objects.filter(task=task, status=InputStatus.OPEN).exists()
            if task.status == Status.PAUSED:
                transition(
                    task,
                    Status.INPUT_REQUIRED if waiting else Status.WORKING,
                    actor=actor,
                    reason=command.reason or "resumed",
                )
            else:  # PAUSING: the pause never landed; carry on
                transition(task, Status.WORKING, actor=actor, reason=command.reason or "resumed before pausing")
            task.status_message = ""
            enqueue = not waiting
        case CommandType.CANCEL:
            # Cancelled now, and applied by that end, which rejects what came after it: a
            # pause or a goal behind it is not applied to a task that ends in the same breath,
            # nor a second cancel's reason put over this one's, whoever reaches the safe point
            # (its worker included: that one only asked and went on applying).
            _request_cancel(task, command.reason or "cancelled")
            _cancel(task, actor=actor, by_worker=by_worker, by_command=command)
            return False
        case CommandType.KILL:
            _request_kill(task, command)
            # Not waiting for the step: cancelled now, the epoch moved (nothing of the step
            # commits), and applied by that end. A call it had in flight was cut, or had not
            # started: unknown until the remote (by key) or a person says, so nothing re-sends
            # it blindly.
            _cancel(task, actor=actor, by_worker=by_worker, by_command=command)
            # Every row up to the task's epoch, the cut calls of a worker applying the kill
            # itself included: the row is locked, so no ledger row of a newer one can exist.
            settle_interrupted(task.id, before_epoch=task.lease_epoch + 1)
            return False
        case CommandType.ADJUST_GOAL:
            task.goal = command.payload.get("goal", task.goal)
            task.constraints = {**task.constraints, **command.payload.get("constraints", {})}
            task.plan_version += 1  # the agent re-plans at its next safe point
        case CommandType.PROVIDE_INPUT:
            assert open_request is not None  # found above, or the command was refused
            open_request.status, open_request.answer = InputStatus.ANSWERED, command.payload["answer"]
            open_request.answered_by, open_request.answered_at = command.requested_by, timezone.now()
            open_request.save(update_fields=["status", "answer", "answered_by", "answered_at"])
            still_open = InputRequest.objects.filter(task=task, status=InputStatus.OPEN).exists()
            if task.status == Status.INPUT_REQUIRED and not still_open:
                transition(task, Status.WORKING, actor=actor, reason=f"input {open_request.key!r} answered")
                task.status_message = ""
                enqueue = True
        case CommandType.SET_PRIORITY:
            task.priority = command.payload["priority"]
    _settle(task, command, CommandStatus.APPLIED, "", actor, before)
    return enqueue


def _request_cancel(task: Task, reason: str) -> None:
    """The one way a cancel is asked for (the cancel command, whoever sends it, and a kill):
    whoever is at the task's next safe point ends it (apply_pending: cancel always wins)."""
    task.cancel_requested, task.cancel_reason = True, reason[:500]


def _request_kill(task: Task, command: SteeringCommand) -> None:
    task.kill_requested = True
    _request_cancel(task, f"killed: {command.reason}")
    task.status_message = task.cancel_reason
    kills.ring_on_commit(task.id)  # the worker holding it cuts its step (its lease also refuses it)


def _kill_running(task: Task, command: SteeringCommand, *, actor: str) -> None:
    """A kill of a task a worker is running: ended now, unless the call in flight must
    finish (the Kill Policy): then the worker stops the task right after it returns,
    applying this command (and the lease, refused meanwhile, keeps it from going on)."""
    finishing = sorted(
        {
            tool
            for tool in LedgerEntry.objects.filter(
                task=task, status=EffectStatus.STARTED, lease_epoch=task.lease_epoch
            ).values_list("tool", flat=True)
            if kills.must_finish(tool)
        }
    )
    if not finishing:
        # Ended now. The commands accepted earlier wait for a safe point the killed step
        # never reaches (its worker is fenced out): the end rejects them after applying the
        # kill (settle_on_end), not left pending.
        apply_command(task, command, actor=actor)
        return
    _request_kill(task, command)
    command.outcome = f"waiting for {', '.join(finishing)} to return (kill.finish_first), then stopping"
    command.save(update_fields=["outcome"])


def _cancel(task: Task, *, actor: str, by_worker: bool, by_command: SteeringCommand | None = None) -> None:
    """End a task whose cancel was asked for (the reason is on the row). by_command: the
    cancel or kill being applied that ends it, which the ending applies while it rejects the
    other pending commands (settle_on_end); None for a cancel applied earlier that lands now
    (apply_pending: cancel always wins), when none is left pending."""
    transition(task, Status.CANCELLED, actor=actor, reason=task.cancel_reason or "cancelled", by_command=by_command)
    # What the task said last (a step's "reviewing 3 of 20", "paused by ...") is not what it is now.
    task.status_message = (task.cancel_reason or "cancelled")[:500]
    if not by_worker:
        leases.take_away(task)  # fences any worker that still believes it holds the task


def do_cancel_task(task_id: UUID, *, who: Principal, reason: str = "") -> Task:
    """The cancel command at the task's version now, whoever asks (REST's /cancel, MCP's
    tasks/cancel, the admin; steering's own cancel is the same command): the same command
    row, audit records and events. It ends the task now if no worker holds it; otherwise the
    worker stops at its next safe point (a running step always finishes and commits first),
    and asking again meanwhile adds nothing. A finished task: IllegalTransition. Operator role."""
    check_role(who, Role.OPERATOR)
    return _cancel_task(task_id, tenant=who.tenant, actor=who.actor, reason=reason)


@transaction.atomic(durable=True)
def _cancel_task(task_id: UUID, *, tenant: Tenant, actor: str, reason: str) -> Task:
    json_safety.check({"reason": reason, "actor": actor})  # the last line, whatever the edge
    task = _lock(task_id, tenant)
    if task.status in TERMINAL:
        raise IllegalTransition(task.status, Status.CANCELLED)
    if task.cancel_requested:
        # Asked already (a cancel, a kill): it lands at the safe point of the worker holding
        # the task, or here if none does any more (its lease ran out). Another command would
        # only be refused by the cancel the first one makes, and say so in the history.
        if _idle(task):
            apply_pending(task, actor=actor, by_worker=False)
            task.save(update_fields=STEERING_FIELDS)
        return task
    # At a safe point (nobody holds the task) the command applies at once, after whatever a
    # slice left pending, and moves the lease epoch, which fences out a worker whose lease
    # expired but that may still be running.
    _accept(
        task,
        command_id=f"cancel-{secrets.token_hex(8)}",
        type=CommandType.CANCEL,
        payload={},
        requested_by=actor,
        reason=reason,
    )
    return task


def withdraw_cancel(task: Task, *, actor: str) -> list[str]:
    """In-transaction helper on a locked row an operator runs again (a redrive): a cancel or
    kill asked for that never landed (its worker was lost first) is withdrawn, the flags and
    their pending commands alike; a command left pending would end the task at the next safe
    point. Returns the fields to save."""
    task.cancel_requested = task.kill_requested = False
    task.cancel_reason = ""
    pending = SteeringCommand.objects.filter(
        task=task, status=CommandStatus.PENDING, type__in=[CommandType.CANCEL, CommandType.KILL]
    )
    for command in pending.order_by("version"):
        withdrawn = "withdrawn: an operator ran the task again"
        _settle(task, command, CommandStatus.REJECTED, withdrawn, actor, task.state_version)
    return ["cancel_requested", "kill_requested", "cancel_reason"]


def _settle(task: Task, command: SteeringCommand, status: str, outcome: str, actor: str, before: int) -> None:
    now = timezone.now()
    command.status, command.outcome, command.applied_at = status, outcome, now
    if command._state.adding:  # accepted and settled at once (_accept): inserted settled
        # At one moment: auto_now_add would stamp created_at after applied_at (a command
        # applied before it was accepted); raw keeps the value given.
        command.created_at = now
        command.save_base(raw=True, force_insert=True)
    else:
        command.save(update_fields=["status", "outcome", "applied_at"])
    applied = status == CommandStatus.APPLIED
    record = next_record(
        task,
        actor=actor,
        action="steering_applied" if applied else "steering_rejected",
        before_version=before,
        reason=outcome or command.reason,
        data={"commandId": command.command_id, "type": command.type},
    )
    events.emit(
        task,
        "steering.applied" if applied else "steering.rejected",
        {
            "commandId": command.command_id,
            "type": command.type,
            "version": command.version,
            "stateVersion": task.state_version,
            "runtimeStatus": task.status,
            "outcome": outcome,
        },
        audit=record,  # the record and the event in one statement
    )


def open_input_request(
    task: Task, *, key: str, prompt: str, schema: dict[str, Any], step: int, kind: str = "question"
) -> InputRequest:
    """Engine-only, in its fenced transaction: the task is about to wait for this answer."""
    assert transaction.get_connection().in_atomic_block
    request, _ = InputRequest.objects.get_or_create(
        task=task,
        key=key,
        defaults={
            "tenant_id": task.tenant_id,
            "prompt": prompt,
            "answer_schema": schema,
            "step_sequence": step,
            "kind": kind,
        },
    )
    if request.status == InputStatus.WITHDRAWN:
        # Withdrawn when the task ended (a kill); a redrive that reaches it asks it again.
        request.status = InputStatus.OPEN
        request.save(update_fields=["status"])
    return request


def answers_for(task: Task) -> Answers:
    """The task's answers, each with its kind (ctx.ask reads them by key, the runtime by kind)."""
    return Answers(
        InputRequest.objects.filter(task=task, status=InputStatus.ANSWERED).values_list("key", "answer", "kind")
    )


def check_may_answer(who: Principal, task: Task, key: str) -> None:
    """answer_refusal for the input request `key` (a question if there is none yet), as Forbidden."""
    kind = InputRequest.objects.filter(task=task, key=key).values_list("kind", flat=True).first()
    if reason := answer_refusal(who, task, kind or "question"):
        raise Forbidden(reason)


def do_answer_input(task_id: UUID, *, who: Principal, key: str, answer: Any, reason: str = "") -> SteeringCommand:
    """The one way every edge answers (REST, dashboard, MCP): a provide_input command keyed
    by the request, from `who` if the answer rule lets them (Forbidden otherwise). The same
    answer again is a replay and returns the command that stands; a different one raises
    AnswerConflict carrying it. Its precondition is the open request (checked when it is
    applied), not the version the person saw: a worker moving the task meanwhile must not
    bounce the answer, so a version conflict is retried against the version now."""
    json_safety.check({"key": key, "answer": answer})  # before the key is hashed into the command id
    check_may_answer(who, access.task_to_act_on(who, task_id), key)
    tenant, requested_by = who.tenant, who.actor
    command_id = "input:" + hashlib.sha1(key.encode(), usedforsecurity=False).hexdigest()  # a name, not a secret
    for attempt in range(5):
        version = Task.objects.values_list("state_version", flat=True).get(id=task_id)
        try:
            command = _enqueue_command(
                task_id,
                tenant=tenant,
                command_id=command_id,
                type=CommandType.PROVIDE_INPUT,
                payload={"key": key, "answer": answer},
                expected_version=version,
                requested_by=requested_by,
                reason=reason,
            )[0]
        except AnswerConflict as exc:  # answered through the steering endpoint, under another command id
            command = exc.command
        except VersionConflict:
            if attempt == 4:
                raise
            continue
        if _same_answer(command.payload["answer"], answer):
            return command
        if command.status == CommandStatus.REJECTED:  # this key's earlier answer came too late
            raise CommandRefused(command.outcome or f"input request {key!r} is no longer open")
        raise AnswerConflict(key, command)
    raise AssertionError("unreachable")
