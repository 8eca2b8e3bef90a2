"""Live progress over SSE through django-eventstream (DESIGN §7, STACK-NOTES §1).

Events are stored with the task's seq in the transaction of the change
(tasks_app.events); this module publishes them after commit and is the storage
django-eventstream's send_event stores through (the view: tasks_app/api/sse.py; the
fan-out to a web process's streams: hub.py).

The four verified pitfalls of django-eventstream 5.3, and what we do about each:
1. A database connection held per open stream: a stream holds none; its reads (its start,
   and the catch-up reads hub.py shares per task) borrow one of a small pool for the read
   only, or, without that pool, close the connection of the thread they ran on.
2. The Redis listener dies silently when Redis restarts: wakeups.py replaces it with one
   that reconnects with backoff and, after every (re)subscribe, makes each open stream
   catch up from storage from its last seq, so events published during the outage still
   arrive (runtime_site/patches/eventstream.py keeps the library's from starting).
3. The start-up race: every stream starts from the snapshot's seq and is registered with
   the hub before that snapshot is read, so the server never skips an event; a duplicate
   is possible and clients drop any event whose seq is not above the last one they saw
   (docs/streaming.md).
4. One shared pub/sub channel for all deployments: channel names carry the deployment
   prefix (RUNTIME_DEPLOYMENT), so a web process only ever wakes its own streams.
Without Redis (the embedded default), a small database-polling bridge in the web
process wakes the streams whose task's event_seq moved (wakeups.py).
"""

from __future__ import annotations

import json
import logging
from typing import Any
from uuid import UUID

from django.conf import settings
from django.core.serializers.json import DjangoJSONEncoder
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


def publish_all(task_id: UUID, events: list[tuple[str, dict[str, Any]]]) -> None:
    """publish() of each (type, data), in order. With Redis and no GRIP proxy (ours), the
    messages send_event would publish go in one pipeline, one round trip for a commit's
    events (a slice's end has two or three: progress, checkpoint). The message is
    django-eventstream's own, as the release runtime_site/patches/eventstream.py is held to
    writes it (tasks_app/tests/test_publish.py holds the two the same)."""
    from django_eventstream import eventstream

    client = eventstream.redis_client
    if (
        len(events) < 2
        or client is None
        or getattr(settings, "GRIP_URL", None)
        or getattr(settings, "GRIP_PROXIES", None)
    ):
        for event_type, data in events:
            publish(task_id, event_type, data)
        return
    channel = channel_for(task_id)
    try:
        pipe = client.pipeline(transaction=False)
        for event_type, data in events:
            # What send_event publishes: the payload as JSON text, its id the event's seq (TaskEventStorage).
            message = {
                "channel": channel,
                "event_type": event_type,
                "data": json.dumps(data, cls=DjangoJSONEncoder),
                "pub_id": str(data["seq"]),
            }
            pipe.publish("events_channel", json.dumps(message))
        pipe.execute()
    except Exception:
        logger.warning(
            "could not publish events #%s-#%s of task %s; streams will catch up from storage",
            events[0][1].get("seq"),
            events[-1][1].get("seq"),
            task_id,
            exc_info=True,
        )


def publish(task_id: UUID, event_type: str, data: dict[str, Any]) -> None:
    """After commit: ring the doorbell of the task's streams. The event is already stored;
    if Redis is down, streams catch up from storage once it is back, so never re-send."""
    from django_eventstream import send_event

    try:
        send_event(channel_for(task_id), event_type, data)
    except Exception:
        logger.warning(
            "could not publish %s #%s of task %s; streams will catch up from storage",
            event_type,
            data.get("seq"),
            task_id,
            exc_info=True,
        )
