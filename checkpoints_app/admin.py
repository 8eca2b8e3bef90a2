from django.contrib import admin

from checkpoints_app.models import Checkpoint


@admin.register(Checkpoint)
class CheckpointAdmin(admin.ModelAdmin):
    list_display = [
        "task",
        "sequence",
        "step_name",
        "reason",
        "schema_version",
        "plan_version",
        "discarded",
        "created_at",
    ]
    list_filter = ["reason", "discarded"]
    raw_id_fields = ["task"]

    def has_change_permission(self, request, obj=None):  # checksummed: never edited by hand
        return False
