"""The dashboard: server-rendered pages for people, signed in with a Django session.

An edge like the REST API (STYLE §2.0 "thin edges"): each view decodes a form, calls the
one domain function the API calls (do_create_task, do_enqueue_command, answer_input) as
the person's Principal, and renders. Live updates come from the task's one SSE stream
(GET /runtime/tasks/{id}/events), which accepts this session as well as API keys.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from functools import wraps
from pathlib import Path
from typing import Any
from uuid import UUID

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import FileResponse, Http404, HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_GET, require_POST
from rest_framework.exceptions import PermissionDenied

from checkpoints_app.models import Checkpoint
from dashboard import access
from dashboard.forms import AnswerForm, StartReviewForm, SteerForm
from steering_app.actions import CommandRefused, InvalidCommand, VersionConflict, do_enqueue_command
from steering_app.api.views import answer_input
from steering_app.models import InputRequest, InputStatus, SteeringCommand
from tasks_app.actions import IdempotencyConflict, do_create_task
from tasks_app.agents.base import SchemaError
from tasks_app.models import ROLE_RANK, Role, Task, TaskEvent
from tasks_app.selectors import task_snapshot
from tasks_app.states import TERMINAL, Status

LOG_TAIL = 30
STATIC = Path(__file__).resolve().parent / "static" / "dashboard"


def with_task(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """Resolve the task inside the person's tenants; anything else is a plain 404 page."""

    @wraps(view)
    def wrapper(request: HttpRequest, task_id: UUID, *args: Any, **kwargs: Any) -> HttpResponse:
        try:
            task = access.task_for(request.user, task_id)
        except Http404:
            return render(request, "dashboard/not_found.html", status=404)
        return view(request, task, *args, **kwargs)

    return login_required(wrapper)


def list_row(task: Task) -> dict[str, Any]:
    return {"taskId": str(task.id), "tenant": task.tenant.slug, "agent": task.agent, "goal": task.goal,
            "status": task.mcp_status, "runtimeStatus": task.status, "statusMessage": task.status_text(),
            "progress": round(task.progress, 4), "phase": task.phase,
            "updatedAt": task.updated_at.isoformat(), "url": f"/dashboard/tasks/{task.id}/"}


def _tasks(request: HttpRequest) -> list[Task]:
    tasks = access.visible_tasks(request.user).select_related("tenant").order_by("-created_at", "-id")
    if wanted := request.GET.get("status"):
        tasks = tasks.filter(status=wanted)
    return list(tasks[:100])


@login_required
@require_GET
def task_list(request: HttpRequest) -> HttpResponse:
    rows = [list_row(t) for t in _tasks(request)]
    return render(request, "dashboard/task_list.html", {
        "rows": rows, "statuses": Status.values, "status": request.GET.get("status", ""),
        "memberships": access.memberships(request.user), "can_start": bool(_start_tenants(request))})


@login_required
@require_GET
def task_list_json(request: HttpRequest) -> JsonResponse:
    """What the list page polls: the same rows it renders."""
    return JsonResponse({"tasks": [list_row(t) for t in _tasks(request)]})


def _start_tenants(request: HttpRequest) -> list[tuple[str, str]]:
    return [(m.tenant.slug, m.tenant.name or m.tenant.slug) for m in access.memberships(request.user)
            if ROLE_RANK[Role(m.role)] >= ROLE_RANK[Role.OPERATOR]]


@login_required
def start_task(request: HttpRequest) -> HttpResponse:
    tenants = _start_tenants(request)
    if not tenants:
        return render(request, "dashboard/message.html", {
            "title": "Not allowed", "message": "Starting a task needs the operator role or above."}, status=403)
    form = StartReviewForm(request.POST or None, tenants=tenants, initial={"tenant": tenants[0][0]})
    if request.method == "POST" and form.is_valid():
        membership = next(m for m in access.memberships(request.user) if m.tenant.slug == form.cleaned_data["tenant"])
        try:
            task, _ = do_create_task(
                membership.tenant, actor=f"user:{request.user.pk}", agent="document_review",
                input=form.agent_input(), goal=form.cleaned_data["goal"], priority=form.cleaned_data["priority"],
                idempotency_key=form.cleaned_data["idempotency_key"])
        except (SchemaError, IdempotencyConflict) as exc:
            form.add_error(None, str(exc))
        else:
            return redirect("dashboard:task", task_id=task.id)
    return render(request, "dashboard/start.html", {"form": form}, status=400 if form.errors else 200)


