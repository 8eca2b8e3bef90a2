"""The step engine (DESIGN §4): one Celery message runs one slice of one task.

    claim → load (verified checkpoint) → [safe point → step → fenced commit]* → yield

Every write after the claim is fenced on the lease epoch, so a worker that lost its
lease (killed, frozen, partitioned) can never commit again. Durability comes from the
rows written here, never from the broker. An infrastructure error (tasks_app.faults) is
never the agent's failure: the slice is abandoned without writing and tried again later.
"""

from __future__ import annotations

import enum
import json
import logging
import math
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Max
from django.utils import timezone

from checkpoints_app import actions as checkpoints
from checkpoints_app.codec import CheckpointCorrupt
from checkpoints_app.models import Checkpoint
from common import json_safety
from common.schema import SchemaError, validate
from ledger_app import actions as ledger
from ledger_app import llm
from ledger_app.models import EffectStatus, LedgerEntry
from runtime_site import dbpool
from runtime_site.blobstore import blob_store
from runtime_site.metrics import LEASE_TAKEOVERS
from steering_app import actions as steering
from steering_app.models import InputRequest, InputStatus
from tasks_app import audit, events, faults, kills, leases, operators, policy, quotas, shutdown, telemetry
from tasks_app.actions import transition
from tasks_app.agents import base as agents
from tasks_app.agents import tools
from tasks_app.agents.questions import Answers
from tasks_app.audit import record_audit
from tasks_app.models import AuditRecord, Step, Task, from_rows
from tasks_app.redaction import redact, tool_text
from tasks_app.selectors import task_snapshot
from tasks_app.states import TERMINAL, Status, can_transition

logger = logging.getLogger(__name__)


class SliceOutcome(enum.Enum):
    DROPPED = "dropped"  # no lease (duplicate message, task done or held elsewhere), or lease lost
    CONTINUE = "continue"  # yielded with work left: enqueue the successor
    POLL = "poll"  # yielded while a remote task runs: enqueue the successor a little later
    DONE = "done"  # reached a state that needs no further message
    AT_CAPACITY = "at_capacity"  # its tenant runs its maximum: the next slice that ends hands over
    RETRY = "retry"  # abandoned to an infrastructure fault: enqueue the successor after a backoff


def worker_identity() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


@dataclass
class _Run:
    """What the slice knows between commits."""

    lease: leases.Lease
    agent: agents.Agent
    task: Task
    state: dict[str, Any]
    sequence: int  # last step folded into `state`
    last_step_name: str
    artifact_refs: list[str]
    checkpoint_sequence: int | None  # sequence of the newest checkpoint
    rerun_until: int  # high-water mark: steps up to here were committed before, by runs that crashed
    plan_version: int  # of `state`; the task's moves ahead when adjust_goal is applied
    steering_cursor: int  # version of the newest steering command folded into `state`
    answers: dict[str, Any]  # answered input requests, for ctx.ask()
    every_steps: int = 10
    max_interval: float = 60.0
    checkpoint_clock: float = field(default_factory=time.monotonic)
    renewed_at: float = field(default_factory=time.monotonic)  # the last lease renewal by a step's commit
    progress_sent_at: float = 0.0  # progress events are coalesced to one per interval ...
    progress_unsent: bool = False  # ... and the latest value is flushed when the slice stops
    released: bool = False  # by a step's commit, which read task.priority back


@dataclass(frozen=True)
class SliceReport:
    """What a slice did, with what handing its task on needs (tasks_app.tasks)."""

    outcome: SliceOutcome
    tenant_id: int | None = None  # None: the slice never held the task
    priority: int | None = None  # the task's, read by the commit that released it; None: not read
    abandoned: leases.Lease | None = None  # RETRY: the lease it could not give back (_abandon), for the retry


def run_slice(task_id: UUID, *, worker_id: str) -> SliceOutcome:
    return run_slice_report(task_id, worker_id=worker_id).outcome


def run_slice_report(task_id: UUID, *, worker_id: str, abandoned: leases.Lease | None = None) -> SliceReport:
    """One slice. `abandoned`: the lease a slice before abandoned to an infrastructure fault
    and could not give back (its retry's message carries it): given back first, for it,
    counted as an infrastructure fault, rather than left to expire and counted as a lost
    worker by whoever found it so."""
    ttl = settings.RUNTIME_LEASE_SECONDS
    if abandoned is not None:
        operators.do_give_back(abandoned, actor=f"worker:{worker_id}")
    try:
        # What _load reads next goes with the claim, in its message where it can (PostgreSQL).
        then = _reads_sql(task_id) if connection.vendor == "postgresql" else None
        claimed = leases.claim_and_read(task_id, worker_id=worker_id, ttl=ttl, then=then)
    except leases.AtCapacity as turned_away:
        leases.wait_for_turn(task_id, tenant_id=turned_away.tenant_id)
        return SliceReport(SliceOutcome.AT_CAPACITY)
    if claimed is None:
        # Held, ended, or left by a holder whose lease ran out (lost, or frozen): the
        # message a lost worker held comes back (at least once). Taking its task over is a
        # recovery, counted as the reaper counts it, which enqueues its next slice.
        operators.do_mark_recovering(task_id, actor=f"worker:{worker_id}")
        return SliceReport(SliceOutcome.DROPPED)
    lease, task, read = claimed
    with (
        kills.guarding(task_id) as guard,
        leases.Heartbeat(
            lease, ttl=ttl, interval=settings.RUNTIME_HEARTBEAT_SECONDS, abandon=operators.do_abandon_step, guard=guard
        ) as heartbeat,
    ):
        try:
            run = _load(lease, task, read)
            if run is None:
                return SliceReport(SliceOutcome.DONE, task.tenant_id)
            outcome = _loop(run, heartbeat)
            return SliceReport(outcome, task.tenant_id, run.task.priority if run.released else None)
        except leases.LeaseLost:
            LEASE_TAKEOVERS.inc()
            logger.warning("task %s: lease lost, slice abandoned without writing", task_id)
            return SliceReport(SliceOutcome.DROPPED, task.tenant_id)
        except Exception as exc:
            if not faults.is_infrastructure_error(exc):
                raise
            fault = exc
    # Once the heartbeat has stopped: nothing renews the lease we give back.
    held = _abandon(lease, fault)
    if held:
        return SliceReport(SliceOutcome.DONE, task.tenant_id)
    return SliceReport(SliceOutcome.RETRY, task.tenant_id, abandoned=lease if held is None else None)


