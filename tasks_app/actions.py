"""Cross-cutting writes on tasks: one transaction each, audited, events stored with them."""

from __future__ import annotations

from contextlib import nullcontext
from datetime import timedelta
from typing import Any, Protocol

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from common import json_safety
from common.canonical import canonical_json, sha256_hex
from common.schema import validate
from runtime_site.tracing import trace_headers
from tasks_app import audit, events, leases, policy
from tasks_app.access import check_role
from tasks_app.agents import base as agents
from tasks_app.audit import record_audit
from tasks_app.auth import Principal
from tasks_app.errors import IdempotencyConflict, IllegalTransition, QuotaExceeded
from tasks_app.models import Role, Task, Tenant
from tasks_app.queue import enqueue_slice_on_commit
from tasks_app.selectors import task_snapshot
from tasks_app.states import TERMINAL, Status, can_transition


def _queue_cap() -> int:
    """limits.queued_tasks_per_tenant (0: none)."""
    return int(settings.RUNTIME.get("limits", {}).get("queued_tasks_per_tenant", 0))


def _check_queue_cap(tenant: Tenant, *, idempotency_key: str | None, fingerprint: str) -> Task | None:
    """In the creating transaction: the tenant row is locked so two creates cannot both
    take the last place in the queue. Returns the task a create with the same
    Idempotency-Key committed while this one waited for the lock (answered as its replay),
    or None: there is room, create."""
    cap = _queue_cap()
    if not cap:
        return None
    list(Tenant.objects.select_for_update(no_key=True).filter(pk=tenant.pk).values_list("pk", flat=True))
    if Task.objects.for_tenant(tenant).filter(status=Status.QUEUED).count() >= cap:
        # The key was looked up before the lock. Two creates with the same key at the last
        # place both missed it there; the one that waited here found the queue filled by the
        # other's task, its own. Under the lock this statement sees that commit (READ
        # COMMITTED), so the second answers as the replay it is, never 429 for a key whose
        # task exists. Looked up only here: a create with room pays nothing for it (its
        # insert meets the key's unique constraint instead).
        if idempotency_key is not None and (existing := _replay(tenant, idempotency_key, fingerprint)):
            return existing
        raise QuotaExceeded(
            f"this tenant already has {cap} queued tasks (limits.queued_tasks_per_tenant); "
            "start more once some have started"
        )
    return None


class EndedHook(Protocol):
    def __call__(self, task: Task, *, actor: str, by_command: object | None) -> None: ...


# What must happen when a task ends, whichever path ends it: each hook runs in transition(),
# in the ending transaction, on the locked or fenced row. The satellites register theirs in
# their AppConfig.ready() (steering_app: settle_on_end), so task core imports none of them.
_ENDED_HOOKS: list[EndedHook] = []


def on_task_ended(hook: EndedHook) -> None:
    """Register `hook(task, actor=..., by_command=...)`, called by every transition to a
    terminal status after its audit record and its terminal event. It may audit and emit on
    the task; the row's own fields stay the transition's caller's to save. Registering again
    adds nothing."""
    if hook not in _ENDED_HOOKS:
        _ENDED_HOOKS.append(hook)


def transition(
    task: Task,
    to: str,
    *,
    actor: str,
    reason: str = "",
    data: dict[str, Any] | None = None,
    by_command: object | None = None,
) -> list[str]:
    """In-transaction helper on a locked or fenced row: status, version, audit, events.
    Returns the fields to save (TRANSITION_FIELDS: with the status message, which callers
    set beside it); the caller saves them with any it changed itself. A task that ends
    (TERMINAL) runs the ended hooks (on_task_ended) here, as `actor`.

    by_command: the command being applied that makes this transition (steering's cancel or
    kill), handed to the ended hooks as it is; task core does not look into it."""
    if not can_transition(task.status, to):
        raise IllegalTransition(task.status, to)
    before, from_status = task.state_version, task.status
    task.status, task.state_version = to, task.state_version + 1
    if to in TERMINAL:
        task.finished_at = timezone.now()
    record_audit(
        task,
        actor=actor,
        action="transition",
        from_status=from_status,
        to_status=to,
        before_version=before,
        reason=reason,
        data=data,
    )
    if to in TERMINAL:
        events.emit(task, "terminal", {"status": task.mcp_status, "runtimeStatus": to, "reason": reason})
        for hook in _ENDED_HOOKS:
            hook(task, actor=actor, by_command=by_command)
    elif to == Status.DEAD_LETTERED:
        events.emit(task, "dead_lettered", {"reason": reason})
    return list(TRANSITION_FIELDS)


TRANSITION_FIELDS = ["status", "state_version", "finished_at", "status_message", "updated_at"]


CHECKPOINT_POLICY_SCHEMA = {
    "type": "object",
    "properties": {"everySteps": {"type": "integer", "minimum": 1}, "maxSeconds": {"type": "number", "minimum": 1}},
    "additionalProperties": False,
}


