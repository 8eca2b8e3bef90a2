"""GET /runtime/tasks/{id}/artifacts and /artifacts/{name}: a task's artifacts (tasks_app/artifacts.py)."""

from __future__ import annotations

from django.http import HttpResponse
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from runtime_site.parsers import refuse_paging
from tasks_app import access, artifacts
from tasks_app.auth import principal, require_role
from tasks_app.models import Role


class TaskArtifactsApi(APIView):
    permission_classes = [require_role(Role.VIEWER)]

    def get(self, request: Request, task_id: str) -> Response:
        refuse_paging(request, "the artifact listing")
        task = access.task_for(principal(request), task_id)
        return Response(
            {"taskId": str(task.id), "results": artifacts.listing(task, f"/runtime/tasks/{task.id}/artifacts")}
        )


class TaskArtifactApi(APIView):
    permission_classes = [require_role(Role.VIEWER)]

    def get(self, request: Request, task_id: str, name: str) -> HttpResponse:
        task = access.task_for(principal(request), task_id)
        return artifacts.response(task, name, download=request.query_params.get("download") in ("1", "true"))
