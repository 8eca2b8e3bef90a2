"""REST edge (DESIGN §9): decode, call one action or selector, encode."""

from __future__ import annotations

import re
from base64 import b64decode
from datetime import UTC
from typing import Any
from urllib import parse

from django.utils.dateparse import parse_datetime
from drf_spectacular.utils import extend_schema
from rest_framework import pagination, serializers, status
from rest_framework.exceptions import NotFound, ValidationError
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from checkpoints_app.actions import is_valid
from checkpoints_app.models import Checkpoint
from runtime_site.parsers import IDEMPOTENCY_KEY, StrictCharField, StrictIntegerField, refuse_paging
from steering_app.actions import do_cancel_task
from tasks_app import access
from tasks_app.actions import do_create_task
from tasks_app.auth import IsPrincipal, principal, require_role
from tasks_app.models import AuditRecord, Role, Task
from tasks_app.selectors import one_snapshot, task_ack, task_snapshot, task_urls, with_snapshot
from tasks_app.states import Status


class CreatedAtCursor(pagination.CursorPagination):
    """DRF's cursor pagination, except that a bad ?limit= or ?cursor= is a 400 naming it
    (DRF quietly ignores the one and answers 404, or 500, to the other)."""

    ordering = ("-created_at", "-id")
    page_size = 50
    page_size_query_param = "limit"
    max_page_size = 200

    def get_page_size(self, request: Request) -> int:
        raw = request.query_params.get("limit")
        if raw is None:
            return self.page_size
        if not re.fullmatch(r"[0-9]{1,18}", raw) or int(raw) == 0:
            raise ValidationError({"limit": f"must be a whole number from 1 (pages hold at most {self.max_page_size})"})
        return min(int(raw), self.max_page_size)

    def decode_cursor(self, request: Request) -> pagination.Cursor | None:
        encoded = request.query_params.get(self.cursor_query_param)
        if encoded is None:
            return None
        try:
            cursor = super().decode_cursor(request) if _link_cursor(encoded) else None
        except NotFound:
            cursor = None
        if cursor is not None:
            if cursor.position is None:
                return cursor
            # DRF's stubs type the position as int; decode_cursor gives the query string's text.
            if (position := _created_at(cursor.position)) is not None:  # type: ignore[arg-type]
                return cursor._replace(position=position)  # type: ignore[arg-type]
        # A position that is no date would land in a created_at comparison: a 500.
        raise ValidationError({"cursor": "not a cursor this API gave out; follow a page's next or previous link"})


def _link_cursor(encoded: str) -> bool:
    """Whether `encoded` has the form of a cursor a page's link carries: base64 of o=, r=1
    and p= (each at most once, at least one). DRF decodes leniently, dropping whatever is
    not base64: ?cursor=%%% (or a cursor cut short, or with junk after it) was no cursor at
    all, and answered the first page as if it had been followed."""
    try:
        pairs = parse.parse_qsl(b64decode(encoded, validate=True).decode("ascii"), keep_blank_values=True)
    except ValueError:  # binascii.Error and UnicodeDecodeError are ValueErrors
        return False
    keys = [key for key, _ in pairs]
    return (
        bool(keys) and len(set(keys)) == len(keys) and set(keys) <= {"o", "r", "p"} and dict(pairs).get("r", "1") == "1"
    )


def _created_at(text: str) -> str | None:
    """The cursor's position as the UTC time the created_at comparison takes, or None when
    it is not one. Normalised, not passed on: PostgreSQL refuses offsets beyond 15:59 that
    Python parses (-16:00 was a 500), and a time past year 9999 once in UTC."""
    try:
        when = parse_datetime(text)
        if when is None:
            return None
        return (when if when.tzinfo else when.replace(tzinfo=UTC)).astimezone(UTC).isoformat()
    except (ValueError, OverflowError):  # well-formed but impossible (month 13), or beyond year 9999
        return None