def _abandon(lease: leases.Lease, fault: Exception) -> bool | None:
    """The database, broker or blob store failed under the slice: drop its work in hand
    without writing it, give the lease back and count the fault. The next slice resumes from
    the last checkpoint, as after a crash, but without waiting out the lease and without
    counting a recovery. Should even this fail, the lease expires and recovery takes over.

    What looks like infrastructure may be the agent's own doing (its own client to an
    endpoint that never answers) or a part of ours that stays down: after
    runtime.max_infra_faults slices in a row abandoned without a new step, the task is held
    for an operator (dead-lettered with the diagnosis, which a redrive clears) instead of
    retrying unseen for ever. True: held; None: not given back (the retry gives it back
    for us: run_slice_report's `abandoned`)."""
    logger.warning("task %s: infrastructure fault, slice abandoned: %s: %s", lease.task_id, type(fault).__name__, fault)
    faults.drop_connection()
    try:
        with transaction.atomic(durable=True):
            task = leases.fenced(lease)
            held = operators.count_infrastructure_fault(
                task,
                actor=f"worker:{lease.worker_id}",
                diagnosis=f"{type(fault).__name__}: {fault}",
                fields=leases.take_away(task, fence=False),
            )
            return held
    except leases.LeaseLost:
        pass  # taken over meanwhile: nothing of ours to give back
    except Exception as exc:
        if not faults.is_infrastructure_error(exc):
            raise
        faults.drop_connection()
        logger.warning(
            "task %s: could not give the lease back (%s); its retry gives it back for it", lease.task_id, exc
        )
        return None
    return False


def _load(lease: leases.Lease, task: Task | None = None, read: tuple[Any, ...] | None = None) -> _Run | None:
    """Read the task and its newest checkpoint, in the seed's §9 recovery order: (the reaper
    has marked it recovering) → verify the checkpoint's checksum and schema version,
    migrating older versions forward → continue from its next step → a fresh snapshot
    event. A checkpoint that fails verification dead-letters the task; it never re-runs
    blindly. Ledger rows a lost worker left started become unknown here, and are reconciled
    before the step that made them runs again (ledger_app.actions); steering accepted after
    the checkpoint's cursor is applied at the first safe point. `task`: the row as the
    claim left it (read afresh when not given); `read`: the row of _reads' statement, sent
    with the claim (made here when not given)."""
    if task is None:
        task = Task.objects.get(id=lease.task_id)
    try:
        agent = agents.get_agent(task.agent)
    except agents.UnknownAgent:
        _stop(
            lease,
            Status.FAILED,
            reason=f"agent {task.agent!r} is not registered on this worker",
            error={"code": "unknown_agent", "message": f"agent {task.agent!r} is not registered"},
        )
        return None
    if connection.vendor == "postgresql":
        cp, high_step, answers, interrupted, inputs_open = _reads(task, read)
        if interrupted:  # whatever a lost worker left started is unknown now (not a newer owner's)
            ledger.settle_interrupted(task.id, before_epoch=lease.epoch)
    else:
        ledger.settle_interrupted(task.id, before_epoch=lease.epoch)
        cp = checkpoints.latest_checkpoint(task)
        high_step = Step.objects.filter(task_id=task.id).aggregate(n=Max("sequence"))["n"] or 0
        answers = steering.answers_for(task)
        inputs_open = None  # not read: the snapshot reads them
    if cp is None:
        state, sequence, step_name, refs = agent.start(task.input, task.goal), 0, "", []
    else:
        try:
            state = checkpoints.load_state(cp, agent=task.agent)
        except CheckpointCorrupt as exc:
            _stop(
                lease,
                Status.DEAD_LETTERED,
                reason=str(exc),
                message=f"held for operator: {exc}",
                error={"code": "checkpoint_corrupt", "message": str(exc), "checkpoint": cp.sequence},
            )
            return None
        sequence, step_name, refs = cp.sequence, cp.step_name, list(cp.artifact_refs)
    plan_version = cp.plan_version if cp else 1
    if task.plan_version != plan_version:  # adjust_goal applied while no worker held the task
        state, plan_version = agent.replan(state, task.goal, task.constraints), task.plan_version
    # Steps past the checkpoint up to the highest one ever committed run again, as new attempts.
    # Read from the step rows, which nothing lowers (releases before issue 12 lowered steps_done).
    high_water = max(task.steps_done, high_step)
    if task.status in (Status.QUEUED, Status.RECOVERING):
        task = _start_working(lease, task.status, sequence if cp else None, claimed=task, inputs_open=inputs_open)
    policy = task.checkpoint_policy or {}
    defaults = settings.RUNTIME["checkpoint"]
    return _Run(
        lease=lease,
        agent=agent,
        task=task,
        state=state,
        sequence=sequence,
        last_step_name=step_name,
        artifact_refs=refs,
        checkpoint_sequence=cp.sequence if cp else None,
        rerun_until=high_water,
        plan_version=plan_version,
        steering_cursor=cp.steering_cursor if cp else 0,
        answers=answers,
        every_steps=int(policy.get("everySteps", defaults["every_steps"])),
        max_interval=float(policy.get("maxSeconds", defaults["max_interval_seconds"])),
    )


