from django.contrib import admin, messages

from tasks_app import recovery
from tasks_app.actions import IllegalTransition, do_cancel_task
from tasks_app.models import ApiKey, AuditRecord, Membership, Step, Task, Tenant


@admin.register(Tenant)
class TenantAdmin(admin.ModelAdmin):
    list_display = ["slug", "name", "created_at"]


@admin.register(Membership)
class MembershipAdmin(admin.ModelAdmin):
    list_display = ["tenant", "user", "role"]


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = ["name", "prefix", "tenant", "role", "created_at", "revoked_at"]
    readonly_fields = ["prefix", "key_hash"]


@admin.register(Task)
class TaskAdmin(admin.ModelAdmin):
    list_display = ["id", "tenant", "agent", "status", "progress", "state_version", "lease_owner",
                    "lease_expires_at", "updated_at"]
    list_filter = ["status", "agent", "tenant"]
    search_fields = ["id", "idempotency_key"]
    # Status, versions, leases and the audit head change only through actions.
    readonly_fields = ["status", "state_version", "plan_version", "lease_owner", "lease_expires_at",
                       "lease_epoch", "event_seq", "audit_seq", "audit_head", "steps_done", "recoveries"]
    actions = ["redrive", "cancel", "release_lease", "close"]

    def _each(self, request, queryset, verb: str, action) -> None:
        """Operators change tasks only through the same domain functions as the API, audited."""
        actor = f"admin:{request.user.username}"
        for task in queryset:
            try:
                action(task, actor)
                self.message_user(request, f"{task.id}: {verb}")
            except (IllegalTransition, recovery.NoLease) as exc:
                self.message_user(request, f"{task.id}: {exc}", level=messages.WARNING)

    @admin.action(description="Redrive a dead letter from its last good checkpoint")
    def redrive(self, request, queryset):
        self._each(request, queryset, "redriven", lambda t, actor: recovery.do_redrive_task(
            t.id, actor=actor, reason="redriven by an operator in admin"))

    @admin.action(description="Cancel (lands at the next safe point)")
    def cancel(self, request, queryset):
        self._each(request, queryset, "cancel requested", lambda t, actor: do_cancel_task(
            t.id, tenant=t.tenant, actor=actor, reason="cancelled by an operator in admin"))

    @admin.action(description="Release a stale lease (fences the holder)")
    def release_lease(self, request, queryset):
        self._each(request, queryset, "lease released", lambda t, actor: recovery.do_release_lease(
            t.id, actor=actor, reason="released by an operator in admin"))

    @admin.action(description="Close a dead letter as failed")
    def close(self, request, queryset):
        self._each(request, queryset, "closed", lambda t, actor: recovery.do_close_task(
            t.id, actor=actor, reason="closed by an operator in admin"))


@admin.register(Step)
class StepAdmin(admin.ModelAdmin):
    list_display = ["task", "sequence", "attempt", "name", "status", "worker", "duration_ms"]
    raw_id_fields = ["task"]


@admin.register(AuditRecord)
class AuditRecordAdmin(admin.ModelAdmin):
    list_display = ["task", "seq", "actor", "action", "from_status", "to_status", "created_at"]
    raw_id_fields = ["task"]

    def has_change_permission(self, request, obj=None):  # append-only
        return False
