"""GET /runtime/tasks/{id}/events: the SSE edge (docs/streaming.md).

The stream plumbing under it (storage, channel manager, the django-eventstream patches)
is tasks_app/streams/; this module is only the view a client talks to.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator, Callable
from importlib import import_module

from asgiref.sync import sync_to_async
from django.conf import settings
from django.contrib import auth
from django.contrib.auth.models import User
from django.db import connection
from django.http import HttpRequest, JsonResponse, StreamingHttpResponse
from django.http.response import HttpResponseBase
from django_eventstream.eventrequest import EventRequest
from django_eventstream.utils import add_default_headers, sse_encode_event
from django_eventstream.views import Listener, stream
from rest_framework.exceptions import AuthenticationFailed, PermissionDenied

from common.json_safety import UnsafeInput, check
from runtime_site.errors import DATABASE_UNAVAILABLE, error_body, unsafe_input_body
from runtime_site.ratelimit import RateLimited
from tasks_app import access, oauth
from tasks_app.auth import ApiKeyAuthentication, Principal, bearer_token, reauthenticate
from tasks_app.errors import Forbidden, TaskNotFound
from tasks_app.models import Role
from tasks_app.selectors import task_snapshot
from tasks_app.streams.publish import channel_for

logger = logging.getLogger(__name__)

# An id this stream gives out: <channel>:<seq> (django-eventstream joins several with ",").
LAST_EVENT_ID = re.compile(r"[^\s:,]+:[0-9]{1,18}(,[^\s:,]+:[0-9]{1,18})*")


def check_last_event_id(request: HttpRequest) -> None:
    """A reconnecting client's Last-Event-ID (or ?lastEventId=) must be one we sent. It is
    only checked: a stream always restarts from a fresh snapshot (pitfall 3)."""
    given = [("Last-Event-ID", request.headers.get("Last-Event-ID", ""))]
    given += [("lastEventId", value) for value in request.GET.getlist("lastEventId")]
    for name, value in given:
        check(value, name)
        if value and not LAST_EVENT_ID.fullmatch(value):
            raise UnsafeInput(name, "not an event id this stream sent (<channel>:<seq>)")


def _allowed_still(
    token: str | None, session_key: str | None, user_id: int | None, tenant_id: int
) -> Callable[[], bool]:
    """Whether the stream's caller may still read it: its key is still good (not revoked or
    expired, its user active and a member: auth.reauthenticate), or for a
    dashboard session, the session still signs in its user (not signed out or expired, nor
    made before a password change: auth.get_user), who is active and still a member of the
    task's tenant."""

    def check() -> bool:
        try:
            if token is not None:
                who = reauthenticate(token)
                return who is not None and who.tenant.pk == tenant_id and who.has_role(Role.VIEWER)
            if user_id is None or session_key is None:
                return False
            probe = HttpRequest()  # what auth.get_user reads of a request: its session
            probe.session = import_module(settings.SESSION_ENGINE).SessionStore(session_key)
            signed_in = auth.get_user(probe)
            return signed_in.pk == user_id and (
                User.objects.filter(pk=user_id, is_active=True, memberships__tenant_id=tenant_id).exists()
            )
        finally:
            connection.close()

    return check


async def _guarded(chunks: AsyncIterator[str], allowed: Callable[[], bool], every: float) -> AsyncIterator[str]:
    """The chunks of `chunks` while allowed() holds, asked every `every` seconds whether
    events flow or not: a stream outlives its request's authentication by hours, and a key
    revoked or a user deactivated meanwhile must stop reading within that bound. The stream
    is pumped by its own task so the check never waits for the next event."""
    queue: asyncio.Queue[str] = asyncio.Queue(maxsize=64)

    async def pump() -> None:
        async for chunk in chunks:
            await queue.put(chunk)

    loop = asyncio.get_running_loop()
    producer = asyncio.ensure_future(pump())
    next_check = loop.time() + every
    try:
        while True:
            getter = asyncio.ensure_future(queue.get())
            await asyncio.wait(
                {getter, producer}, timeout=max(0.0, next_check - loop.time()), return_when=asyncio.FIRST_COMPLETED
            )
            if not getter.done():
                getter.cancel()
            if getter.done() and not getter.cancelled():
                yield getter.result()
            elif producer.done() and queue.empty():
                producer.result()  # the stream's own error (the database went away), or its end
                return
            if loop.time() >= next_check:
                if not await sync_to_async(allowed)():
                    # The client reconnects, as SSE does, and gets the 401 that says why.
                    logger.info("an event stream ended: its key or user may no longer read it")
                    return
                next_check = loop.time() + every
    finally:
        producer.cancel()