def _reads(task: Task, row: tuple[Any, ...] | None = None) -> tuple[Checkpoint | None, int, Answers, bool, bool]:
    """What _load reads besides the task, in one statement and one round trip (PostgreSQL):
    (the newest checkpoint not discarded, the highest step sequence committed, the answered
    input requests, whether the ledger holds rows a lost worker left started that
    settle_interrupted must settle, whether input requests are open: the snapshot of a
    slice that starts the task lists them). Four ORM queries took four round trips and, building
    them, about half of a one-step slice's CPU time (py-spy). `row`: the statement's row, when
    it went with the claim in the claim's message (run_slice_report), a round trip less on the
    path of submit -> first step; made here when None."""
    if row is None:
        sql, params = _reads_sql(task.id)
        with dbpool.bound_cursor(connection, params) as cursor:
            cursor.execute(sql, params)
            row = cursor.fetchone()
    high_step, interrupted, answered, inputs_open, *cp_row = row
    cp_fields = Checkpoint._meta.concrete_fields
    cp = from_rows(Checkpoint, [f.attname for f in cp_fields], [cp_row])[0] if cp_row[0] is not None else None
    answers = Answers(tuple(answer) for answer in json.loads(answered)) if answered else Answers()
    return cp, high_step or 0, answers, bool(interrupted), bool(inputs_open)


def _reads_sql(task_id: UUID) -> tuple[str, list[Any]]:
    """_reads' statement and its parameters."""
    quote = connection.ops.quote_name
    cp_fields = Checkpoint._meta.concrete_fields
    cp_columns = ", ".join(quote(f.column or f.attname) for f in cp_fields)
    table = {m: quote(m._meta.db_table) for m in (Checkpoint, Step, LedgerEntry, InputRequest)}
    sql = (
        f"SELECT (SELECT MAX(sequence) FROM {table[Step]} WHERE task_id = %s),"  # noqa: S608 (names from the models; values are parameters)
        f" EXISTS (SELECT 1 FROM {table[LedgerEntry]} WHERE task_id = %s AND status = %s AND NOT (tool = ANY(%s))),"
        f" (SELECT json_agg(json_build_array(key, answer, kind) ORDER BY id)::text FROM {table[InputRequest]}"
        f" WHERE task_id = %s AND status = %s),"
        f" EXISTS (SELECT 1 FROM {table[InputRequest]} WHERE task_id = %s AND status = %s), cp.*"
        f" FROM (SELECT 1) AS one LEFT JOIN LATERAL (SELECT {cp_columns} FROM {table[Checkpoint]}"
        " WHERE task_id = %s AND NOT discarded ORDER BY sequence DESC, id DESC LIMIT 1) AS cp ON TRUE"
    )
    params: list[Any] = [
        task_id,
        task_id,
        EffectStatus.STARTED.value,
        ledger.harmless_tools(),
        task_id,
        InputStatus.ANSWERED.value,
        task_id,
        InputStatus.OPEN.value,
        task_id,
    ]
    return sql, params


def _start_working(
    lease: leases.Lease,
    status: str,
    checkpoint: int | None,
    *,
    claimed: Task | None = None,
    inputs_open: bool | None = None,
) -> Task:
    """queued or recovering (`status`) → working, audited, with a fresh snapshot event.
    `claimed`: the row as the slice read it; `inputs_open`: whether it has open input
    requests (None: not known), read with the checkpoint (_reads), so the snapshot needs no
    reads of its own. With both, on PostgreSQL, one statement."""
    if status == Status.QUEUED:
        reason = "first slice"
    else:
        reason = f"resumed from checkpoint {checkpoint}" if checkpoint else "resumed from the start"
    if (
        inputs_open is False
        and claimed is not None
        and claimed.status == status
        and leases.one_statement_writes()
        and (task := _start_working_in_one_statement(lease, claimed, reason, checkpoint))
    ):
        return task
    with transaction.atomic(durable=True):
        task = leases.fenced(lease)
        if status == Status.QUEUED:
            task.started_at = timezone.now()
        fields = transition(task, Status.WORKING, actor=f"worker:{lease.worker_id}", reason=reason)
        task.save(update_fields=[*fields, "started_at"])
        if status in (Status.RECOVERING, Status.QUEUED):
            # The version moved: stream clients (the dashboard's forms) need the new one.
            events.emit(task, "task.snapshot", _snapshot(task, checkpoint, inputs_open=inputs_open))
    return task


def _snapshot(task: Task, checkpoint: int | None, *, inputs_open: bool | None) -> dict[str, Any]:
    """task_snapshot(task), told what _reads saw (the newest checkpoint; no open input
    requests, which only the lease holder opens) instead of reading it again."""
    if inputs_open is not False:
        return task_snapshot(task)
    return task_snapshot(task, last_checkpoint=checkpoint, no_open_inputs=True)


