from datetime import timedelta
from typing import Any
from uuid import uuid4

from django import forms
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.options import IncorrectLookupParameters
from django.contrib.admin.views.main import ChangeList
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html

from checkpoints_app.models import Checkpoint
from ledger_app.models import LedgerEntry
from steering_app.actions import do_cancel_task, do_enqueue_command
from steering_app.models import CommandType, InputRequest, SteeringCommand
from tasks_app import access, kills, operators
from tasks_app.auth import Principal, check_key_grant, issue_api_key, revoke_api_key, rotate_api_key
from tasks_app.errors import DomainError
from tasks_app.models import ApiKey, AuditRecord, Membership, Scope, Step, Task, Tenant


@admin.register(Tenant)
class TenantAdmin(admin.ModelAdmin):
    list_display = ["slug", "name", "created_at"]


@admin.register(Membership)
class MembershipAdmin(admin.ModelAdmin):
    list_display = ["tenant", "user", "role"]


class ApiKeyForm(forms.ModelForm):
    scopes = forms.MultipleChoiceField(
        choices=Scope.choices,
        required=False,
        widget=forms.CheckboxSelectMultiple,
        help_text="none: everything the role allows",
    )

    class Meta:
        model = ApiKey
        fields = ["tenant", "user", "role", "name", "scopes", "expires_at"]

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        try:
            check_key_grant(data.get("role") or "", data.get("scopes"))
        except ValueError as exc:
            raise forms.ValidationError(str(exc)) from None
        return data


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    """Keys are made here with the token shown once (in the message after saving), rotated
    (the old key lives on for the grace period) and revoked; the hash is never shown."""

    form = ApiKeyForm
    list_display = [
        "name",
        "prefix",
        "tenant",
        "user",
        "role",
        "scopes",
        "created_at",
        "expires_at",
        "last_used_at",
        "revoked_at",
    ]
    list_filter = ["tenant", "role"]
    readonly_fields = ["prefix", "created_at", "last_used_at", "revoked_at", "rotated_from"]
    actions = ["rotate", "revoke"]

    def get_fields(self, request, obj=None):
        fields = ["tenant", "user", "role", "name", "scopes", "expires_at"]
        return fields if obj is None else [*fields, *self.readonly_fields]

    def get_readonly_fields(self, request, obj=None):
        # What a key grants is fixed once it exists: a different grant is a new key.
        return [*self.readonly_fields, "tenant", "user", "role", "scopes"] if obj else self.readonly_fields

    def save_model(self, request, obj, form, change):
        if change:
            obj.save(update_fields=["name", "expires_at"])
            return
        key, token = issue_api_key(
            obj.tenant, obj.user, role=obj.role, name=obj.name, scopes=obj.scopes, expires_at=obj.expires_at
        )
        obj.pk, obj.prefix = key.pk, key.prefix
        self.message_user(request, f"The new key, shown only this once: {token}", level=messages.SUCCESS)

    @admin.action(description="Rotate: a new key; the old one expires after the grace period")
    def rotate(self, request, queryset):
        for key in queryset:
            try:
                new, token = rotate_api_key(key)
            except ValueError as exc:
                self.message_user(request, f"{key.prefix}: {exc}", level=messages.WARNING)
                continue
            self.message_user(
                request,
                f"{key.prefix} rotated; the new key {new.prefix}, shown only this once: {token}",
                level=messages.SUCCESS,
            )

    @admin.action(description="Revoke: the keys stop working at once")
    def revoke(self, request, queryset):
        for key in queryset:
            revoke_api_key(key)
        self.message_user(request, f"{queryset.count()} key(s) revoked")


class AgeFilter(admin.SimpleListFilter):
    """How long ago the task was created: finds the old, stuck ones quickly."""

    title = "age"
    parameter_name = "age"
    BUCKETS = {"1h": timedelta(hours=1), "1d": timedelta(days=1), "7d": timedelta(days=7)}

    def lookups(self, request, model_admin):
        return [("1h", "under an hour"), ("1d", "under a day"), ("7d", "under a week"), ("old", "a week or more")]

    def queryset(self, request, queryset):
        now = timezone.now()
        if (bucket := self.BUCKETS.get(self.value() or "")) is not None:
            return queryset.filter(created_at__gte=now - bucket)
        if self.value() == "old":
            return queryset.filter(created_at__lt=now - self.BUCKETS["7d"])
        return queryset


