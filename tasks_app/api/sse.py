"""GET /runtime/tasks/{id}/events: the SSE edge (docs/streaming.md).

A stream is its task's snapshot, then every event after it, from the process's fan-out
(tasks_app/streams/hub.py). A caller with an API key is served on the lean path
(runtime_site/lean.py: `lean_task_events`, on the event loop); a dashboard session, a JWT
and every refusal go through `task_events`, the full view. Both send the same bytes.
"""

from __future__ import annotations

import asyncio
import logging
import re
import weakref
from collections.abc import AsyncIterator
from importlib import import_module
from typing import NamedTuple
from uuid import UUID

from asgiref.sync import sync_to_async
from django.conf import settings
from django.contrib import auth
from django.contrib.auth.models import User
from django.db import connection
from django.http import HttpRequest, JsonResponse, StreamingHttpResponse
from django.http.response import HttpResponseBase
from django_eventstream.utils import add_default_headers, sse_encode_event
from rest_framework.exceptions import AuthenticationFailed, PermissionDenied

from common.json_safety import UnsafeInput, check
from runtime_site.errors import (
    RETRY_AFTER_SECONDS,
    allow_methods,
    error_body,
    infrastructure_fault,
    unavailable,
    unsafe_input_body,
)
from runtime_site.lean import LeanStream
from runtime_site.ratelimit import RateLimited
from tasks_app import access, oauth
from tasks_app.api import lean
from tasks_app.auth import (
    ApiKeyAuthentication,
    Principal,
    bearer_token,
    challenge,
    reauthenticate,
    scope_challenge,
)
from tasks_app.errors import Forbidden, TaskNotFound
from tasks_app.models import Role, Task
from tasks_app.selectors import one_snapshot, task_snapshot
from tasks_app.streams.hub import StreamEnded, Subscriber
from tasks_app.streams.publish import channel_for
from tasks_app.streams.wakeups import get_hub

logger = logging.getLogger(__name__)

# An id this stream gives out: <channel>:<seq> (django-eventstream joins several with ",").
LAST_EVENT_ID = re.compile(r"[^\s:,]+:[0-9]{1,18}(,[^\s:,]+:[0-9]{1,18})*")

# As django-eventstream's stream: a padding comment (for proxies that buffer the first
# bytes) and stream-open once the stream has caught up and listens; a keep-alive after
# hub.KEEP_ALIVE_SECONDS without an event.
STREAM_OPEN = ":" + " " * 2048 + "\n\nevent: stream-open\ndata:\n\n"
KEEP_ALIVE = "event: keep-alive\ndata:\n\n"


def _last_event_ids(request: HttpRequest) -> list[tuple[str, str]]:
    given = [("Last-Event-ID", request.headers.get("Last-Event-ID", ""))]
    return given + [("lastEventId", value) for value in request.GET.getlist("lastEventId")]


def check_last_event_id(request: HttpRequest) -> None:
    """A reconnecting client's Last-Event-ID (or ?lastEventId=) must be one we sent. It is
    only checked: a stream always restarts from a fresh snapshot (pitfall 3)."""
    for name, value in _last_event_ids(request):
        check(value, name)
        if value and not LAST_EVENT_ID.fullmatch(value):
            raise UnsafeInput(name, "not an event id this stream sent (<channel>:<seq>)")


def check_last_event_id_of(request: HttpRequest, task: Task) -> None:
    """And one this task's stream sent (check_last_event_id first): of its channel, and no
    later than its last event. Another task's id is a client that mixed up its streams, and
    one beyond the last event was never sent (events go out after their commit, which moved
    event_seq): told so, rather than streamed as if it fitted. Checked once the caller may
    read the task, so the refusal tells nobody else anything of it."""
    channel = channel_for(task.id)
    for name, value in _last_event_ids(request):
        for given in filter(None, value.split(",")):
            given_channel, _, seq = given.rpartition(":")
            if given_channel != channel:
                raise UnsafeInput(name, f"an id of another task's stream (this task's ids are {channel}:<seq>)")
            if int(seq) > task.event_seq:
                raise UnsafeInput(name, f"beyond this task's last event ({task.event_seq}); its stream never sent it")


class Credential(NamedTuple):
    """What a stream's caller proved when it opened: an API key or JWT (`token`), or a
    dashboard session (its key and user), for one tenant."""

    token: str | None
    session_key: str | None
    user_id: int | None
    tenant_id: int


