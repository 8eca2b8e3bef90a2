"""The lean reads of the REST edge (runtime_site/lean.py says what "lean" means): the caller's
API key and its task, in one tenant-scoped query on the event loop, and the task snapshot
(GET /runtime/tasks/{id}) answered from it.

The rules are the full path's own: tasks_app.auth.check_key judges the key, Principal.has_role
the role and scopes, selectors.task_snapshot builds the snapshot and runtime_site.ratelimit
counts the request. Only the read differs: one statement written out here instead of two
ORM querysets compiled on every request (3 ms of CPU each on a loaded 2-core machine). Any
answer but the snapshot itself (and a 429 or a 503) is left to the full path.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from django.http import Http404, HttpRequest, HttpResponse
from django.utils import timezone
from psycopg import sql
from rest_framework.exceptions import APIException, AuthenticationFailed
from rest_framework.renderers import BaseRenderer
from rest_framework.request import Request

from runtime_site import dbpool, ratelimit
from runtime_site.errors import error_body, infrastructure_fault, unavailable
from steering_app.models import InputRequest, InputStatus
from tasks_app.api.views import TaskDetailApi
from tasks_app.auth import (
    KEY_COLUMNS,
    KEY_PREFIX,
    KEY_SHAPE,
    KEY_TABLES,
    KEY_WIDTH,
    LAST_USED_EVERY,
    Principal,
    check_key,
    key_from_row,
    last_use_stale,
    select_list,
)
from tasks_app.models import Role, Task
from tasks_app.selectors import SNAPSHOT_FIELDS, task_snapshot

logger = logging.getLogger(__name__)

_task_names, _task_columns = select_list(Task, "t", SNAPSHOT_FIELDS)

# The key as authenticate_key reads it (auth.KEY_COLUMNS: with its tenant, its user's
# is_active and the membership's role), beside the task as with_snapshot() reads it (the
# newest valid checkpoint's sequence, and the open input requests), the task only if it is
# the key's tenant's. The tables are the models' (a test reads each snapshot both ways).
KEY_AND_TASK = sql.SQL("""
    SELECT {key}, t.id IS NOT NULL, {task},
           (SELECT c.sequence FROM checkpoints_app_checkpoint c
             WHERE c.task_id = t.id AND NOT c.discarded
             ORDER BY c.sequence DESC, c.id DESC LIMIT 1),
           (SELECT json_agg(json_build_array(i.key, i.prompt, i.answer_schema) ORDER BY i.id)
              FROM steering_app_inputrequest i WHERE i.task_id = t.id AND i.status = %(open)s)
      FROM {key_tables}
      LEFT JOIN tasks_app_task t ON t.id = %(task)s AND t.tenant_id = k.tenant_id
     WHERE k.prefix = %(prefix)s
""").format(key=KEY_COLUMNS, key_tables=KEY_TABLES, task=_task_columns)

# authenticate_key's conditional write: concurrent requests of one key write once between them.
TOUCH = sql.SQL("""
    UPDATE tasks_app_apikey SET last_used_at = %(now)s
     WHERE id = %(id)s AND (last_used_at IS NULL OR last_used_at <= %(stale)s)