class ReadOnlyInline(admin.TabularInline):
    """History shown beside the task; each row links to its own (read-only) admin page."""

    extra = 0
    can_delete = False
    show_change_link = True

    def get_readonly_fields(self, request, obj=None):
        return self.fields

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False


class CheckpointInline(ReadOnlyInline):
    model = Checkpoint
    fields = [
        "sequence",
        "step_name",
        "reason",
        "schema_version",
        "plan_version",
        "discarded",
        "checksum",
        "created_at",
    ]
    ordering = ["sequence", "id"]


class SteeringInline(ReadOnlyInline):
    model = SteeringCommand
    fields = [
        "version",
        "command_id",
        "type",
        "payload",
        "status",
        "outcome",
        "requested_by",
        "reason",
        "created_at",
        "applied_at",
    ]
    ordering = ["version"]


class InputRequestInline(ReadOnlyInline):
    model = InputRequest
    fields = ["key", "kind", "status", "prompt", "answer", "answered_by", "created_at"]
    ordering = ["id"]


class LedgerInline(ReadOnlyInline):
    model = LedgerEntry
    verbose_name_plural = "ledger entries"
    fields = ["key", "tool", "status", "attempts", "remote_ref", "error", "updated_at"]
    ordering = ["step_sequence", "call_index"]


class AuditInline(ReadOnlyInline):
    model = AuditRecord
    fields = [
        "seq",
        "actor",
        "action",
        "from_status",
        "to_status",
        "before_version",
        "after_version",
        "reason",
        "created_at",
    ]
    ordering = ["seq"]


class CancelForm(forms.Form):
    reason = forms.CharField(
        max_length=500,
        widget=forms.TextInput(attrs={"size": 80}),
        help_text="Recorded in each task's audit chain with you as the actor.",
    )


class DateDrillDownChangeList(ChangeList):
    """Django's date_hierarchy builds its range from ?created_at__year/month/day and only
    catches part of what a date cannot be: a year of 9999 (its end is year 10,000) or one
    beyond a C long raise OverflowError or ValueError, a 500. Here each is a bad filter,
    which the admin answers by going back to the list (?e=1)."""

    def get_filters(self, request):
        try:
            return super().get_filters(request)
        except (OverflowError, ValueError) as exc:
            raise IncorrectLookupParameters(exc) from exc