def _start_working_in_one_statement(
    lease: leases.Lease, task: Task, reason: str, checkpoint: int | None
) -> Task | None:
    """_start_working's transaction as one statement (PostgreSQL): the fenced UPDATE of the
    status, version, audit head and event seq, with the audit record and the snapshot event
    inserted beside it (leases.fenced_write), where the transaction took ten round trips
    (BEGIN, the fenced read, the record and its head, the save, the seq, two snapshot
    reads, the event, COMMIT); the first slice's start is on the path of submit → first
    step (bench/latency.py). Worked out on the claimed row: should anything the write
    relies on have moved since (a command accepted, a cancel), it writes nothing and None
    sends the caller to the transaction."""
    seen = {
        "status": task.status,
        "state_version": task.state_version,
        "audit_seq": task.audit_seq,
        "cancel_requested": task.cancel_requested,
    }
    status, before = task.status, task.state_version
    if not can_transition(status, Status.WORKING):
        return None  # the transaction raises as transition() does
    task.status, task.state_version, task.updated_at = Status.WORKING, before + 1, timezone.now()
    fields: dict[str, Any] = {"status": task.status, "state_version": task.state_version}
    if status == Status.QUEUED:
        task.started_at = fields["started_at"] = timezone.now()
    record = audit.next_record(
        task,
        actor=f"worker:{lease.worker_id}",
        action="transition",
        from_status=status,
        to_status=Status.WORKING,
        before_version=before,
        reason=reason,
    )
    fields.update(audit_seq=task.audit_seq, audit_head=task.audit_head, event_seq=leases.Add(1))
    [event] = events.prepare(task, [("task.snapshot", _snapshot(task, checkpoint, inputs_open=False))])
    rows = [leases.Row(record), leases.Row(event, computed=events.numbered_in_sql(event, f"{leases.FENCE}.event_seq"))]
    try:
        fresh = leases.fenced_write(lease, fields, returning=BACK, rows=rows, expect=seen)
    except leases.Moved:
        return None
    events.publish_on_commit(task.id, events.numbered([event], fresh["event_seq"]))
    for name in BACK:
        setattr(task, name, fresh[name])
    return task


def _loop(run: _Run, heartbeat: leases.Heartbeat) -> SliceOutcome:
    started, steps = time.monotonic(), 0
    while True:
        # --- safe point: the fresh row from the last commit says what was asked of us.
        if (run.task.steering_head > run.steering_cursor or run.task.cancel_requested) and not _apply_steering(run):
            return SliceOutcome.DONE  # paused, or the task ended
        step_name = run.agent.next_step(run.state)
        if step_name is None:
            if (done := _complete(run)) is not None:
                return done
            continue  # a command came in since the safe point above: back to it
        if reason := _over_budget(run):
            if question := policy.budget_question(f"step-{run.sequence + 1}", reason, run.answers):
                _wait_for_input(run, question)  # an approver may extend it
                return SliceOutcome.DONE
            _stop(run.lease, Status.FAILED, reason=reason, error={"code": "budget_exhausted", "message": reason})
            return SliceOutcome.DONE
        if reason := quotas.cost_reached(run.task.tenant_id):  # the tenant's day (limits.cost_per_tenant_day)
            if quotas.on_quota() == quotas.WAIT:
                _yield(run, message=f"{reason}; waiting (limits.on_quota: wait)")
                return SliceOutcome.POLL
            _stop(run.lease, Status.FAILED, reason=reason, error={"code": "quota_exceeded", "message": reason})
            return SliceOutcome.DONE
        if (
            steps >= settings.RUNTIME_SLICE_STEPS
            or time.monotonic() - started >= settings.RUNTIME_SLICE_SECONDS
            or shutdown.requested()
        ):  # the worker is stopping: hand the task over now
            _yield(run)
            return SliceOutcome.CONTINUE
        if heartbeat.lost:
            raise leases.LeaseLost(run.lease.task_id)
        # --- step
        sequence = run.sequence + 1

        def tool_runner(name: str, args: dict[str, Any], index: int, sequence: int = sequence) -> Any:
            return ledger.execute_once(
                run.lease,
                tenant_id=run.task.tenant_id,
                sequence=sequence,
                index=index,
                name=name,
                args=args,
                answers=run.answers,
            )

        ctx = agents.StepContext(
            task_id=str(run.task.id),
            goal=run.task.goal,
            input=run.task.input,
            step_name=step_name,
            sequence=sequence,
            blobs=blob_store(),
            answers=run.answers,
            tool_runner=tool_runner,
        )
        began, t0 = timezone.now(), time.perf_counter()
        try:
            heartbeat.watch(step_name, _step_deadline(run.agent, step_name))
            # A JSON round trip both copies the state (a failed step leaves ours intact)
            # and proves the agent's new state can be checkpointed.
            with (
                telemetry.step(run.task, step_name, sequence, rerun=sequence <= run.rerun_until),
                kills.step(heartbeat.guard),
            ):
                produced = run.agent.run_step(ctx, json.loads(json.dumps(run.state)))
            if why := _unstorable(ctx, produced):  # the agent's failure, not the commit's
                raise ValueError(f"the step's output cannot be stored: {why}")
            new_state = json.loads(json.dumps(produced))
        except agents.InputNeeded as need:
            _wait_for_input(run, need)
            return SliceOutcome.DONE
        except agents.RemoteWait as wait:
            _yield(run, message=wait.message)
            return SliceOutcome.POLL
        except kills.StepKilled:
            return _killed(run)
        except leases.LeaseLost:
            raise
        except agents.ToolRejected as exc:
            _stop(
                run.lease,
                Status.FAILED,
                reason=tool_text(f"step {step_name}: {exc}", limit=500),
                error={"code": "rejected", "step": step_name, "message": tool_text(str(exc), limit=1000)},
            )
            return SliceOutcome.DONE
        except (ledger.ToolFailed, tools.UnknownTool, SchemaError) as exc:
            _stop(
                run.lease,
                Status.FAILED,
                reason=tool_text(f"step {step_name}: {exc}", limit=500),
                error={
                    "code": getattr(exc, "code", "tool_failed"),
                    "step": step_name,
                    "sequence": run.sequence + 1,
                    "message": tool_text(str(exc), limit=1000),
                },
            )
            return SliceOutcome.DONE
        except Exception as exc:
            if faults.is_infrastructure_error(exc):
                raise  # not the agent's failure: run_slice abandons the slice
            logger.exception("task %s: step %s failed", run.task.id, step_name)
            _stop(
                run.lease,
                Status.FAILED,
                reason=tool_text(f"step {step_name} failed: {exc}", limit=500),
                error={
                    "code": "step_failed",
                    "step": step_name,
                    "sequence": run.sequence + 1,
                    "message": tool_text(f"{type(exc).__name__}: {exc}", limit=1000),
                },
            )
            return SliceOutcome.DONE
        finally:
            heartbeat.watch(None)  # what follows (commit, checkpoint, yield) is the runtime's, not the step's
        # The slice's budget spent with work left: the step's commit is the yield as well.
        last = (
            steps + 1 >= settings.RUNTIME_SLICE_STEPS
            or time.monotonic() - started >= settings.RUNTIME_SLICE_SECONDS
            or shutdown.requested()
        ) and run.agent.next_step(new_state) is not None
        _commit_step(run, ctx, new_state, began, (time.perf_counter() - t0) * 1000, last=last)
        if last:
            run.released = True
            return SliceOutcome.CONTINUE
        steps += 1