def task_events(request: HttpRequest, task_id: str) -> HttpResponseBase:
    """GET /runtime/tasks/{id}/events: task.snapshot first, then every event after it."""
    try:
        check_last_event_id(request)
    except UnsafeInput as exc:
        return JsonResponse(unsafe_input_body(exc), status=400)
    try:
        authenticated = ApiKeyAuthentication().authenticate(request)  # only reads headers
    except AuthenticationFailed as exc:
        return JsonResponse(error_body("authentication_failed", str(exc.detail)), status=401)
    except PermissionDenied as exc:  # an access token that grants nothing here (tasks_app/oauth.py)
        return JsonResponse(error_body("permission_denied", str(exc.detail)), status=403)
    except oauth.IssuerUnavailable as exc:  # its issuer's keys cannot be read now
        return JsonResponse(
            error_body("issuer_unavailable", str(exc.detail)), status=503, headers={"Retry-After": str(exc.wait)}
        )
    except RateLimited as exc:
        return JsonResponse(
            error_body("throttled", str(exc.detail)), status=429, headers={"Retry-After": str(exc.wait)}
        )
    who: Principal | User
    if authenticated is not None:
        request.user, who = authenticated
        try:  # reading a stream is the read scope's, as reading the task over REST is
            access.check_role(who, Role.VIEWER)
        except Forbidden as exc:
            return JsonResponse(error_body("permission_denied", str(exc)), status=403)
    elif request.user.is_authenticated:
        who = request.user  # a dashboard session: the person's tenants
    else:
        return JsonResponse(error_body("not_authenticated", "an API key or a session is required"), status=401)
    try:
        task = access.task_for(who, task_id)
    except TaskNotFound as exc:  # another tenant's task: the same answer as no task at all
        return JsonResponse(error_body("not_found", str(exc)), status=404)

    channel = channel_for(task.id)
    snapshot = {"seq": task.event_seq, **task_snapshot(task)}
    # Made here, not from the request: its query (es-meta, recover, link) is not ours to
    # honour, and django-eventstream's parsing of it answers anything malformed with a 500.
    event_request = EventRequest()
    event_request.channels, event_request.user = {channel}, request.user
    event_request.is_next = event_request.is_recover = False
    # Pitfall 3: start from an explicit id, the snapshot's; never from "now".
    event_request.channel_last_ids = {channel: str(task.event_seq)}
    connection.close()  # pitfall 1: the request's connection would otherwise live as long as the stream

    listener = Listener()
    listener.user_id = request.user.pk
    listener.channels = event_request.channels
    first = sse_encode_event("task.snapshot", snapshot, event_id=f"{channel}:{task.event_seq}", json_encode=True)
    allowed = _allowed_still(bearer_token(request), request.session.session_key, request.user.pk, task.tenant_id)
    every = float(settings.RUNTIME["stream"].get("auth_recheck_seconds", 5))

    async def body() -> AsyncIterator[str]:
        yield first
        try:
            async for chunk in _guarded(stream(event_request, listener), allowed, every):
                yield chunk
        except DATABASE_UNAVAILABLE:  # the client reconnects, as SSE does, and gets 503 until it is back
            logger.warning("the stream of task %s ended: the database is unavailable", task.id)

    response = StreamingHttpResponse(body(), content_type="text/event-stream")
    add_default_headers(response, request=request)
    return response
