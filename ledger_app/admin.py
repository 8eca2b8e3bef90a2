from django.contrib import admin

from ledger_app.models import LedgerEntry


@admin.register(LedgerEntry)
class LedgerEntryAdmin(admin.ModelAdmin):
    list_display = ["key", "tool", "status", "attempts", "task", "created_at", "updated_at"]
    list_filter = ["status", "tool"]
    search_fields = ["key"]
    raw_id_fields = ["task"]

    def has_change_permission(self, request, obj=None):  # a settled effect is history
        return False