def _killed(run: _Run) -> SliceOutcome:
    """The step was cut by a kill (tasks_app.kills) and nothing of it is kept. Mostly the
    kill has ended the task already and moved the epoch: the fence drops the slice. If the
    kill waited for a call that had to finish, the lease is still ours and the kill
    applies here, at the safe point the step's end makes (a terminal checkpoint)."""
    try:
        _apply_steering(run)
    except leases.LeaseLost:
        logger.warning("task %s: killed; its step was cut and nothing of it committed", run.task.id)
        return SliceOutcome.DROPPED
    return SliceOutcome.DONE


def _step_deadline(agent: agents.Agent, step_name: str) -> float:
    """The seconds `step_name` may run (0: no limit). A declaration that is no duration
    (negative, NaN, infinite) is the agent's bug: its step fails saying so, instead of
    being abandoned at every beat until dead-lettered, or never."""
    declared = agent.step_deadline(step_name)
    if declared is None:
        return settings.RUNTIME_STEP_SECONDS
    if not (isinstance(declared, int | float) and 0 <= declared < float("inf")):
        raise ValueError(
            f"agent {agent.name} declares step deadline {declared!r} for {step_name}: "
            f"it must be a number of seconds, 0 or more (0: no limit)"
        )
    return declared


def _unstorable(ctx: agents.StepContext, new_state: dict[str, Any]) -> str | None:
    """Why the database would refuse what the step produced (its text and jsonb take no NUL
    and no lone surrogate, jsonb no NaN or infinity; names, phases and messages have a
    length), or None. Checked before the commit: a refused commit would escape the slice and
    crash-loop the task into a dead letter that blames the worker. Fetched content carries
    such characters easily, and a parser such numbers. Nesting is held to the inputs' bound
    (common.json_safety.MAX_DEPTH): a log nested a thousand deep made the commit's recursive
    walks (masking, JSON) raise RecursionError out of the slice. Walked without recursion,
    before the state's JSON round trip, which would raise it too."""
    for what, value, limit in (
        ("step name", ctx.step_name, Step._meta.get_field("name").max_length),
        ("phase", ctx.phase or "", Task._meta.get_field("phase").max_length),
        ("message", ctx.message or "", Task._meta.get_field("status_message").max_length),
    ):
        if limit is not None and len(value) > limit:
            return f"its {what} is longer than {limit} characters"
    stack: list[tuple[Any, int]] = [
        (item, 0)
        for item in (ctx.step_name, ctx.phase, ctx.message, ctx.logs, ctx.artifacts, ctx.summary, ctx.audits, new_state)
    ]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list | tuple) and depth > json_safety.MAX_DEPTH:
            return f"it is nested more than {json_safety.MAX_DEPTH} deep"
        if isinstance(item, dict):
            stack += [(inner, depth + 1) for inner in (*item.keys(), *item.values())]
        elif isinstance(item, list | tuple):
            stack += [(inner, depth + 1) for inner in item]
        elif isinstance(item, str):
            if "\x00" in item:
                return f"a NUL character in {item[:60]!r}"
            try:
                item.encode()
            except UnicodeEncodeError:
                return f"a lone surrogate in {item[:60]!r}"
        elif isinstance(item, float) and not math.isfinite(item):
            return f"{item} is not a JSON number"
    return None


def _over_budget(run: _Run) -> str | None:
    """The safe point honours the task's budget (tool calls are counted by the guard), as
    extended by approvers; an extension answered "stop" leaves it exhausted."""
    budget = policy.effective_budget(run.task.budget, run.answers)
    if not budget:
        return None  # no limit at all, the common case: nothing to measure
    started = run.task.started_at or timezone.now()
    limited = "maxTokens" in budget
    tokens = llm.tokens_used(run.task.id) if limited else None
    return policy.exhausted(
        run.task.budget,
        policy.Usage(
            steps=run.sequence,
            tool_calls=None,
            wall_seconds=(timezone.now() - started).total_seconds(),
            cost=run.task.cost,
            tokens=tokens,
        ),
        run.answers,
    )


