from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from django.conf import settings
from django.db import models, transaction
from django.db.models import F, Q
from django.db.models.sql import UpdateQuery

from tasks_app.states import TERMINAL, Status, to_mcp_status

if TYPE_CHECKING:
    from django.contrib.auth.base_user import AbstractBaseUser

    from tasks_app.auth import Principal


class Tenant(models.Model):
    slug = models.SlugField(max_length=64, unique=True)
    name = models.CharField(max_length=200)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return self.slug


class Role(models.TextChoices):
    VIEWER = "viewer"
    OPERATOR = "operator"
    APPROVER = "approver"
    ADMIN = "admin"


# Each role can do everything the roles before it can.
ROLE_RANK = {Role.VIEWER: 0, Role.OPERATOR: 1, Role.APPROVER: 2, Role.ADMIN: 3}


class Scope(models.TextChoices):
    """What an API key may do, at most what its role allows: a key can be narrower than
    its holder (a read-only key for a dashboard exporter, an approve-only key for a bot)."""

    READ = "read"
    OPERATE = "operate"
    APPROVE = "approve"


# The scope each role's powers need; an admin's powers need every scope.
ROLE_SCOPES: dict[str, frozenset[str]] = {
    Role.VIEWER: frozenset({Scope.READ}),
    Role.OPERATOR: frozenset({Scope.OPERATE}),
    Role.APPROVER: frozenset({Scope.APPROVE}),
    Role.ADMIN: frozenset(Scope),
}


def scopes_within(role: str) -> frozenset[str]:
    """Every scope a key of this role may carry."""
    return frozenset().union(*(ROLE_SCOPES[r] for r in Role if ROLE_RANK[r] <= ROLE_RANK[Role(role)]))


class Membership(models.Model):
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="memberships")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=16, choices=Role.choices)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["tenant", "user"], name="membership_unique")]


class ApiKey(models.Model):
    """A bearer key `rt_<prefix>_<secret>`: the prefix finds the row, the hash proves the secret.

    The secret is 32 random bytes, so a plain sha256 is enough (no password stretching
    needed for high-entropy tokens); the full key is shown once, at creation.
    """

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="api_keys")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_keys")
    role = models.CharField(max_length=16, choices=Role.choices)
    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=16, unique=True)
    key_hash = models.CharField(max_length=64)
    # What the key may do; empty: everything its role allows (tasks_app.auth.effective_scopes).
    scopes = models.JSONField(default=list, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    # Written at most once a minute per key (tasks_app.auth.LAST_USED_EVERY), not on every request.
    last_used_at = models.DateTimeField(null=True, blank=True, editable=False)
    # The key this one replaced (rotation): both work until the old one's expires_at.
    rotated_from = models.ForeignKey("self", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix})"


class TaskQuerySet(models.QuerySet["Task"]):
    def for_tenant(self, tenant: Tenant | int) -> TaskQuerySet:
        """The one tenant filter: every "this tenant's tasks" goes through here."""
        return self.filter(tenant=tenant)

    def visible_to(self, who: Principal | AbstractBaseUser) -> TaskQuerySet:
        """A principal's tenant's tasks; for a signed-in person, those of every tenant they
        are a member of (tasks_app.access)."""
        tenant = getattr(who, "tenant", None)
        if tenant is not None:
            return self.for_tenant(tenant)
        return self.filter(tenant__memberships__user=who)

    def update_returning(self, fields: Sequence[str] | None = None, **values: Any) -> list[Any]:
        """update(**values) that also reads back, from each row it changed and in the same
        statement (UPDATE ... RETURNING), what the update left: `fields` as tuples, or
        whole tasks (fields None). An update and a read of it took two round trips, and
        the read was right only while the update's row lock was held."""
        query = cast(UpdateQuery, self.query.chain(UpdateQuery))
        query.add_update_values(values)
        query.annotations = {}
        meta = self.model._meta
        names = list(fields) if fields is not None else [f.attname for f in meta.concrete_fields]
        returning = [meta.get_field(name) for name in names]
        with transaction.mark_for_rollback_on_error(using=self.db):
            rows = query.get_compiler(self.db).execute_returning_sql(returning)
        if fields is not None:
            return [tuple(row) for row in rows]
        return [self.model.from_db(self.db, names, row) for row in rows]


def from_rows[M: models.Model](
    model: type[M], names: Sequence[str], rows: Sequence[Sequence[Any]], using: str = "default"
) -> list[M]:
    """Rows of `names` columns, read by SQL written by hand, as instances of `model`,
    converted as the ORM's own reads convert them (JSON text decoded, and so on)."""
    compiler = model._base_manager.db_manager(using).all().query.get_compiler(using)
    table = model._meta.db_table
    fields = [cast("models.Field[Any, Any]", model._meta.get_field(name)) for name in names]
    converters = compiler.get_converters([field.get_col(table) for field in fields])
    converted = compiler.apply_converters(rows, converters) if converters else rows
    return [model.from_db(using, list(names), list(row)) for row in converted]


