from django.contrib import admin, messages

from ledger_app.actions import ToolFailed
from ledger_app.models import LedgerEntry
from tasks_app import access
from tasks_app.operators import do_resolve_unknown


@admin.register(LedgerEntry)
class LedgerEntryAdmin(admin.ModelAdmin):
    list_display = ["key", "tool", "status", "attempts", "task", "created_at", "updated_at"]
    list_filter = ["status", "tool"]
    search_fields = ["key"]
    raw_id_fields = ["task"]
    actions = ["resolve_succeeded", "resolve_failed"]

    def has_change_permission(self, request, obj=None):  # a settled effect is history
        return False

    def _resolve(self, request, queryset, succeeded: bool) -> None:
        for entry in queryset:
            try:
                do_resolve_unknown(
                    entry.id,
                    succeeded=succeeded,
                    who=access.console(entry.task.tenant, f"admin:{request.user.username}"),
                    reason="reconciled by hand in admin",
                )
                self.message_user(request, f"{entry.key}: resolved as {'succeeded' if succeeded else 'failed'}")
            except ToolFailed as exc:
                self.message_user(request, str(exc), level=messages.WARNING)

    @admin.action(description="Resolve unknown effect: it happened (succeeded)")
    def resolve_succeeded(self, request, queryset):
        self._resolve(request, queryset, succeeded=True)

    @admin.action(description="Resolve unknown effect: it did not happen (failed)")
    def resolve_failed(self, request, queryset):
        self._resolve(request, queryset, succeeded=False)
