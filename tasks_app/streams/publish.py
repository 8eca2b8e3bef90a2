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
import functools
import json
import logging
from typing import Any
from uuid import UUID

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import connection
from django.http import HttpRequest
from django_eventstream.channelmanager import ChannelManagerBase
from django_eventstream.event import Event
from django_eventstream.storage import StorageBase

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
        try:
            rows = TaskEvent.objects.filter(task_id=task_id_from(channel), seq__gt=last_id).order_by("seq")[:limit]
            return [Event(channel, row.type, json.dumps(row.data), id=row.seq) for row in rows]
        finally:
            connection.close()  # pitfall 1: never hold a connection for a stream's lifetime

    def get_current_id(self, channel: str) -> int:
        try:
            return Task.objects.filter(id=task_id_from(channel)).values_list("event_seq", flat=True).first() or 0
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
        except Exception as exc:
            logger.warning("SSE Redis listener lost its connection (%s); reconnecting in %.1fs", exc, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)
        finally:
            try:
                await client.aclose()
            except Exception:  # noqa: S110 (the connection is already broken)
                pass


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