def _apply_steering(run: _Run) -> bool:
    """Apply pending steering commands in accepted order and a requested cancel (which always
    wins), re-plan if the goal moved, and checkpoint with the new steering cursor (so
    recovery re-applies nothing and loses nothing). False: the slice must stop (paused, or
    the task ended)."""
    with transaction.atomic(durable=True):
        task = leases.fenced(run.lease)
        steering.apply_pending(task, actor=f"worker:{run.lease.worker_id}")
        run.steering_cursor, run.task = task.steering_head, task
        if task.plan_version != run.plan_version:
            run.state, run.plan_version = run.agent.replan(run.state, task.goal, task.constraints), task.plan_version
        paused, ended = task.status == Status.PAUSED, task.status in TERMINAL
        if paused or ended:
            task.drop_lease(fence=False)
            _flush_progress(run, task)
        task.save(update_fields=steering.STEERING_FIELDS)
        _checkpoint(run, task, "pause" if paused else "terminal" if ended else "steering", force=True)
    return not (paused or ended)


def _wait_for_input(run: _Run, need: agents.InputNeeded) -> None:
    """The step asked a person something: checkpoint the state before it, open the input
    request and wait in input_required. The step runs again once it is answered."""
    with transaction.atomic(durable=True):
        task = leases.fenced(run.lease)
        for asked in (need, *need.also):
            steering.open_input_request(
                task, key=asked.key, prompt=asked.prompt, schema=asked.schema, step=run.sequence + 1, kind=asked.kind
            )
        transition(task, Status.INPUT_REQUIRED, actor=f"worker:{run.lease.worker_id}", reason=need.prompt[:500])
        task.status_message = need.prompt[:500]
        _flush_progress(run, task)
        events.emit(
            task, "input_required", {"key": need.key, "kind": need.kind, "prompt": need.prompt, "schema": need.schema}
        )
        # Entering approval is a safe point: a pause sent just before lands here, so the
        # guarded call cannot happen until someone resumes (and someone approves).
        steering.apply_pending(task, actor=f"worker:{run.lease.worker_id}", by_worker=False)
        run.steering_cursor = task.steering_head
        task.drop_lease(fence=False)
        task.save(update_fields=steering.STEERING_FIELDS)
        _checkpoint(run, task, "input_required", force=True)


def _commit_step(
    run: _Run,
    ctx: agents.StepContext,
    new_state: dict[str, Any],
    began: Any,
    ms: float,
    *,
    last: bool = False,
) -> None:
    """One transaction per step: a compare-and-set on the lease epoch (the fence) that also
    records progress and reserves the step's event seqs, then the step row, the events and
    a checkpoint when the policy says so. On PostgreSQL that is one statement, one round
    trip (leases.fenced_write), whatever the step wrote: events, a checkpoint, its cost
    counted against the tenant's day, audit records (chained optimistically to the head
    the slice last saw: should another writer have moved it, the transaction below).

    `last`: the slice ends after this step (its budget is spent, or the worker stops) with
    work left. The same commit then gives the lease back, with the slice-end checkpoint and
    the latest progress: what _yield writes, which took a transaction of its own.

    A step at or below the high-water mark ran before, in a run that crashed before its
    checkpoint: it becomes the next attempt of that sequence, and what it reports was shown
    already, so steps_done, progress, phase and message stay where they were."""
    sequence = run.sequence + 1
    rerun = sequence <= run.rerun_until
    run.artifact_refs += [a["ref"] for a in ctx.artifacts]
    since = sequence - (run.checkpoint_sequence or 0)
    every = since >= run.every_steps
    due = every or time.monotonic() - run.checkpoint_clock >= run.max_interval
    reason = "every_steps" if every else "interval" if due else "slice_end" if last else None
    items: list[tuple[str, dict[str, Any]]] = []
    fields: dict[str, Any] = {"steps_done": leases.AtLeast(sequence)}
    if time.monotonic() - run.renewed_at >= settings.RUNTIME_HEARTBEAT_SECONDS:
        # Renewed here as often as the heartbeat renews, not at every step: lease_expires_at
        # is indexed, and a write to it cannot be a HOT update (a new entry in each of the
        # task table's indexes, at every step); steps_done and event_seq are not.
        fields["lease_expires_at"] = leases.Deadline(settings.RUNTIME_LEASE_SECONDS)
        run.renewed_at = time.monotonic()
    if ctx.cost and not rerun:
        fields["cost"] = leases.Add(ctx.cost)
        run.task.cost += ctx.cost
    if not rerun and (ctx.progress_value is not None or ctx.phase is not None or ctx.message is not None):
        task = run.task
        new_phase = ctx.phase is not None and ctx.phase != task.phase
        # Progress only goes forward (MCP progress notifications must increase).
        task.progress = max(task.progress, ctx.progress_value) if ctx.progress_value is not None else task.progress
        task.phase = ctx.phase if ctx.phase is not None else task.phase
        task.status_message = ctx.message if ctx.message is not None else task.status_message
        fields.update(progress=task.progress, phase=task.phase, status_message=task.status_message)
        # The row always has the latest; the stream gets at most one progress event per
        # interval (a fast task must not flood Redis or browsers), plus every phase change
        # and the last of the slice.
        now = time.monotonic()
        if last or new_phase or now - run.progress_sent_at >= settings.RUNTIME["stream"]["progress_interval_ms"] / 1000:
            items.append(("progress", _progress(task, sequence)))
            run.progress_sent_at, run.progress_unsent = now, False
        else:
            run.progress_unsent = True
    items += [("log", {"step": sequence, **entry}) for entry in ctx.logs]
    items += [("artifact", {"step": sequence, **artifact}) for artifact in ctx.artifacts]
    if last:
        fields.update(lease_owner=None, lease_expires_at=None)  # Task.drop_lease(fence=False), in SQL
        if run.progress_unsent:  # _flush_progress
            items.append(("progress", _progress(run.task, sequence)))
            run.progress_unsent = False
    if reason:
        items.append(("checkpoint", {"checkpoint": sequence, "reason": reason}))
    step = Step(
        tenant_id=run.task.tenant_id,
        task_id=run.task.id,
        sequence=sequence,
        attempt=1,
        name=ctx.step_name,
        status=Step.StepStatus.SUCCEEDED,
        worker=run.lease.worker_id,
        lease_epoch=run.lease.epoch,
        started_at=began,
        finished_at=timezone.now(),
        duration_ms=ms,
        output=ctx.summary,
    )
    fields["event_seq"] = leases.Add(len(items))
    # A rerun's cost was counted when the step first committed (the tenant's day, as the task's above).
    counts_cost = bool(ctx.cost) and not rerun and quotas.enabled()
    if not (items or reason or rerun or ctx.audits or counts_cost):
        # The common step: fence, progress and step row in one statement, its own transaction.
        _took_step(run, ctx, new_state, sequence, leases.fenced_write(run.lease, fields, returning=BACK, insert=step))
        return
    cp = (
        checkpoints.new_checkpoint(
            run.task,
            sequence=sequence,
            step_name=ctx.step_name,
            next_step=run.agent.next_step(new_state) or "",
            state=new_state,
            artifact_refs=run.artifact_refs,
            reason=reason,
            plan_version=run.plan_version,
            steering_cursor=run.steering_cursor,
        )
        if reason
        else None
    )
    if not (leases.one_statement_writes() and _commit_in_one_statement(run, ctx, new_state, fields, items, step, cp)):
        _commit_in_transaction(run, ctx, new_state, fields, items, step, cp, counts_cost=counts_cost)
    if cp is not None:
        run.checkpoint_sequence, run.checkpoint_clock = sequence, time.monotonic()


