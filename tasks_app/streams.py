"""Live progress over SSE through django-eventstream (DESIGN §7, STACK-NOTES §1).

Events are stored with the task's seq in the transaction of the change
(tasks_app.events); this module publishes them after commit and serves them.

The four verified pitfalls of django-eventstream 5.3, and what we do about each:
1. A database connection held per open stream: our storage and channel manager close
   the connection of the thread they ran on; the view closes its own before streaming.
2. The Redis listener dies silently when Redis restarts: install() replaces it with one
   that reconnects with backoff and, after every (re)subscribe, makes each open stream
   re-read storage from its last id, so events published during the outage still arrive.
3. The start-up race: every stream starts from an explicit last id (the snapshot's seq),
   so the server never skips an event; a duplicate is possible and clients drop any
   event whose seq is not above the last one they saw (docs/streaming.md).
4. One shared pub/sub channel for all deployments: channel names carry the deployment
   prefix (RUNTIME_DEPLOYMENT), so a web process only ever wakes its own streams.
Without Redis (the embedded default), a small database-polling bridge in the web
process wakes the streams whose task's event_seq moved.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import re
from collections.abc import AsyncIterator
from typing import Any
from uuid import UUID

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import connection
from django.http import HttpRequest, JsonResponse, StreamingHttpResponse
from django.http.response import HttpResponseBase
from django_eventstream.channelmanager import ChannelManagerBase
from django_eventstream.event import Event
from django_eventstream.storage import StorageBase

from common.json_safety import UnsafeInput, check
from tasks_app.models import Membership, Task, TaskEvent

logger = logging.getLogger(__name__)


def channel_for(task_id: UUID | str) -> str:
    # No ":" in it: django-eventstream's Last-Event-ID format is "<channel>:<id>".
    return f"{settings.RUNTIME_DEPLOYMENT}.task-{task_id}"


def task_id_from(channel: str) -> UUID | None:
    prefix = f"{settings.RUNTIME_DEPLOYMENT}.task-"
    if not channel.startswith(prefix):
        return None  # another deployment's channel, or garbage
    try:
        return UUID(channel.removeprefix(prefix))
    except ValueError:
        return None


class TaskEventStorage(StorageBase):
    """django-eventstream storage over our TaskEvent rows; an event's id is its seq."""

    def append_event(self, channel: str, event_type: str, data: str) -> Event:
        # Already stored by tasks_app.events in the change's own transaction; send_event
        # only needs its id, which the payload carries.
        return Event(channel, event_type, data, id=json.loads(data)["seq"])

    def get_events(self, channel: str, last_id: int, limit: int = 100) -> list[Event]:
        if (task_id := task_id_from(channel)) is None:
            return []
        try:
            rows = TaskEvent.objects.filter(task_id=task_id, seq__gt=last_id).order_by("seq")[:limit]
            return [Event(channel, row.type, json.dumps(row.data), id=row.seq) for row in rows]
        finally:
            connection.close()  # pitfall 1: never hold a connection for a stream's lifetime

    def get_current_id(self, channel: str) -> int:
        if (task_id := task_id_from(channel)) is None:
            return 0
        try:
            return Task.objects.filter(id=task_id).values_list("event_seq", flat=True).first() or 0
        finally:
            connection.close()


class TaskChannelManager(ChannelManagerBase):
    def get_channels_for_request(self, request: HttpRequest, view_kwargs: dict[str, Any]) -> set[str]:
        return {channel_for(view_kwargs["task_id"])}  # from our URL only, never from ?channel=

    def can_read_channel(self, user: Any, channel: str) -> bool:
        task_id = task_id_from(channel)
        if user is None or task_id is None:
            return False
        try:
            tenants = Membership.objects.filter(user=user).values("tenant_id")
            return Task.objects.filter(id=task_id, tenant_id__in=tenants).exists()
        finally:
            connection.close()

    def is_channel_reliable(self, channel: str) -> bool:
        return True


