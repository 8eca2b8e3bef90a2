from __future__ import annotations

from typing import Any

from rest_framework import serializers, status
from rest_framework.exceptions import PermissionDenied
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from runtime_site.parsers import StrictCharField, StrictIntegerField, StrictRegexField
from steering_app.actions import answer_refusal, do_answer_input, do_enqueue_command
from steering_app.models import CommandType, InputRequest, SteeringCommand
from tasks_app import kills
from tasks_app.api.views import IDEMPOTENCY_KEY, tenant_task
from tasks_app.auth import IsPrincipal, Principal, principal, require_role
from tasks_app.models import Role, Task


def command_body(command: SteeringCommand) -> dict[str, Any]:
    return {
        "commandId": command.command_id,
        "type": command.type,
        "payload": command.payload,
        "status": command.status,
        "version": command.version,
        "expectedVersion": command.expected_version,
        "requestedBy": command.requested_by,
        "reason": command.reason,
        "outcome": command.outcome,
        "createdAt": command.created_at.isoformat(),
        "appliedAt": command.applied_at.isoformat() if command.applied_at else None,
        # What the kill does to a call in flight, so the operator knows what to reconcile.
        **({"killPolicy": kills.policy()} if command.type == CommandType.KILL else {}),
    }


def check_may_answer(request: Request, task: Task, key: str) -> None:
    check_principal_may_answer(principal(request), task, key)


def check_principal_may_answer(who: Principal, task: Task, key: str) -> None:
    """steering_app.actions.answer_refusal as this edge's 403."""
    kind = InputRequest.objects.filter(task=task, key=key).values_list("kind", flat=True).first()
    if reason := answer_refusal(who, task, kind or "question"):
        raise PermissionDenied(reason)


class TaskSteeringApi(APIView):
    class InputSerializer(serializers.Serializer):
        commandId = StrictRegexField(IDEMPOTENCY_KEY.pattern, max_length=64)  # noqa: N815
        type = serializers.ChoiceField(choices=CommandType.choices)
        payload = serializers.DictField(default=dict)
        expectedVersion = StrictIntegerField(min_value=1)  # noqa: N815
        reason = StrictCharField(max_length=500, allow_blank=True, default="")

    def get_permissions(self) -> list[Any]:
        return [require_role(Role.OPERATOR if self.request.method == "POST" else Role.VIEWER)()]

    def get(self, request: Request, task_id: str) -> Response:
        task = tenant_task(request, task_id)
        commands = SteeringCommand.objects.filter(task=task).order_by("version")
        return Response({"results": [command_body(c) for c in commands]})

    def post(self, request: Request, task_id: str) -> Response:
        task = tenant_task(request, task_id)
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        body, who = data.validated_data, principal(request)
        if body["type"] == CommandType.PROVIDE_INPUT and isinstance(body["payload"].get("key"), str):
            check_may_answer(request, task, body["payload"]["key"])
        command, _ = do_enqueue_command(
            task.id,
            tenant=who.tenant,
            command_id=body["commandId"],
            type=body["type"],
            payload=body["payload"],
            expected_version=body["expectedVersion"],
            requested_by=who.actor,
            reason=body["reason"],
        )
        # A replay gets the original answer: the command as accepted, with its version.
        return Response(command_body(command), status=status.HTTP_202_ACCEPTED)


class TaskInputApi(APIView):
    """POST /runtime/tasks/{id}/inputs/{key}: answer an open input request (an approval:
    {"answer": "approve"} or {"answer": "reject"}). A provide_input command underneath, so
    it is ordered, audited and applied like any steering; the same answer again is a replay."""

    # Who may answer depends on the request's kind (answer_refusal): an approve-scoped key
    # may answer an approval without the operate scope.
    permission_classes = [IsPrincipal]

    class InputSerializer(serializers.Serializer):
        answer = serializers.JSONField()
        reason = StrictCharField(max_length=500, allow_blank=True, default="")

    def post(self, request: Request, task_id: str, key: str) -> Response:
        task = tenant_task(request, task_id)
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        command = answer_input(
            principal(request), task, key, data.validated_data["answer"], reason=data.validated_data["reason"]
        )
        return Response(command_body(command), status=status.HTTP_202_ACCEPTED)


def answer_input(who: Principal, task: Task, key: str, answer: Any, *, reason: str = "") -> SteeringCommand:
    """Answer an open input request as `who`: checked, then steering_app.actions.do_answer_input."""
    check_principal_may_answer(who, task, key)
    return do_answer_input(task.id, tenant=who.tenant, key=key, answer=answer, requested_by=who.actor, reason=reason)