class Task(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="tasks")
    created_by = models.CharField(max_length=100)  # actor string, e.g. "user:7"
    agent = models.CharField(max_length=100)
    input = models.JSONField(default=dict)
    goal = models.TextField(blank=True)
    constraints = models.JSONField(default=dict)  # set by adjust_goal; the agent re-plans to them

    status = models.CharField(max_length=20, choices=Status.choices, default=Status.QUEUED)
    status_message = models.CharField(max_length=500, blank=True)
    progress = models.FloatField(default=0.0)
    phase = models.CharField(max_length=100, blank=True)
    state_version = models.BigIntegerField(default=1)
    plan_version = models.IntegerField(default=1)
    # The highest step sequence ever committed: never lowered, also when a crash makes steps
    # after the last checkpoint run again (engine._commit_step), so snapshots never go back.
    steps_done = models.IntegerField(default=0)

    lease_owner = models.CharField(max_length=200, null=True, blank=True)  # noqa: DJ001 (NULL: nobody holds it)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    lease_epoch = models.BigIntegerField(default=0)  # +1 on every claim: the fencing token
    # Workers lost (and steps abandoned past their deadline) since creation or the last redrive.
    recoveries = models.IntegerField(default=0)
    # What runtime.max_recoveries caps: recoveries in a row without progress, i.e. without a
    # step committed beyond recovered_at_step, the high-water mark (steps_done) at the last
    # recovery. Both are read and written by the reaper only (operators._recover), never by a
    # step's commit: a task that loses its workers now and then over days but gets further
    # each time is delayed, never dead-lettered; a step that kills every worker running it
    # is held for an operator.
    # A default in the database too: the previous release's code, still running during a
    # rolling deploy, inserts tasks without these columns.
    recoveries_in_a_row = models.IntegerField(default=0, db_default=0)
    recovered_at_step = models.IntegerField(default=0, db_default=0)
    # Slices abandoned to an infrastructure error (tasks_app.faults): retried, never counted as crashes.
    infra_faults = models.IntegerField(default=0)
    # The W3C traceparent of the request that created the task (empty with tracing off): a
    # slice rung by the reaper, a steering command or a redrive joins the task's trace again.
    trace_context = models.CharField(max_length=256, blank=True, default="")
    # Turned away at its tenant's runtime.max_concurrent_tasks: the next freed turn rings it.
    waiting_turn_since = models.DateTimeField(null=True, blank=True)
    cancel_requested = models.BooleanField(default=False)
    cancel_reason = models.CharField(max_length=500, blank=True)
    # A kill was accepted (tasks_app.kills): leases refuse to renew, so its worker sends and
    # writes nothing more of the step; cleared by a redrive.
    kill_requested = models.BooleanField(default=False)
    steering_head = models.BigIntegerField(default=0)  # version of the newest accepted steering command

    priority = models.SmallIntegerField(default=5)
    checkpoint_policy = models.JSONField(default=dict)
    approval_policy = models.JSONField(default=dict)
    budget = models.JSONField(default=dict)  # tasks_app.policy.LIMITS
    cost = models.FloatField(default=0.0)  # reported by steps (ctx.report_cost); maxCost compares with it

    # NULL, not "": a task created without a key, which the unique constraint below leaves out.
    idempotency_key = models.CharField(max_length=200, null=True, blank=True)  # noqa: DJ001
    request_fingerprint = models.CharField(max_length=64, blank=True)

    result = models.JSONField(null=True, blank=True)
    error = models.JSONField(null=True, blank=True)
    event_seq = models.BigIntegerField(default=0)
    audit_seq = models.IntegerField(default=0)
    audit_head = models.CharField(max_length=64, blank=True)  # hash of the newest AuditRecord
    # The newest audit_seq written to an anchor outside the database (tasks_app.audit.anchor_heads).
    audit_anchored_seq = models.IntegerField(default=0)

    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True)

    objects = TaskQuerySet.as_manager()

    # Who runs the task, until when, and the fencing token (tasks_app/leases.py).
    LEASE_FIELDS = ("lease_owner", "lease_expires_at", "lease_epoch")
    # What steering and cancel change on the row beside its status and lease, also while a
    # worker runs it (steering_app.actions.STEERING_FIELDS is these, the transition's and the
    # lease's; the engine reads them back with each step's commit: engine.FRESH).
    CONTROL_FIELDS = (
        "goal",
        "constraints",
        "plan_version",
        "priority",
        "cancel_requested",
        "cancel_reason",
        "kill_requested",
        "steering_head",
    )

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "idempotency_key"],
                condition=Q(idempotency_key__isnull=False),
                name="task_idempotency_key_per_tenant",
            )
        ]
        indexes = [
            # GET /runtime/tasks: a tenant's tasks newest first, optionally by status.
            models.Index(fields=["tenant", "-created_at", "-id"], name="task_tenant_created"),
            models.Index(fields=["tenant", "status", "-created_at"], name="task_tenant_status"),
            # runtime.max_concurrent_tasks: a tenant's running (leased) tasks, counted at each claim,
            # and those turned away, rung when a turn frees.
            models.Index(fields=["tenant"], name="task_leased_by_tenant", condition=Q(lease_owner__isnull=False)),
            models.Index(
                fields=["tenant", "priority", "waiting_turn_since"],
                name="task_waiting_turn",
                condition=Q(waiting_turn_since__isnull=False),
            ),
            # scan_leases: runnable tasks by lease expiry.
            models.Index(
                fields=["lease_expires_at"],
                name="task_lease_expiry",
                condition=Q(status__in=["queued", "working", "recovering", "pausing"]),
            ),
            # anchor_audit: chains that grew since their last anchor.
            models.Index(
                fields=["id"], name="task_audit_unanchored", condition=Q(audit_seq__gt=F("audit_anchored_seq"))
            ),
        ]

    def __str__(self) -> str:
        return f"{self.agent} {self.id}"

    def drop_lease(self, *, fence: bool = True) -> list[str]:
        """Nobody holds the task any more. fence: also move the epoch, so a worker that
        still believes it holds the task fails its next fenced write (an operator, the
        reaper, a cancel); without, the holder itself lets go (its epoch stays its proof
        until then). Returns the fields to save. A slice lets go of its own lease here as it
        ends; every other drop goes through leases.take_away, which also rings the tasks
        waiting for the turn."""
        self.lease_owner, self.lease_expires_at = None, None
        if not fence:
            return ["lease_owner", "lease_expires_at"]
        self.lease_epoch += 1
        return list(self.LEASE_FIELDS)

    @property
    def is_terminal(self) -> bool:
        return self.status in TERMINAL

    @property
    def mcp_status(self) -> str:
        return to_mcp_status(self.status)

    def status_text(self) -> str:
        """Why a task that shows as MCP "working" is not simply working."""
        if self.status_message:
            return self.status_message
        texts: dict[str, str] = {
            Status.QUEUED: "queued",
            Status.PAUSING: "pausing",
            Status.PAUSED: "paused",
            Status.RECOVERING: "recovering after a worker loss",
            Status.DEAD_LETTERED: "held for operator",
        }
        return texts.get(self.status, "")