def _commit_in_one_statement(
    run: _Run,
    ctx: agents.StepContext,
    new_state: dict[str, Any],
    fields: dict[str, Any],
    items: list[tuple[str, dict[str, Any]]],
    step: Step,
    cp: Checkpoint | None,
) -> bool:
    """_commit_step's write as one statement (PostgreSQL). False: the audit chain's head
    moved since the slice last saw it (a command accepted meanwhile), so the records chained
    to it would not fit: nothing was written, and the transaction must do it."""
    sequence = step.sequence
    rows = [leases.Row(step)]
    if sequence <= run.rerun_until:  # the next attempt of the sequence: after those kept
        table = connection.ops.quote_name(Step._meta.db_table)
        rows[0] = leases.Row(
            step,
            computed={
                "attempt": (
                    f"1 + COALESCE((SELECT MAX(attempt) FROM {table} WHERE task_id = %s AND sequence = %s), 0)",  # noqa: S608
                    [run.task.id, sequence],
                )
            },
        )
    if cp is not None:
        rows.append(leases.Row(cp))
    pending = events.prepare(run.task, items)
    for i, row in enumerate(pending):  # seqs: the last len(items) the write reserved
        rows.append(
            leases.Row(row, computed=events.numbered_in_sql(row, f"{leases.FENCE}.event_seq - {len(pending) - 1 - i}"))
        )
    if bool(ctx.cost) and not sequence <= run.rerun_until and quotas.enabled():
        usage, upsert = quotas.cost_upsert(run.task.tenant_id, ctx.cost)
        rows.append(leases.Row(usage, conflict=upsert))
    expect, head = None, (run.task.audit_seq, run.task.audit_head)
    if ctx.audits:
        expect = {"audit_seq": run.task.audit_seq, "state_version": run.task.state_version}
        for record in ctx.audits:
            rows.append(leases.Row(_step_audit(run, run.task, record, sequence, chain=audit.next_record)))
        fields = {**fields, "audit_seq": run.task.audit_seq, "audit_head": run.task.audit_head}
    try:
        fresh = leases.fenced_write(run.lease, fields, returning=BACK, rows=rows, expect=expect)
    except leases.Moved:
        run.task.audit_seq, run.task.audit_head = head
        return False
    events.publish_on_commit(run.task.id, events.numbered(pending, fresh["event_seq"] - len(pending) + 1))
    _took_step(run, ctx, new_state, sequence, fresh)
    return True


def _commit_in_transaction(
    run: _Run,
    ctx: agents.StepContext,
    new_state: dict[str, Any],
    fields: dict[str, Any],
    items: list[tuple[str, dict[str, Any]]],
    step: Step,
    cp: Checkpoint | None,
    *,
    counts_cost: bool,
) -> None:
    """_commit_step's write where it cannot be one statement (SQLite; the audit chain moved)."""
    sequence = step.sequence
    with transaction.atomic(durable=True):
        if sequence <= run.rerun_until:  # after the attempts before it (the fence's row lock keeps this race-free)
            fresh = leases.fenced_write(run.lease, fields, returning=BACK)
            step.attempt += (
                Step.objects.filter(task_id=run.task.id, sequence=sequence).aggregate(n=Max("attempt"))["n"] or 0
            )
            step.save(force_insert=True)
        else:
            fresh = leases.fenced_write(run.lease, fields, returning=BACK, insert=step)
        if counts_cost:
            quotas.add_cost(run.task.tenant_id, ctx.cost)
        if items:
            events.store(run.task, fresh["event_seq"] - len(items) + 1, items)
        if ctx.audits:
            task = leases.fenced(run.lease)  # locked already by the fenced write above
            for record in ctx.audits:
                _step_audit(run, task, record, sequence, chain=record_audit)
            fresh = {**fresh, "audit_seq": task.audit_seq, "audit_head": task.audit_head}
        if cp is not None:
            cp.save()
        _took_step(run, ctx, new_state, sequence, fresh)


