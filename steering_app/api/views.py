from __future__ import annotations

from typing import Any

from rest_framework import serializers, status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from runtime_site.parsers import (
    StrictCharField,
    StrictIntegerField,
    StrictRegexField,
    refuse_paging,
)
from steering_app.actions import do_answer_input, do_enqueue_command
from steering_app.models import COMMAND_ID, CommandType, SteeringCommand
from tasks_app import access, kills
from tasks_app.auth import IsPrincipal, principal, require_role
from tasks_app.models import Role


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


class TaskSteeringApi(APIView):
    class InputSerializer(serializers.Serializer):
        commandId = StrictRegexField(COMMAND_ID.pattern)  # noqa: N815
        type = serializers.ChoiceField(choices=CommandType.choices)
        payload = serializers.DictField(default=dict)
        expectedVersion = StrictIntegerField(min_value=1)  # noqa: N815
        reason = StrictCharField(max_length=500, allow_blank=True, default="")

    def get_permissions(self) -> list[Any]:
        # A POST's rules (operator; for an answer, answer_refusal) are do_enqueue_command's.
        return [IsPrincipal() if self.request.method == "POST" else require_role(Role.VIEWER)()]

    def get(self, request: Request, task_id: str) -> Response:
        refuse_paging(request, "the steering listing")
        task = access.task_for(principal(request), task_id)
        commands = SteeringCommand.objects.filter(task=task).order_by("version")
        return Response({"results": [command_body(c) for c in commands]})

    def post(self, request: Request, task_id: str) -> Response:
        # The action finds the caller's task itself, with the lock it takes on it: looking it
        # up here as well was a sixth of the request's CPU time (issue 14).
        uuid = access.task_uuid(task_id)
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        body, who = data.validated_data, principal(request)
        command, _ = do_enqueue_command(
            uuid,
            who=who,
            command_id=body["commandId"],
            type=body["type"],
            payload=body["payload"],
            expected_version=body["expectedVersion"],
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
        task = access.task_to_act_on(principal(request), task_id)
        data = self.InputSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        command = do_answer_input(
            task.id,
            who=principal(request),
            key=key,
            answer=data.validated_data["answer"],
            reason=data.validated_data["reason"],
        )
        return Response(command_body(command), status=status.HTTP_202_ACCEPTED)