def allowed_still(credential: Credential) -> bool:
    """Whether the stream's caller may still read it: its key is still good (not revoked or
    expired, its user active and a member: auth.reauthenticate, no rate limit), or for a
    dashboard session, the session still signs in its user (not signed out or expired, nor
    made before a password change: auth.get_user), who is active and still a member of the
    task's tenant. Raises what the database or the token's issuer raised when it cannot tell."""
    if credential.token is not None:
        who = reauthenticate(credential.token)
        return who is not None and who.tenant.pk == credential.tenant_id and who.has_role(Role.VIEWER)
    if credential.user_id is None or credential.session_key is None:
        return False
    probe = HttpRequest()  # what auth.get_user reads of a request: its session
    probe.session = import_module(settings.SESSION_ENGINE).SessionStore(credential.session_key)
    signed_in = auth.get_user(probe)
    return signed_in.pk == credential.user_id and (
        User.objects.filter(pk=credential.user_id, is_active=True, memberships__tenant_id=credential.tenant_id).exists()
    )


Verdict = tuple[str, str]  # why a stream ends: ("forbidden", "") or ("unavailable", its cause)


def _judge(credentials: list[Credential]) -> dict[Credential, Verdict | None]:
    """Each credential's verdict: None (still allowed), forbidden, or unavailable when it
    cannot be told now (an infrastructure fault): the stream ends, its client retries."""
    verdicts: dict[Credential, Verdict | None] = {}
    try:
        for credential in credentials:
            try:
                verdicts[credential] = None if allowed_still(credential) else ("forbidden", "")
            except Exception as exc:  # a recheck that raised would end every later one
                if (cause := infrastructure_fault(exc)) is None:
                    # A bug: the stream ends all the same (it cannot be let read on unchecked),
                    # and its reconnect gets the full view's answer.
                    logger.exception("an event stream's credential could not be checked")
                    cause = "the stream's credential could not be checked"
                verdicts[credential] = ("unavailable", cause)
    finally:
        connection.close()  # pitfall 1: a thread of the pool, not a stream's
    return verdicts


class Rechecks:
    """Every stream's caller asked again every stream.auth_recheck_seconds, events or not:
    a stream outlives its request's authentication by hours, and a key revoked or a user
    deactivated meanwhile must stop reading within that bound. One check per credential
    per round, however many streams it holds open."""

    def __init__(self) -> None:
        self.streams: dict[Subscriber, Credential] = {}
        self._task: asyncio.Task[None] | None = None

    def watch(self, sub: Subscriber, credential: Credential) -> None:
        self.streams[sub] = credential
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    def forget(self, sub: Subscriber) -> None:
        self.streams.pop(sub, None)

    async def _run(self) -> None:
        while self.streams:
            await asyncio.sleep(float(settings.RUNTIME["stream"].get("auth_recheck_seconds", 5)))
            credentials = sorted(set(self.streams.values()), key=repr)
            verdicts = await sync_to_async(_judge, thread_sensitive=False)(credentials)
            for sub, credential in list(self.streams.items()):
                if (verdict := verdicts.get(credential)) is not None:
                    sub.end(*verdict)


_rechecks: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Rechecks] = weakref.WeakKeyDictionary()


def unavailable_event(cause: str) -> str:
    """The last event of a stream ended by an infrastructure fault: its cause, in the error
    shape of the 503 its reconnect gets meanwhile, and `retry:` (EventSource's pause before
    it reconnects) set to the Retry-After of that 503."""
    body = error_body("unavailable", f"{cause}; retry shortly")
    return f"retry: {RETRY_AFTER_SECONDS * 1000}\n" + sse_encode_event("unavailable", body, json_encode=True)


def _snapshot_event(task: Task, channel: str) -> str:
    snapshot = {"seq": task.event_seq, **task_snapshot(task)}
    return sse_encode_event("task.snapshot", snapshot, event_id=f"{channel}:{task.event_seq}", json_encode=True)


async def _events(sub: Subscriber, first: str, task_id: UUID, credential: Credential) -> AsyncIterator[str]:
    """The stream's body: its snapshot, then its events until it ends or its caller goes."""
    rechecks = _rechecks.setdefault(asyncio.get_running_loop(), Rechecks())
    rechecks.watch(sub, credential)
    try:
        yield first
        await sub.started.wait()
        yield STREAM_OPEN + (sub.take() or "")
        while True:
            chunk = await sub.next()
            yield KEEP_ALIVE if chunk is None else chunk
    except StreamEnded as end:
        if end.reason == "forbidden":
            # The client reconnects, as SSE does, and gets the 401 that says why.
            logger.info("an event stream ended: its key or user may no longer read it")
        elif end.reason == "unavailable":  # the client reconnects and gets 503 until it is back
            logger.warning("the stream of task %s ended: %s", task_id, end.cause)
            yield unavailable_event(end.cause)
    finally:
        rechecks.forget(sub)
        sub.hub.unsubscribe(sub)