def _step_audit(run: _Run, task: Task, record: dict[str, Any], sequence: int, *, chain: Any) -> AuditRecord:
    """A record the step asked for (ctx.audit), chained to `task`'s head by `chain`
    (record_audit writes it, audit.next_record only makes it)."""
    written: AuditRecord = chain(
        task,
        actor=f"worker:{run.lease.worker_id}",
        action=record["action"],
        before_version=task.state_version,
        reason=record["reason"],
        data={"step": sequence, **record["data"]},
    )
    return written


# What a step's commit reads back from the task row: what others changed since (events
# appended by steering; the control fields a cancel, a kill or a command wrote) and the
# high-water mark.
FRESH = ("event_seq", "steps_done", *Task.CONTROL_FIELDS)
# ... and what the slice keeps up to date besides: the audit chain's head with the version
# its records carry (the optimistic chaining above).
BACK = tuple(dict.fromkeys((*FRESH, "audit_seq", "audit_head", "state_version")))


def _took_step(
    run: _Run, ctx: agents.StepContext, new_state: dict[str, Any], sequence: int, fresh: dict[str, Any]
) -> None:
    run.state, run.sequence, run.last_step_name = new_state, sequence, ctx.step_name
    for name in BACK:
        setattr(run.task, name, fresh[name])


def _progress(task: Task, sequence: int) -> dict[str, Any]:
    return {"progress": task.progress, "phase": task.phase, "message": task.status_message, "step": sequence}


def _flush_progress(run: _Run, task: Task) -> None:
    """In the transaction that stops the slice: the latest progress always goes out."""
    if run.progress_unsent:
        events.emit(task, "progress", _progress(run.task, run.sequence))
        run.progress_unsent = False


def _checkpoint(run: _Run, task: Task, reason: str, *, force: bool = False) -> None:
    if run.checkpoint_sequence == run.sequence and not force:
        return  # nothing new since the last one
    cp = checkpoints.record_checkpoint(
        task,
        sequence=run.sequence,
        step_name=run.last_step_name,
        next_step=run.agent.next_step(run.state) or "",
        state=run.state,
        artifact_refs=run.artifact_refs,
        reason=reason,
        plan_version=run.plan_version,
        steering_cursor=run.steering_cursor,
    )
    events.emit(task, "checkpoint", {"checkpoint": cp.sequence, "reason": reason})
    run.checkpoint_sequence, run.checkpoint_clock = cp.sequence, time.monotonic()


def _yield(run: _Run, *, message: str | None = None) -> None:
    """End of slice with work left: checkpoint (the successor starts from it) and release.
    With a message (waiting on a remote task), the person watching sees why."""
    with transaction.atomic(durable=True):
        fields: dict[str, Any] = {}
        if message is not None and message != run.task.status_message:
            run.task.status_message = fields["status_message"] = message[:500]
            run.progress_unsent = True
        leases.fenced_update(
            run.lease, lease_owner=None, lease_expires_at=None, **fields
        )  # Task.drop_lease(fence=False), in SQL
        _flush_progress(run, run.task)
        _checkpoint(run, run.task, "slice_end")


def _complete(run: _Run) -> SliceOutcome | None:
    """DONE once the task has ended; None when a command accepted since the last safe point
    must be applied first (the loop goes back to it)."""
    result = run.agent.result(run.state)
    try:
        validate(result, run.agent.output_schema, "result")
    except SchemaError as exc:
        _stop(
            run.lease,
            Status.FAILED,
            reason=tool_text(str(exc), limit=500),
            error={"code": "invalid_result", "message": tool_text(str(exc), limit=1000)},
        )
        return SliceOutcome.DONE
    return SliceOutcome.DONE if _finish(run, Status.COMPLETED, result=result) else None


def _finish(run: _Run, to: str, *, reason: str = "", result: dict[str, Any] | None = None) -> bool:
    """Terminal with a checkpoint (completed; a cancel ends in _apply_steering). False, with
    nothing written, when a command was accepted since the last safe point (between the last
    step's commit and this lock): ending over it would leave it pending for ever, and a pause
    ("pausing") cannot become completed; the caller goes back to the safe point."""
    with transaction.atomic(durable=True):
        task = leases.fenced(run.lease)
        if task.steering_head > run.steering_cursor or task.cancel_requested:
            run.task = task  # what the safe point reads
            return False
        _flush_progress(run, task)
        _checkpoint(run, task, "terminal")
        fields = [*transition(task, to, actor=f"worker:{run.lease.worker_id}", reason=reason)]
        fields += task.drop_lease(fence=False)
        if to == Status.COMPLETED:
            task.result, task.progress = result, 1.0
            fields += ["result", "progress"]
        task.save(update_fields=fields)
    return True


def _stop(lease: leases.Lease, to: str, *, reason: str, error: dict[str, Any], message: str = "") -> None:
    """Fail or dead-letter without a checkpoint (there is nothing trustworthy to record).

    A kill accepted while a call that had to finish was in flight (kills.must_finish) kept
    our lease so the call could return: if the step then fails, the kill still ends the
    task (cancelled, "killed: <reason>"), as its answer promised, not the step's failure."""
    with transaction.atomic(durable=True):
        task = leases.fenced(lease)
        if task.kill_requested:
            steering.apply_pending(task, actor=f"worker:{lease.worker_id}")
            task.drop_lease(fence=False)
            task.save(update_fields=steering.STEERING_FIELDS)
            return
        # Ended (failed), its pending commands are rejected by the transition (steering's
        # settle_on_end); dead-lettered keeps them: a redrive applies them, a close settles them.
        fields = transition(task, to, actor=f"worker:{lease.worker_id}", reason=reason, data={"error": error})
        # The error quotes what failed (a tool's answer, an exception's text): masked like
        # the audit record and the event, since snapshots show it to everyone who can read.
        task.error, task.status_message = redact(error), redact(message)
        task.save(update_fields=[*fields, "error", *task.drop_lease(fence=False)])
