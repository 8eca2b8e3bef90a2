"""The dashboard: server-rendered pages for people, signed in with a Django session.

An edge like the REST API (STYLE §2.0 "thin edges"): each view decodes a form, calls the
one domain function the API calls (do_create_task, do_enqueue_command, do_answer_input) as
the person's Principal, and renders. Live updates come from the task's one SSE stream
(GET /runtime/tasks/{id}/events), which accepts this session as well as API keys.

Every form POST answers with a 303 to a page (post/redirect/get), whatever happened: the
outcome, a 409 included, travels as a django.contrib.messages flash, so reloading the page
the person lands on never sends a command again.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Callable
from functools import wraps
from typing import Any
from uuid import UUID

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.contrib.auth.views import redirect_to_login
from django.core.exceptions import BadRequest
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect, JsonResponse
from django.shortcuts import render, resolve_url
from django.template.response import TemplateResponse
from django.urls import Resolver404, resolve, reverse
from django.utils.html import format_html
from django.views.csrf import csrf_failure as django_csrf_failure

from checkpoints_app.models import Checkpoint
from dashboard import access
from dashboard.forms import AnswerForm, StartReviewForm, SteerForm
from runtime_site.errors import allow_methods, error_body
from steering_app.actions import acceptable, do_answer_input, do_enqueue_command
from steering_app.models import InputRequest, InputStatus, SteeringCommand
from tasks_app import artifacts, errors
from tasks_app.access import as_member, principal_for, task_for, visible_tasks
from tasks_app.actions import do_create_task
from tasks_app.errors import DomainError, Forbidden, IdempotencyConflict, TaskNotFound, VersionConflict
from tasks_app.models import ROLE_RANK, Role, Task, TaskEvent
from tasks_app.selectors import one_snapshot, task_snapshot
from tasks_app.states import Status

LOG_TAIL = 30


def see_other(to: str, *args: Any, **kwargs: Any) -> HttpResponseRedirect:
    """The answer to every form POST (post/redirect/get): 303 makes the browser GET the page."""
    response = HttpResponseRedirect(resolve_url(to, *args, **kwargs))
    response.status_code = 303
    return response


def signed_out(*, back_to: str, for_script: bool) -> HttpResponse:
    """A request without a session (it ended, or the person signed out elsewhere)."""
    if for_script:
        # fetch() would follow a redirect to the login page's HTML and call it a success;
        # a 401 tells dashboard.js to send the person to sign in.
        return JsonResponse(error_body("not_authenticated", "your session has ended; sign in again"), status=401)
    # Back to the page after signing in, never to a form's POST URL (a GET there is a 405).
    return redirect_to_login(back_to)


def with_task(
    view: Callable[..., HttpResponse] | None = None, *, for_script: bool = False, one_moment: bool = True
) -> Any:
    """Resolve the task inside the person's tenants; anything else is a plain 404 page.
    for_script: the view answers dashboard.js (JSON or a fragment), not a person.
    one_moment=False: a read that needs no snapshot of the task's rows (an artifact: the
    task, then a blob). Not in one_snapshot's transaction, which a slow blob store kept
    open past the web's idle_in_transaction_session_timeout: PostgreSQL ended the session
    under it, and the artifact, read in full, was a 503 at the commit."""

    def decorate(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
        @wraps(view)
        def wrapper(request: HttpRequest, task_id: UUID, *args: Any, **kwargs: Any) -> HttpResponse:
            if not request.user.is_authenticated:
                return signed_out(back_to=reverse("dashboard:task", args=[task_id]), for_script=for_script)
            # A read sees the task and what hangs off it (its open questions, commands,
            # checkpoints) as of one moment: read apart, an answer committed in between
            # showed input_required with no question (selectors.one_snapshot).
            reading = one_moment and request.method in ("GET", "HEAD")
            with one_snapshot() if reading else contextlib.nullcontext():
                try:
                    task = task_for(access.person(request), task_id)
                except TaskNotFound:
                    return render(request, "dashboard/not_found.html", status=404)
                return view(request, task, *args, **kwargs)

        return wrapper

    return decorate(view) if view is not None else decorate


def list_row(task: Task) -> dict[str, Any]:
    return {
        "taskId": str(task.id),
        "tenant": task.tenant.slug,
        "agent": task.agent,
        "goal": task.goal,
        "status": task.mcp_status,
        "runtimeStatus": task.status,
        "statusMessage": task.status_text(),
        "progress": round(task.progress, 4),
        "phase": task.phase,
        "updatedAt": task.updated_at.isoformat(),
        "url": f"/dashboard/tasks/{task.id}/",
    }


def _tasks(request: HttpRequest) -> list[Task]:
    tasks = visible_tasks(access.person(request)).select_related("tenant").order_by("-created_at", "-id")
    if wanted := request.GET.get("status"):
        if wanted not in Status.values:
            raise BadRequest(f"status: unknown status {wanted!r}; one of {', '.join(Status.values)}")
        tasks = tasks.filter(status=wanted)
    return list(tasks[:100])


# allow_methods outermost on every view: a method a URL never takes is its 405, before
# CSRF, the session and the task are looked at. HEAD wherever GET: a link checker or an
# uptime monitor asks HEAD, and Django (unlike DRF) answers it only when told to.
@allow_methods("GET", "HEAD")
@login_required
def task_list(request: HttpRequest) -> HttpResponse:
    rows = [list_row(t) for t in _tasks(request)]
    return render(
        request,
        "dashboard/task_list.html",
        {
            "rows": rows,
            "statuses": Status.values,
            "status": request.GET.get("status", ""),
            "memberships": access.memberships(access.person(request)),
            "can_start": bool(_start_tenants(request)),
        },
    )


@allow_methods("GET", "HEAD")
def task_list_json(request: HttpRequest) -> HttpResponse:
    """What the list page polls: the same rows it renders."""
    if not request.user.is_authenticated:
        return signed_out(back_to=reverse("dashboard:tasks"), for_script=True)
    return JsonResponse({"tasks": [list_row(t) for t in _tasks(request)]})


def _start_tenants(request: HttpRequest) -> list[tuple[str, str]]:
    return [
        (m.tenant.slug, m.tenant.name or m.tenant.slug)
        for m in access.memberships(access.person(request))
        if ROLE_RANK[Role(m.role)] >= ROLE_RANK[Role.OPERATOR]
    ]


START_RETRY = "dashboard.start.retry"  # session key: a refused start form, shown again after the redirect


@allow_methods("GET", "HEAD", "POST")
@login_required
def start_task(request: HttpRequest) -> HttpResponse:
    tenants = _start_tenants(request)
    if not tenants:
        return render(
            request,
            "dashboard/message.html",
            {"title": "Not allowed", "message": "Starting a task needs the operator role or above."},
            status=403,
        )
    if request.method == "POST":
        return _start_posted(request, tenants)
    form = StartReviewForm(tenants=tenants, initial={"tenant": tenants[0][0]})
    if retry := request.session.pop(START_RETRY, None):
        # The refused values again, with their errors; a fresh idempotency key, since no task
        # was made with the old one (or it belongs to another task: IdempotencyConflict).
        form = StartReviewForm({**retry["data"], "idempotency_key": f"dash-{uuid.uuid4().hex}"}, tenants=tenants)
        form.is_valid()
        if retry["error"]:
            form.add_error(None, retry["error"])
    return render(request, "dashboard/start.html", {"form": form})


def _start_posted(request: HttpRequest, tenants: list[tuple[str, str]]) -> HttpResponse:
    form = StartReviewForm(request.POST, tenants=tenants)
    error = ""
    if form.is_valid():
        membership = next(
            m for m in access.memberships(access.person(request)) if m.tenant.slug == form.cleaned_data["tenant"]
        )
        try:
            task, _ = do_create_task(
                as_member(membership),
                agent="document_review",
                input=form.agent_input(),
                goal=form.cleaned_data["goal"],
                priority=form.cleaned_data["priority"],
                idempotency_key=form.cleaned_data["idempotency_key"],
            )
        except IdempotencyConflict:
            error = "This form already started a task with other values; check them and start again."
        except DomainError as exc:  # SchemaError, UnsafeInput, QuotaExceeded, ...
            error = errors.message(exc)
        else:
            return see_other("dashboard:task", task_id=task.id)
    # Nothing was started: show the form again, from a GET, so a reload sends nothing.
    data = {k: v for k, v in request.POST.items() if k not in ("csrfmiddlewaretoken", "idempotency_key")}
    request.session[START_RETRY] = {"data": data, "error": error}
    return see_other("dashboard:start")


class TaskPage(TemplateResponse):
    """The task page, or its panels (`template`): the task's rows read in the view, inside
    with_task's snapshot (task_context, every query evaluated there), and the finished task's
    artifacts listed as the page renders, after the view has returned and the snapshot's
    transaction has ended. The listing is a call to the blob store: inside, a slow one kept
    the transaction open past the web's idle_in_transaction_session_timeout, PostgreSQL
    ended the session under it, and the page was a 503 at the commit."""

    def __init__(self, request: HttpRequest, template: str, task: Task) -> None:
        super().__init__(request, template, task_context(request, task))
        self.task = task

    def resolve_context(self, context: dict[str, Any] | None) -> dict[str, Any]:
        task = self.task
        # Linked to the route that serves them (a file:// ref is no link).
        listed = artifacts.listing(task, f"/dashboard/tasks/{task.id}/artifacts") if task.is_terminal else []
        return {**(context or {}), "artifacts": listed}


def task_context(request: HttpRequest, task: Task) -> dict[str, Any]:
    """What the task page shows of the task's rows, every query run now (lists, not
    querysets): TaskPage renders it after the snapshot has ended."""
    who = principal_for(access.person(request), task)
    logs = log_tail(task)
    report = artifacts.name_of(task, ((task.result or {}).get("report") or {}).get("markdown"))
    commands = list(SteeringCommand.objects.filter(task=task).order_by("version"))
    return {
        "risk_chart": risk_chart(task.result) if task.is_terminal else [],
        "report_name": report,
        "report_url": reverse("dashboard:artifact", args=[task.id, report]) if report else None,
        "task": task,
        "snapshot": {"seq": task.event_seq, **task_snapshot(task)},
        "checkpoints": list(Checkpoint.objects.filter(task=task).order_by("sequence", "id")),
        "commands": commands,
        "open_inputs": [
            {"request": r, "choices": answer_choices(r.answer_schema), "schema": json.dumps(r.answer_schema)}
            for r in InputRequest.objects.filter(task=task, status=InputStatus.OPEN).order_by("id")
        ],
        "logs": logs,
        "role": who.role,
        "may_steer": who.has_role(Role.OPERATOR),
        "may_approve": who.has_role(Role.APPROVER),
        "terminal": task.is_terminal,
        # the forms shown are the commands steering would accept now (one rule, steering_app's)
        "allowed": acceptable(task, commands),
        "priorities": range(10),
        "new_command_id": f"dash-{uuid.uuid4().hex}",
    }


def answer_choices(schema: Any) -> list[tuple[str, str]] | None:
    """The buttons a question's answer schema allows, as (label, the JSON a button sends):
    one per value of an enum of scalars (an approval's approve/reject, a confirmation's
    done/not_done), yes/no for a boolean. None: the person types the answer as JSON."""
    if not isinstance(schema, dict):
        return None
    values = schema.get("enum")
    if isinstance(values, list) and values and all(isinstance(v, str | int | float | bool) for v in values):
        return [(str(v).replace("_", " ") if isinstance(v, str) else json.dumps(v), json.dumps(v)) for v in values]
    if schema.get("type") == "boolean":
        return [("yes", "true"), ("no", "false")]
    return None


def risk_chart(result: dict[str, Any] | None) -> list[dict[str, Any]]:
    """A review's risk distribution as bars (server-drawn SVG: no chart library, no script)."""
    levels = (result or {}).get("byLevel") or {}
    if not isinstance(levels, dict) or not levels:
        return []
    top = max([int(n) for n in levels.values()] + [1])
    return [
        {"level": level, "count": int(n), "width": round(220 * int(n) / top), "y": i * 24}
        for i, (level, n) in enumerate(levels.items())
    ]