class TaskListCreateApi(APIView):
    class InputSerializer(serializers.Serializer):
        agent = StrictCharField(max_length=100)
        input = serializers.DictField(default=dict)
        goal = StrictCharField(max_length=10_000, allow_blank=True, default="")
        checkpointPolicy = serializers.DictField(required=False)  # noqa: N815 (wire names)
        approvalPolicy = serializers.DictField(required=False)  # noqa: N815
        budget = serializers.DictField(required=False)
        priority = StrictIntegerField(min_value=0, max_value=9, default=5)
        ttlSeconds = StrictIntegerField(min_value=1, max_value=90 * 86400, required=False)  # noqa: N815

    def get_permissions(self) -> list[Any]:
        # A POST's rule (the operator role) is do_create_task's.
        return [IsPrincipal() if self.request.method == "POST" else require_role(Role.VIEWER)()]

    def get(self, request: Request) -> Response:
        tasks = with_snapshot(access.visible_tasks(principal(request)), prefetch_inputs=True)
        if wanted := request.query_params.get("status"):
            statuses = wanted.split(",")
            if bad := [s for s in statuses if s not in Status.values]:
                raise ValidationError({"status": f"unknown status {bad[0]!r}; one of {', '.join(Status.values)}"})
            tasks = tasks.filter(status__in=statuses)
        paginator = CreatedAtCursor()
        with one_snapshot():  # the page's rows and their open questions (prefetched apart) of one moment
            page = paginator.paginate_queryset(tasks, request, view=self)
        return paginator.get_paginated_response([task_snapshot(t) for t in page or []])

    @extend_schema(request=InputSerializer)
    def post(self, request: Request) -> Response:
        key = request.headers.get("Idempotency-Key")
        if key is not None and not IDEMPOTENCY_KEY.match(key):
            raise ValidationError({"Idempotency-Key": "must be 1-200 characters of A-Z a-z 0-9 . _ : -"})
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        body = data.validated_data
        task, created = do_create_task(
            principal(request),
            agent=body["agent"],
            input=body["input"],
            goal=body["goal"],
            checkpoint_policy=body.get("checkpointPolicy"),
            approval_policy=body.get("approvalPolicy"),
            budget=body.get("budget"),
            priority=body["priority"],
            idempotency_key=key,
            ttl_seconds=body.get("ttlSeconds"),
        )
        answer = {"taskId": str(task.id), "status": task.mcp_status, "runtimeStatus": task.status, **task_urls(task)}
        return Response(answer, status=status.HTTP_201_CREATED if created else status.HTTP_200_OK)


class TaskDetailApi(APIView):
    permission_classes = [require_role(Role.VIEWER)]

    def get(self, request: Request, task_id: str) -> Response:
        # The row, then its open questions if it has any: read apart, an answer committed in
        # between showed input_required with no question.
        with one_snapshot():
            task = access.task_for(principal(request), task_id, with_snapshot(Task.objects.all()))
            return Response(task_snapshot(task))


class TaskCancelApi(APIView):
    permission_classes = [IsPrincipal]  # do_cancel_task checks the role

    class InputSerializer(serializers.Serializer):
        reason = StrictCharField(max_length=500, allow_blank=True, default="")

    def post(self, request: Request, task_id: str) -> Response:
        task = access.task_to_act_on(principal(request), task_id)
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        who = principal(request)
        task = do_cancel_task(task.id, who=who, reason=data.validated_data["reason"])
        # Cancelling is not reading: a key without the read scope learns that it took, not the task.
        answer = task_snapshot(task) if access.may_read(who) else task_ack(task)
        return Response(answer, status=status.HTTP_202_ACCEPTED)


class TaskCheckpointsApi(APIView):
    permission_classes = [require_role(Role.VIEWER)]

    def get(self, request: Request, task_id: str) -> Response:
        refuse_paging(request, "the checkpoint listing")
        task = access.task_for(principal(request), task_id)
        rows = Checkpoint.objects.filter(task=task).order_by("sequence", "id")
        return Response(
            {
                "results": [
                    {
                        "sequence": cp.sequence,
                        "stepName": cp.step_name,
                        "nextStep": cp.next_step,
                        "schemaVersion": cp.schema_version,
                        "planVersion": cp.plan_version,
                        "reason": cp.reason,
                        "checksum": cp.checksum,
                        "valid": is_valid(cp, agent=task.agent),
                        "discarded": cp.discarded,
                        "artifactRefs": cp.artifact_refs,
                        "createdAt": cp.created_at.isoformat(),
                    }
                    for cp in rows
                ]
            }
        )


class TaskResultApi(APIView):
    permission_classes = [require_role(Role.VIEWER)]

    def get(self, request: Request, task_id: str) -> Response:
        task = access.task_for(principal(request), task_id)
        if not task.is_terminal:
            return Response(
                {
                    "error": {
                        "code": "not_finished",
                        "message": f"task is {task.status}",
                        "status": task.mcp_status,
                        "runtimeStatus": task.status,
                    }
                },
                status=status.HTTP_409_CONFLICT,
            )
        return Response(
            {
                "taskId": str(task.id),
                "status": task.mcp_status,
                "runtimeStatus": task.status,
                "result": task.result,
                "error": task.error,
            }
        )


class TaskAuditApi(APIView):
    permission_classes = [require_role(Role.VIEWER)]

    def get(self, request: Request, task_id: str) -> Response:
        refuse_paging(request, "the audit listing")  # the whole chain, which `head` verifies
        task = access.task_for(principal(request), task_id)
        rows = AuditRecord.objects.filter(task=task).order_by("seq")
        return Response(
            {
                "head": task.audit_head,
                "results": [
                    {
                        "seq": r.seq,
                        "actor": r.actor,
                        "action": r.action,
                        "fromStatus": r.from_status,
                        "toStatus": r.to_status,
                        "beforeVersion": r.before_version,
                        "afterVersion": r.after_version,
                        "reason": r.reason,
                        "createdAt": r.created_at.isoformat(),
                        "hash": r.hash,
                    }
                    for r in rows
                ],
            }
        )