""")


@dataclass(frozen=True)
class Caller:
    """An API key proven by the lean read, and the task it asked for (None: not its tenant's, or none)."""

    who: Principal
    task: Task | None


def bearer_key(request: HttpRequest) -> tuple[str, str] | None:
    """(prefix, secret) of a well-formed `Bearer rt_...` header; None for anything else
    (no header, a JWT, a malformed key), which the full path answers."""
    scheme, _, token = request.META.get("HTTP_AUTHORIZATION", "").partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token.startswith(KEY_PREFIX) or (shape := KEY_SHAPE.match(token)) is None:
        return None
    prefix, secret = shape.groups()
    return prefix, secret


async def read_caller(request: HttpRequest, task_id: str | UUID) -> Caller | None:
    """The caller and its task in one query, or None when the full path must answer (no
    usable key, a key check_key refuses). Raises the driver's error when the database cannot
    answer (runtime_site.errors.infrastructure_fault names it)."""
    credential = bearer_key(request)
    if credential is None:
        return None
    try:  # an address past its failure limit: the full path's 429, even for a key that works
        ratelimit.check_address(ratelimit.client_address(request))
    except ratelimit.AuthFailuresLimited:
        return None
    prefix, secret = credential
    task_uuid = task_id if isinstance(task_id, UUID) else UUID(task_id)
    async with dbpool.borrow() as conn:
        cursor = await conn.execute(KEY_AND_TASK, {"prefix": prefix, "task": task_uuid, "open": InputStatus.OPEN})
        row = await cursor.fetchone()
        if row is None:
            return None
        key, task = key_from_row(row, decoded=True), _task(row)
        now = timezone.now()
        try:
            who = check_key(key, secret, now)
        except AuthenticationFailed:
            return None
        if not who.has_role(Role.VIEWER):  # a key without the read scope: the full path's 403
            return None
        if last_use_stale(key, now):
            await conn.execute(TOUCH, {"now": now, "id": key.pk, "stale": now - LAST_USED_EVERY})
    return Caller(who, task)


def _task(row: tuple[Any, ...]) -> Task | None:
    start = KEY_WIDTH
    if not row[start]:
        return None
    values = row[start + 1 : start + 1 + len(_task_names)]
    task = Task.from_db("default", _task_names, values)
    last_checkpoint, inputs = row[-2], row[-1] or []
    # What with_snapshot(prefetch_inputs=True) puts on a task, so task_snapshot reads no more.
    task.snapshot_last_checkpoint = last_checkpoint  # type: ignore[attr-defined]
    task.snapshot_inputs_open = bool(inputs)  # type: ignore[attr-defined]
    task.snapshot_open_inputs = [  # type: ignore[attr-defined]
        InputRequest(key=key, prompt=prompt, answer_schema=schema) for key, prompt, schema in inputs
    ]
    return task


def _valid_uuid(text: str) -> bool:
    try:
        UUID(text)
    except ValueError:
        return False
    return True


async def over_limit(who: Principal, surface: str) -> ratelimit.RateLimited | None:
    """Count the request against its key's and tenant's limits; the refusal when past one."""
    try:
        await ratelimit.aenforce(who, surface)
    except ratelimit.RateLimited as exc:
        return exc
    return None


Negotiated = tuple[BaseRenderer, str]


def negotiate(request: HttpRequest) -> Negotiated | None:
    """The renderer and media type TaskDetailApi's content negotiation picks for this request
    (?format=, Accept: "application/json; indent=2" is rendered indented), or None where it
    refuses: a ?format= no renderer has (400) or an Accept none satisfies (406), the full
    path's answers. The lean path answered JSON whatever the request asked for."""
    renderers = [renderer() for renderer in TaskDetailApi.renderer_classes]
    try:
        return TaskDetailApi.content_negotiation_class().select_renderer(Request(request), renderers)
    except (APIException, Http404):
        return None


def drf_json(data: Any, negotiated: Negotiated, status: int = 200, **headers: str) -> HttpResponse:
    """An answer as TaskDetailApi renders it (its negotiated renderer, then its headers in
    DRF's order: the exception handler's, then Allow)."""
    renderer, media_type = negotiated
    response = HttpResponse(renderer.render(data, media_type, {}), content_type=renderer.media_type, status=status)
    for name, value in headers.items():
        response[name] = value
    response["Allow"] = DETAIL_ALLOW
    return response


DETAIL_ALLOW = "GET, HEAD, OPTIONS"  # TaskDetailApi's allowed methods, as DRF lists them


async def task_detail(request: HttpRequest, task_id: str) -> HttpResponse | None:
    """GET /runtime/tasks/{id} (TaskDetailApi) for a viewer's API key and a task of its tenant."""
    if not dbpool.async_available() or not _valid_uuid(task_id):
        return None
    if (negotiated := negotiate(request)) is None:  # DRF negotiates first, before the key is read
        return None
    try:
        caller = await read_caller(request, task_id)
    except Exception as exc:
        if (cause := infrastructure_fault(exc)) is None:
            raise
        return unavailable(cause)
    if caller is None or caller.task is None or not caller.who.has_role(Role.VIEWER):
        return None  # 401, 404, 403: the full path's answers (and its count, made once)
    if (refused := await over_limit(caller.who, "rest")) is not None:
        # runtime_site.errors.exception_handler's answer to it
        body = error_body(str(refused.default_code), str(refused.detail))
        return drf_json(body, negotiated, status=429, **{"Retry-After": str(refused.wait)})
    return drf_json(task_snapshot(caller.task), negotiated)