def _fingerprint(body: dict[str, Any]) -> str:
    return sha256_hex(canonical_json(body))


def do_create_task(
    who: Principal,
    *,
    agent: str,
    input: dict[str, Any],
    goal: str = "",
    checkpoint_policy: dict[str, Any] | None = None,
    approval_policy: dict[str, Any] | None = None,
    budget: dict[str, Any] | None = None,
    priority: int = 5,
    idempotency_key: str | None = None,
    ttl_seconds: int | None = None,
) -> tuple[Task, bool]:
    """Validate and create a task in `who`'s tenant, started by `who` (the operator role:
    Forbidden otherwise); enqueue its first slice on commit.

    Returns (task, created). With an Idempotency-Key, a replay of the same body returns
    the original task; the same key with another body raises IdempotencyConflict.
    """
    check_role(who, Role.OPERATOR)
    tenant, actor = who.tenant, who.actor
    # The last line, whatever the edge (REST, MCP, dashboard, admin, a script): UnsafeInput.
    json_safety.check(
        {
            "agent": agent,
            "input": input,
            "goal": goal,
            "checkpointPolicy": checkpoint_policy,
            "approvalPolicy": approval_policy,
            "budget": budget,
            "priority": priority,
            "idempotencyKey": idempotency_key,
            "ttlSeconds": ttl_seconds,
            "actor": actor,
        }
    )
    definition = agents.get_agent(agent)  # UnknownAgent
    validate(input, definition.input_schema, "input")  # SchemaError
    validate(checkpoint_policy or {}, CHECKPOINT_POLICY_SCHEMA, "checkpointPolicy")
    validate(budget or {}, policy.BUDGET_SCHEMA, "budget")
    validate(approval_policy or {}, policy.APPROVAL_POLICY_SCHEMA, "approvalPolicy")
    approval_policy = policy.canonical_approval_policy(approval_policy or {})
    body = {
        "agent": agent,
        "input": input,
        "goal": goal,
        "checkpointPolicy": checkpoint_policy or {},
        "approvalPolicy": approval_policy or {},
        "budget": budget or {},
        "priority": priority,
        "ttlSeconds": ttl_seconds,
    }
    fingerprint = _fingerprint(body)
    if idempotency_key is not None and (existing := _replay(tenant, idempotency_key, fingerprint)):
        return existing, False
    task = Task(
        tenant=tenant,
        created_by=actor,
        agent=agent,
        input=input,
        goal=goal,
        checkpoint_policy=checkpoint_policy or {},
        approval_policy=approval_policy or {},
        budget=budget or {},
        priority=priority,
        idempotency_key=idempotency_key,
        request_fingerprint=fingerprint,
        trace_context=trace_headers().get("traceparent", "")[:256],
        expires_at=timezone.now() + timedelta(seconds=ttl_seconds) if ttl_seconds else None,
    )
    # The row is inserted as it is here (leases.insert_task), so the snapshot says what it says.
    task.created_at = task.updated_at = timezone.now()
    # A new task's chain starts here, and its events at seq 1: nothing else can have written them.
    record = audit.next_record(
        task, actor=actor, action="created", to_status=task.status, before_version=0, data={"agent": agent}
    )
    task.event_seq = 1
    # Just created: no checkpoint, no input request, nothing to read for them.
    snapshot = task_snapshot(task, last_checkpoint=None, no_open_inputs=True)
    created = events.numbered(events.prepare(task, [("task.snapshot", snapshot)]), task.event_seq)
    # On PostgreSQL the inserts are one statement, a transaction of its own. One is opened
    # around it for what must share it (the queue cap's lock and count), where the inserts
    # are several (SQLite), and inside a caller's transaction, which durable refuses: the
    # first slice is rung once the task is committed, not when a caller's transaction may.
    alone = leases.one_statement_writes() and not _queue_cap() and not transaction.get_connection().in_atomic_block
    try:
        with nullcontext() if alone else transaction.atomic(durable=True):
            # After the replay: a retried create is never refused.
            if raced := _check_queue_cap(tenant, idempotency_key=idempotency_key, fingerprint=fingerprint):
                return raced, False
            leases.insert_task(task, rows=[leases.Row(record), *(leases.Row(event) for event in created)])
            # Rung first of what the commit sends: the worker starts while the snapshot is published.
            enqueue_slice_on_commit(task.id, task.priority, about=(agent, tenant.slug, task.trace_context))
            events.publish_on_commit(task.id, created)
    except IntegrityError:
        # A concurrent request with the same key won the insert; answer as its replay.
        if idempotency_key is not None and (existing := _replay(tenant, idempotency_key, fingerprint)):
            return existing, False
        raise
    return task, True


def _replay(tenant: Tenant, key: str, fingerprint: str) -> Task | None:
    existing = Task.objects.for_tenant(tenant).filter(idempotency_key=key).first()
    if existing is not None and existing.request_fingerprint != fingerprint:
        raise IdempotencyConflict(existing.id)
    return existing