@allow_methods("GET", "HEAD")
@with_task
def task_page(request: HttpRequest, task: Task) -> HttpResponse:
    return TaskPage(request, "dashboard/task.html", task)


@allow_methods("GET", "HEAD")
@with_task(for_script=True)
def task_panels(request: HttpRequest, task: Task) -> HttpResponse:
    """The parts of the task page that change with control state, re-read on such events."""
    return TaskPage(request, "dashboard/_panels.html", task)


@allow_methods("GET", "HEAD")
@with_task(one_moment=False)
def artifact(request: HttpRequest, task: Task, name: str) -> HttpResponse:
    return artifacts.response(task, name, download=request.GET.get("download") in ("1", "true"))


@allow_methods("GET", "HEAD")
@with_task(for_script=True)
def task_snapshot_json(request: HttpRequest, task: Task) -> JsonResponse:
    """For a client that saw a gap in seq: the state now (docs/streaming.md), and the log
    tail, which the snapshot does not carry and the missed events may have."""
    logs = [{"seq": e.seq, "step": e.data.get("step"), "message": e.data.get("message")} for e in log_tail(task)]
    return JsonResponse({"seq": task.event_seq, **task_snapshot(task), "logs": logs})


def log_tail(task: Task) -> list[TaskEvent]:
    """The task's newest log events, oldest first."""
    return list(reversed(TaskEvent.objects.filter(task=task, type="log").order_by("-seq")[:LOG_TAIL]))