def publish(task_id: UUID, event_type: str, data: dict[str, Any]) -> None:
    """After commit: ring the doorbell of the task's streams. The event is already stored;
    if Redis is down, streams catch up from storage once it is back, so never re-send."""
    from django_eventstream import send_event

    try:
        send_event(channel_for(task_id), event_type, data)
    except Exception:
        logger.warning("could not publish %s #%s of task %s; streams will catch up from storage",
                       event_type, data.get("seq"), task_id, exc_info=True)


# --- the view -----------------------------------------------------------------------------

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


def task_events(request: HttpRequest, task_id: str) -> HttpResponseBase:
    """GET /runtime/tasks/{id}/events: task.snapshot first, then every event after it."""
    from django_eventstream.eventrequest import EventRequest
    from django_eventstream.utils import add_default_headers, sse_encode_event
    from django_eventstream.views import Listener, stream
    from rest_framework.exceptions import AuthenticationFailed

    from runtime_site.errors import DATABASE_UNAVAILABLE, error_body, unsafe_input_body
    from tasks_app.auth import ApiKeyAuthentication
    from tasks_app.selectors import task_snapshot

    try:
        check_last_event_id(request)
    except UnsafeInput as exc:
        return JsonResponse(unsafe_input_body(exc), status=400)
    try:
        authenticated = ApiKeyAuthentication().authenticate(request)  # only reads headers
    except AuthenticationFailed as exc:
        return JsonResponse(error_body("authentication_failed", str(exc.detail)), status=401)
    if authenticated is not None:
        request.user, tenant_ids = authenticated[0], [authenticated[1].tenant.id]
    elif request.user.is_authenticated:
        tenant_ids = list(Membership.objects.filter(user=request.user).values_list("tenant_id", flat=True))
    else:
        return JsonResponse(error_body("not_authenticated", "an API key or a session is required"), status=401)
    try:
        task = Task.objects.filter(id=UUID(task_id), tenant_id__in=tenant_ids).first()
    except ValueError:
        task = None
    if task is None:  # another tenant's task: the same answer as no task at all
        return JsonResponse(error_body("not_found", "no such task"), status=404)

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

    async def body() -> AsyncIterator[str]:
        yield first
        try:
            async for chunk in stream(event_request, listener):
                yield chunk
        except DATABASE_UNAVAILABLE:  # the client reconnects, as SSE does, and gets 503 until it is back
            logger.warning("the stream of task %s ended: the database is unavailable", task.id)

    response = StreamingHttpResponse(body(), content_type="text/event-stream")
    add_default_headers(response, request=request)
    return response


# --- pitfall 2 and the embedded bridge ----------------------------------------------------

def _wake_all(channels: set[str] | None = None) -> None:
    """Make open streams (of `channels`, or all) re-read storage from their last id.

    Queued items are dropped: the stream would send them before re-reading, move its
    last id past the events it missed, and skip those (they are all in storage)."""
    from django_eventstream.views import get_listener_manager

    manager = get_listener_manager()
    with manager.lock:
        for channel, listeners in manager.listeners_by_channel.items():
            if channels is None or channel in channels:
                for listener in listeners:
                    listener.overflow = True
                    listener.channel_items = {}
                    listener.wake_threadsafe()


# django-eventstream sends a stream back to storage once 10 events wait for it. With
# hundreds of streams a short stall of the event loop overflowed them all at once, and
# their re-reads, serialized on one thread, made the stall longer (500 streams: p95 from
# ~0.1 s to 1.7 s, bench/streams.py). Events are small; let more wait.
MAX_PENDING = 200


def _add_to_queues(self: Any, channel: str, event: Event) -> None:
    """django-eventstream's add_to_queues, except that a stream already due to re-read
    storage (overflow) queues nothing more: anything queued would be sent before the
    re-read and could carry its last id past events it has not seen."""
    with self.lock:
        for listener in self.listeners_by_channel.get(channel, set()):
            items = listener.channel_items.setdefault(channel, [])
            if not listener.overflow and len(items) < MAX_PENDING:
                items.append(event)
            else:
                listener.overflow = True
                listener.channel_items = {}
            listener.wake_threadsafe()