@admin.register(Task)
class TaskAdmin(admin.ModelAdmin):
    list_display = [
        "id",
        "tenant",
        "agent",
        "status",
        "progress",
        "phase",
        "state_version",
        "lease_owner",
        "lease_expires_at",
        "recoveries",
        "created_at",
        "updated_at",
    ]
    list_filter = ["status", AgeFilter, "agent", "tenant"]
    list_select_related = ["tenant"]
    search_fields = ["id", "idempotency_key", "tenant__slug", "agent", "goal", "lease_owner", "created_by"]
    date_hierarchy = "created_at"
    # Steps can run to thousands: a link to their filtered list rather than an inline.
    inlines = [CheckpointInline, SteeringInline, InputRequestInline, LedgerInline, AuditInline]
    actions = ["redrive", "cancel", "kill", "release_lease", "close"]

    def get_readonly_fields(self, request, obj=None):
        # Every field: status, versions, leases, the audit head and even goal and priority
        # change only through domain functions (actions here, steering in the API), which
        # keep the version, audit chain and events consistent.
        return [*(f.name for f in Task._meta.fields), "steps_link", "dashboard_link"]

    def get_changelist(self, request, **kwargs):
        return DateDrillDownChangeList

    def has_add_permission(self, request):
        return False  # tasks start through do_create_task (API, dashboard, CLI)

    @admin.display(description="steps")
    def steps_link(self, obj: Task) -> str:
        url = reverse("admin:tasks_app_step_changelist") + f"?task__id__exact={obj.id}"
        return format_html('<a href="{}">{} steps</a>', url, obj.steps.count())

    @admin.display(description="dashboard")
    def dashboard_link(self, obj: Task) -> str:
        return format_html('<a href="/dashboard/tasks/{}/">open the live task page</a>', obj.id)

    def _each(self, request, queryset, verb: str, action) -> None:
        """Operators change tasks only through the same domain functions as the API, audited."""
        actor = f"admin:{request.user.username}"
        for task in queryset:
            try:
                action(task, access.console(task.tenant, actor))
                self.message_user(request, f"{task.id}: {verb}")
            except DomainError as exc:  # IllegalTransition, NoLease, CommandRefused, VersionConflict, ...
                self.message_user(request, f"{task.id}: {exc}", level=messages.WARNING)

    @admin.action(description="Redrive a dead letter from its last good checkpoint")
    def redrive(self, request, queryset):
        self._each(
            request,
            queryset,
            "redriven",
            lambda t, who: operators.do_redrive_task(t.id, who=who, reason="redriven by an operator in admin"),
        )

    @admin.action(description="Cancel with a reason (lands at the next safe point)")
    def cancel(self, request, queryset):
        return self._with_reason(
            request,
            queryset,
            "cancel",
            "Cancel",
            "A task a worker holds stops at its next safe point; the others stop now.",
            "cancel requested",
            lambda t, who, reason: do_cancel_task(t.id, who=who, reason=reason),
        )

    @admin.action(description="Kill: emergency stop, without waiting for the running step")
    def kill(self, request, queryset):
        def kill_one(task: Task, who: Principal, reason: str) -> None:
            # The steering command, as over REST and MCP: audited, with the task's version now.
            command, _ = do_enqueue_command(
                task.id,
                who=who,
                command_id=f"admin-kill-{uuid4().hex}",
                type=CommandType.KILL,
                payload={},
                expected_version=task.state_version,
                reason=reason,
            )
            if command.outcome:
                self.message_user(request, f"{task.id}: {command.outcome}", level=messages.WARNING)

        return self._with_reason(
            request,
            queryset,
            "kill",
            "Kill",
            "The step a worker runs is aborted now; the others stop now.",
            "killed",
            kill_one,
            kill_policy=kills.policy(),
        )

    def _with_reason(self, request, queryset, action: str, verb: str, explanation: str, done: str, act, **context):
        form = CancelForm(request.POST if "apply" in request.POST else None)
        if form.is_bound and form.is_valid():
            reason = form.cleaned_data["reason"]
            self._each(request, queryset, done, lambda t, who: act(t, who, reason))
            return None
        # First the reason: an intermediate page, then the same POST again with "apply".
        return TemplateResponse(
            request,
            "admin/tasks_app/task/steer_reason.html",
            {
                **self.admin_site.each_context(request),
                "title": f"{verb} tasks",
                "opts": self.model._meta,
                "tasks": queryset,
                "form": form,
                "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
                "select_across": request.POST.get("select_across", "0"),
                "action": action,
                "verb": verb,
                "explanation": explanation,
                **context,
            },
        )

    @admin.action(description="Release a stale lease (fences the holder)")
    def release_lease(self, request, queryset):
        self._each(
            request,
            queryset,
            "lease released",
            lambda t, who: operators.do_release_lease(t.id, who=who, reason="released by an operator in admin"),
        )

    @admin.action(description="Close a dead letter as failed")
    def close(self, request, queryset):
        self._each(
            request,
            queryset,
            "closed",
            lambda t, who: operators.do_close_task(t.id, who=who, reason="closed by an operator in admin"),
        )


@admin.register(Step)
class StepAdmin(admin.ModelAdmin):
    list_display = ["task", "sequence", "attempt", "name", "status", "worker", "duration_ms", "finished_at"]
    list_filter = ["status"]
    search_fields = ["task__id", "name", "worker"]
    raw_id_fields = ["task"]

    def has_change_permission(self, request, obj=None):  # history written by the engine
        return False


@admin.register(AuditRecord)
class AuditRecordAdmin(admin.ModelAdmin):
    list_display = ["task", "seq", "actor", "action", "from_status", "to_status", "created_at"]
    list_filter = ["action"]
    search_fields = ["task__id", "actor"]
    raw_id_fields = ["task"]

    def has_change_permission(self, request, obj=None):  # append-only
        return False