def _refused(request: HttpRequest, task: Task, message: str) -> HttpResponse:
    messages.error(request, message)
    return see_other("dashboard:task", task_id=task.id)


@allow_methods("POST")
@with_task
def steer(request: HttpRequest, task: Task) -> HttpResponse:
    form = SteerForm(request.POST)
    if not form.is_valid():
        return _refused(request, task, f"That command was not understood: {form.errors.as_text()}")
    who = principal_for(access.person(request), task)
    data = form.cleaned_data
    try:
        command, _ = do_enqueue_command(
            task.id,
            who=who,
            command_id=data["command_id"],
            type=data["type"],
            payload=form.payload(),
            expected_version=data["expected_version"],
            reason=data["reason"],
        )
    except Forbidden as exc:
        return _refused(request, task, f"Steering needs the {exc.role} role or above." if exc.role else str(exc))
    except VersionConflict:
        # The person acted on a state that is no longer current (the API's 409): say so, and
        # the page they land on shows the task as it is now, with forms carrying its version.
        task.refresh_from_db()
        messages.warning(
            request,
            format_html(
                "<strong>Someone changed this task; here is its current state.</strong> Your {} was based on "
                "version {}; the task is now at version {} ({}). Nothing was changed. Look at the state below "
                "and try again if it still makes sense.",
                data["type"],
                data["expected_version"],
                task.state_version,
                task.status,
            ),
            extra_tags="conflict",
        )
        return see_other("dashboard:task", task_id=task.id)
    except DomainError as exc:  # CommandRefused, InvalidCommand, UnsafeInput, ...
        return _refused(request, task, f"{data['type']} was not accepted: {errors.message(exc)}")
    messages.success(request, f"{command.type} accepted (version {command.version}, {command.status}).")
    return see_other("dashboard:task", task_id=task.id)


