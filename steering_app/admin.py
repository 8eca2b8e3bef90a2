from django.contrib import admin

from steering_app.models import InputRequest, SteeringCommand


@admin.register(SteeringCommand)
class SteeringCommandAdmin(admin.ModelAdmin):
    list_display = ["task", "version", "command_id", "type", "status", "requested_by", "created_at", "applied_at"]
    list_filter = ["type", "status"]
    search_fields = ["command_id", "task__id"]
    raw_id_fields = ["task"]

    def has_change_permission(self, request, obj=None):  # applied through the engine only
        return False


@admin.register(InputRequest)
class InputRequestAdmin(admin.ModelAdmin):
    list_display = ["task", "key", "kind", "status", "answered_by", "created_at"]
    list_filter = ["kind", "status"]
    raw_id_fields = ["task"]

    def has_change_permission(self, request, obj=None):  # answered through the API (audited)
        return False