def task_context(request: HttpRequest, task: Task) -> dict[str, Any]:
    who = access.principal_for(request.user, task)
    logs = list(TaskEvent.objects.filter(task=task, type="log").order_by("-seq")[:LOG_TAIL])
    return {
        "task": task,
        "snapshot": {"seq": task.event_seq, **task_snapshot(task)},
        "checkpoints": Checkpoint.objects.filter(task=task).order_by("sequence", "id"),
        "commands": SteeringCommand.objects.filter(task=task).order_by("version"),
        "open_inputs": InputRequest.objects.filter(task=task, status=InputStatus.OPEN).order_by("id"),
        "logs": list(reversed(logs)),
        "role": who.role,
        "may_steer": who.has_role(Role.OPERATOR),
        "may_approve": who.has_role(Role.APPROVER),
        "terminal": task.status in TERMINAL,
        "pausable": task.status in (Status.QUEUED, Status.WORKING, Status.RECOVERING, Status.INPUT_REQUIRED),
        "resumable": task.status in (Status.PAUSED, Status.PAUSING),
        "priorities": range(10),
        "new_command_id": f"dash-{uuid.uuid4().hex}",
    }


def _task_page(request: HttpRequest, task: Task, *, status: int = 200, **extra: Any) -> HttpResponse:
    return render(request, "dashboard/task.html", {**task_context(request, task), **extra}, status=status)


@with_task
@require_GET
def task_page(request: HttpRequest, task: Task) -> HttpResponse:
    return _task_page(request, task)


@with_task
@require_GET
def task_panels(request: HttpRequest, task: Task) -> HttpResponse:
    """The parts of the task page that change with control state, re-read on such events."""
    return render(request, "dashboard/_panels.html", task_context(request, task))


@with_task
@require_GET
def task_snapshot_json(request: HttpRequest, task: Task) -> JsonResponse:
    """For a client that saw a gap in seq: the state now (docs/streaming.md)."""
    return JsonResponse({"seq": task.event_seq, **task_snapshot(task)})


@with_task
@require_POST
def steer(request: HttpRequest, task: Task) -> HttpResponse:
    form = SteerForm(request.POST)
    if not form.is_valid():
        return _task_page(request, task, status=400, error=f"That command was not understood: {form.errors.as_text()}")
    who = access.principal_for(request.user, task)
    if not who.has_role(Role.OPERATOR):
        return _task_page(request, task, status=403, error="Steering needs the operator role or above.")
    data = form.cleaned_data
    try:
        command, _ = do_enqueue_command(
            task.id, tenant=who.tenant, command_id=data["command_id"], type=data["type"], payload=form.payload(),
            expected_version=data["expected_version"], requested_by=who.actor, reason=data["reason"])
    except VersionConflict:
        # The person acted on a state that is no longer current: show them the task as it is.
        task.refresh_from_db()
        return _task_page(request, task, status=409, conflict={
            "type": data["type"], "expected": data["expected_version"], "current": task.state_version})
    except (CommandRefused, InvalidCommand) as exc:
        task.refresh_from_db()
        return _task_page(request, task, status=409 if isinstance(exc, CommandRefused) else 422,
                          error=f"{data['type']} was not accepted: {exc}")
    messages.success(request, f"{command.type} accepted (version {command.version}, {command.status}).")
    return redirect("dashboard:task", task_id=task.id)


@with_task
@require_POST
def answer(request: HttpRequest, task: Task, key: str) -> HttpResponse:
    form = AnswerForm(request.POST)
    if not form.is_valid():
        return _task_page(request, task, status=400, error="Answer approve or reject.")
    try:
        answer_input(access.principal_for(request.user, task), task, key, form.cleaned_data["answer"],
                     reason=form.cleaned_data["reason"])
    except PermissionDenied as exc:
        return _task_page(request, task, status=403, error=str(exc.detail))
    except (CommandRefused, InvalidCommand) as exc:
        task.refresh_from_db()
        return _task_page(request, task, status=409, error=str(exc))
    messages.success(request, f"{key}: {form.cleaned_data['answer']} sent.")
    return redirect("dashboard:task", task_id=task.id)


@require_GET
def asset(request: HttpRequest, name: str) -> FileResponse:
    """The dashboard's few static files, served by Django in every profile (uvicorn has no
    static server and there is no build step)."""
    path = STATIC / name
    if name not in {"dashboard.js", "dashboard.css"} or not path.is_file():
        raise Http404
    content_type = "text/javascript" if name.endswith(".js") else "text/css"
    return FileResponse(path.open("rb"), content_type=f"{content_type}; charset=utf-8")
