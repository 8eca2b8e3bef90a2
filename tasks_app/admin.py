from django.contrib import admin

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