@allow_methods("POST")
@with_task
def answer(request: HttpRequest, task: Task, key: str) -> HttpResponse:
    form = AnswerForm(request.POST)
    if not form.is_valid():
        return _refused(request, task, f"That answer was not understood: {form.errors.as_text()}")
    given = form.cleaned_data["answer"]
    question = InputRequest.objects.filter(task=task, key=key).only("answer_schema").first()
    wants_text = (
        question is not None
        and isinstance(question.answer_schema, dict)
        and question.answer_schema.get("type") == "string"
    )
    if wants_text and not isinstance(given, str):
        given = request.POST["answer"]  # a question that wants text: 123 typed is the text "123"
    try:
        do_answer_input(
            task.id,
            who=principal_for(access.person(request), task),
            key=key,
            answer=given,
            reason=form.cleaned_data["reason"],
        )
    except Forbidden as exc:
        return _refused(request, task, str(exc))
    except DomainError as exc:  # CommandRefused, AnswerConflict, InvalidCommand, ...
        return _refused(request, task, f"{given} was not accepted: {errors.message(exc)}")
    messages.success(request, f"{key}: {given} sent.")
    return see_other("dashboard:task", task_id=task.id)


def csrf_failure(request: HttpRequest, reason: str = "") -> HttpResponse:
    """CSRF_FAILURE_VIEW. A dashboard form refused for its CSRF token was posted from a page
    older than the person's session (it ended, or they signed in again elsewhere, which
    rotates the token). Nothing was sent; take them to sign in, or back to the page."""
    match = resolve_dashboard_task(request.path)
    if match is None:
        return django_csrf_failure(request, reason=reason)
    if not request.user.is_authenticated:
        return redirect_to_login(match)
    messages.error(
        request,
        "This page was older than your session, so nothing was sent. "
        "Here is the current state; try again if it still makes sense.",
    )
    return see_other(match)


def resolve_dashboard_task(path: str) -> str | None:
    """The page a dashboard form belongs to: its task page, or the task list."""
    try:
        found = resolve(path)
    except Resolver404:
        return None
    if found.namespace != "dashboard":
        return None
    if "task_id" in found.kwargs:
        return reverse("dashboard:task", args=[found.kwargs["task_id"]])
    return reverse("dashboard:start") if found.url_name == "start" else reverse("dashboard:tasks")