class Step(models.Model):
    class StepStatus(models.TextChoices):
        SUCCEEDED = "succeeded"
        FAILED = "failed"

    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT)
    task = models.ForeignKey(Task, on_delete=models.CASCADE, related_name="steps")
    sequence = models.IntegerField()  # 1-based position in the task's run
    attempt = models.IntegerField(default=1)  # > 1 only when a crash forced a re-run from a checkpoint
    name = models.CharField(max_length=200)
    status = models.CharField(max_length=16, choices=StepStatus.choices)
    worker = models.CharField(max_length=200)
    lease_epoch = models.BigIntegerField()
    started_at = models.DateTimeField()
    finished_at = models.DateTimeField()
    duration_ms = models.FloatField()
    output = models.JSONField(default=dict)  # a small summary, never a transcript

    class Meta:
        constraints = [models.UniqueConstraint(fields=["task", "sequence", "attempt"], name="step_unique_attempt")]


class AuditRecord(models.Model):
    """Append-only and hash-chained per task; written in the transaction of the change."""

    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT)
    task = models.ForeignKey(Task, on_delete=models.CASCADE, related_name="audit_records")
    seq = models.IntegerField()
    actor = models.CharField(max_length=200)
    action = models.CharField(max_length=50)
    from_status = models.CharField(max_length=20, blank=True)
    to_status = models.CharField(max_length=20, blank=True)
    before_version = models.BigIntegerField()
    after_version = models.BigIntegerField()
    reason = models.CharField(max_length=1000, blank=True)
    data = models.JSONField(default=dict)
    created_at = models.DateTimeField()
    prev_hash = models.CharField(max_length=64)
    hash = models.CharField(max_length=64)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["task", "seq"], name="audit_unique_seq")]
        ordering = ["task", "seq"]

    def chained_fields(self) -> dict[str, Any]:
        """Exactly what the hash covers (tasks_app.audit)."""
        return {
            "task": str(self.task_id),
            "seq": self.seq,
            "actor": self.actor,
            "action": self.action,
            "from_status": self.from_status,
            "to_status": self.to_status,
            "before_version": self.before_version,
            "after_version": self.after_version,
            "reason": self.reason,
            "data": self.data,
            "created_at": self.created_at.isoformat(),
            "prev_hash": self.prev_hash,
        }


class TaskEvent(models.Model):
    """What a stream client sees, stored with the task's seq in the change's transaction."""

    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT)
    task = models.ForeignKey(Task, on_delete=models.CASCADE, related_name="events")
    seq = models.BigIntegerField()
    type = models.CharField(max_length=50)
    data = models.JSONField(default=dict)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["task", "seq"], name="event_unique_seq")]


class TenantDailyUsage(models.Model):
    """What a tenant used on one UTC day, against limits.tool_calls_per_tenant_day and
    limits.cost_per_tenant_day (tasks_app/quotas.py). Written in the transaction that makes
    the use durable (the ledger row of a call, the commit of a step's cost), so a crash
    neither loses nor doubles a count."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="daily_usage")
    day = models.DateField()
    tool_calls = models.IntegerField(default=0)
    cost = models.FloatField(default=0.0)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["tenant", "day"], name="tenant_daily_usage_unique")]