async def _resilient_listen() -> None:
    from redis.asyncio import Redis

    from django_eventstream.views import get_listener_manager

    backoff = 0.2
    while True:
        client = Redis(**settings.EVENTSTREAM_REDIS)
        try:
            pubsub = client.pubsub()
            await pubsub.subscribe("events_channel")
            async for message in pubsub.listen():
                if message["type"] == "subscribe":
                    # First subscribe, or redis-py's own silent re-subscribe after a
                    # reconnect: whatever was published meanwhile is only in storage.
                    backoff = 0.2
                    _wake_all()
                    continue
                if message["type"] != "message":
                    continue
                event = json.loads(message["data"])
                if task_id_from(event["channel"]) is None:
                    continue  # pitfall 4: another deployment's event
                get_listener_manager().add_to_queues(
                    event["channel"], Event(event["channel"], event["event_type"], event["data"], id=event["pub_id"]))
            raise ConnectionError("pub/sub stream ended")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 (the listener outlives any failure: it reconnects)
            logger.warning("SSE Redis listener lost its connection (%s); reconnecting in %.1fs", exc, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)
        finally:
            with contextlib.suppress(Exception):  # the connection is already broken
                await client.aclose()


def _seqs(channels: list[str]) -> dict[str, int]:
    try:
        ids = {task_id_from(c): c for c in channels}
        rows = Task.objects.filter(id__in=[i for i in ids if i]).values_list("id", "event_seq")
        return {ids[task_id]: seq for task_id, seq in rows}
    finally:
        connection.close()


async def _poll_bridge(interval: float) -> None:
    """Embedded profile: no Redis, so watch event_seq of the tasks that have open streams."""
    from django_eventstream.views import get_listener_manager

    seen: dict[str, int] = {}
    read = sync_to_async(_seqs, thread_sensitive=False)
    while True:
        await asyncio.sleep(interval)
        manager = get_listener_manager()
        with manager.lock:
            channels = list(manager.listeners_by_channel)
        if not channels:
            seen.clear()
            continue
        try:
            current = await read(channels)
        except Exception:
            logger.exception("SSE database bridge failed to poll")
            continue
        moved = {c for c, seq in current.items() if seen.get(c) != seq}  # a new stream counts as moved
        seen = current
        if moved:
            _wake_all(moved)


_background: dict[str, asyncio.Task[None]] = {}  # strong references: the loop keeps only weak ones


def install() -> None:
    """Called from TasksAppConfig.ready() in every process (harmless where nothing streams).

    django-eventstream starts its Redis listener with a bare loop.create_task() and never
    again: once that task is garbage-collected or dies, no stream of the process gets a
    live event. We start our own background task (the reconnecting Redis listener, or the
    database bridge without Redis), keep a reference to it, and restart it if it ended.
    """
    from django_eventstream import views

    views.get_listener_manager().redis_listener = None  # theirs never starts
    original_add = views.ListenerManager.add_listener

    def add_listener(self: Any, listener: Any) -> None:
        original_add(self, listener)
        task = _background.get("task")
        if task is None or task.done():
            if getattr(settings, "EVENTSTREAM_REDIS", None):
                coroutine = _resilient_listen()
            else:
                coroutine = _poll_bridge(settings.RUNTIME["stream"]["poll_seconds"])
            _background["task"] = asyncio.get_event_loop().create_task(coroutine)

    views.ListenerManager.add_listener = add_listener
    views.ListenerManager.add_to_queues = _add_to_queues
    # Streams read storage (our TaskEvent rows; each read closes its connection) in the
    # default thread pool, in parallel, not one by one on asgiref's single shared thread.
    views.sync_to_async = functools.partial(sync_to_async, thread_sensitive=False)