# GET only: a HEAD would authenticate, read the task and open a stream to send no body of.
@allow_methods("GET")
def task_events(request: HttpRequest, task_id: str) -> HttpResponseBase:
    """GET /runtime/tasks/{id}/events: task.snapshot first, then every event after it."""
    try:
        check_last_event_id(request)
    except UnsafeInput as exc:
        return JsonResponse(unsafe_input_body(exc), status=400)
    try:
        authenticated = ApiKeyAuthentication().authenticate(request)  # only reads headers
    except AuthenticationFailed as exc:
        return JsonResponse(
            error_body("authentication_failed", str(exc.detail)),
            status=401,
            headers={"WWW-Authenticate": challenge(request, exc)},
        )
    except PermissionDenied as exc:  # an access token that grants nothing here (tasks_app/oauth.py)
        return JsonResponse(
            error_body("permission_denied", str(exc.detail)),
            status=403,
            headers={"WWW-Authenticate": challenge(request, exc)},
        )
    except oauth.IssuerUnavailable as exc:  # its issuer's keys cannot be read now
        return JsonResponse(
            error_body("issuer_unavailable", str(exc.detail)), status=503, headers={"Retry-After": str(exc.wait)}
        )
    except RateLimited as exc:
        return _throttled(exc)
    who: Principal | User
    if authenticated is not None:
        request.user, who = authenticated
        try:  # reading a stream is the read scope's, as reading the task over REST is
            access.check_role(who, Role.VIEWER)
        except Forbidden as exc:
            step_up = scope_challenge(request, who, exc)
            headers = {"WWW-Authenticate": step_up} if step_up else None
            return JsonResponse(error_body("permission_denied", str(exc)), status=403, headers=headers)
    elif request.user.is_authenticated:
        who = request.user  # a dashboard session: the person's tenants
    else:
        return JsonResponse(
            error_body("not_authenticated", "an API key or a session is required"),
            status=401,
            headers={"WWW-Authenticate": challenge(request)},
        )
    with one_snapshot():  # the row and its open questions, read apart, of one moment
        try:
            task = access.task_for(who, task_id)
        except TaskNotFound as exc:  # another tenant's task: the same answer as no task at all
            return JsonResponse(error_body("not_found", str(exc)), status=404)
        try:
            check_last_event_id_of(request, task)
        except UnsafeInput as exc:
            return JsonResponse(unsafe_input_body(exc), status=400)
        channel = channel_for(task.id)
        first = _snapshot_event(task, channel)
    token = bearer_token(request)
    credential = Credential(
        token, None if token else request.session.session_key, None if token else request.user.pk, task.tenant_id
    )
    connection.close()  # pitfall 1: the request's connection would otherwise live as long as the stream

    async def body() -> AsyncIterator[str]:
        # Registered after the snapshot was read (this view runs on a thread): it catches up
        # from the database before it opens.
        hub = get_hub()
        sub = hub.subscribe(channel)
        hub.start(sub, task.event_seq, registered_before_read=False)
        async for chunk in _events(sub, first, task.id, credential):
            yield chunk

    response = StreamingHttpResponse(body(), content_type="text/event-stream")
    add_default_headers(response, request=request)
    return response


def _throttled(exc: RateLimited) -> JsonResponse:
    return JsonResponse(error_body("throttled", str(exc.detail)), status=429, headers={"Retry-After": str(exc.wait)})


async def lean_task_events(request: HttpRequest, task_id: str) -> HttpResponseBase | None:
    """task_events on the event loop, for an API key and a task of its tenant; anything else
    (a session, a JWT, a refusal) is the full view's."""
    from runtime_site import dbpool

    try:
        check_last_event_id(request)
        uuid = UUID(task_id)
    except (UnsafeInput, ValueError):
        return None
    if not dbpool.async_available():
        return None
    hub = get_hub()
    channel = channel_for(uuid)
    sub = hub.subscribe(channel)  # before the snapshot is read: no read needed to start (hub.py)
    try:
        try:
            caller = await lean.read_caller(request, uuid)
        except Exception as exc:
            if (cause := infrastructure_fault(exc)) is None:
                raise
            hub.unsubscribe(sub)
            return unavailable(cause)
        if caller is None or caller.task is None:
            hub.unsubscribe(sub)
            return None  # 401, 404: the full view's answers (and its count, made once)
        try:
            check_last_event_id_of(request, caller.task)
        except UnsafeInput:
            hub.unsubscribe(sub)
            return None  # the full view's 400, as for a malformed id
        if (refused := await lean.over_limit(caller.who, "sse")) is not None:
            hub.unsubscribe(sub)
            return _throttled(refused)
    except BaseException:
        hub.unsubscribe(sub)
        raise
    task = caller.task
    hub.start(sub, task.event_seq)
    credential = Credential(bearer_token(request), None, None, task.tenant_id)
    response = LeanStream(
        _events(sub, _snapshot_event(task, channel), task.id, credential),
        content_type="text/event-stream",
        on_close=lambda: hub.unsubscribe(sub),
    )
    add_default_headers(response, request=request)
    return response
