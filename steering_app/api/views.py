from __future__ import annotations

from typing import Any

from rest_framework import serializers, status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from steering_app.actions import do_enqueue_command
from steering_app.models import CommandType, SteeringCommand
from tasks_app.api.views import IDEMPOTENCY_KEY, tenant_task
from tasks_app.auth import principal, require_role
from tasks_app.models import Role


def command_body(command: SteeringCommand) -> dict[str, Any]:
    return {
        "commandId": command.command_id, "type": command.type, "payload": command.payload,
        "status": command.status, "version": command.version, "expectedVersion": command.expected_version,
        "requestedBy": command.requested_by, "reason": command.reason, "outcome": command.outcome,
        "createdAt": command.created_at.isoformat(),
        "appliedAt": command.applied_at.isoformat() if command.applied_at else None,
    }


class TaskSteeringApi(APIView):
    class InputSerializer(serializers.Serializer):
        commandId = serializers.RegexField(IDEMPOTENCY_KEY.pattern, max_length=64)  # noqa: N815
        type = serializers.ChoiceField(choices=CommandType.choices)
        payload = serializers.DictField(default=dict)
        expectedVersion = serializers.IntegerField(min_value=1)  # noqa: N815
        reason = serializers.CharField(max_length=500, allow_blank=True, default="")

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
        command, _ = do_enqueue_command(
            task.id, tenant=who.tenant, command_id=body["commandId"], type=body["type"], payload=body["payload"],
            expected_version=body["expectedVersion"], requested_by=who.actor, reason=body["reason"])
        # A replay gets the original answer: the command as accepted, with its version.
        return Response(command_body(command), status=status.HTTP_202_ACCEPTED)
