"""Waking this web process's open streams (pitfalls 2 and 4 in publish.py).

With Redis, a reconnecting listener of django-eventstream's pub/sub channel replaces the
library's own, which dies silently when Redis restarts; without Redis (the embedded
profile), a database-polling bridge wakes the streams whose task's event_seq moved. One
background task per process runs either, started with the first stream and restarted if
it ended (ensure_running, hooked in by runtime_site/patches/eventstream.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Iterator
from uuid import UUID

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import connection
from django_eventstream.event import Event

from tasks_app.models import Task
from tasks_app.streams.publish import channel_for, task_id_from

logger = logging.getLogger(__name__)


def wake_all(channels: set[str] | None = None) -> None:
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


_waiters: dict[str, set[asyncio.Event]] = {}  # channel -> what waits in this process for its next event


@contextlib.contextmanager
def waiting_for(task_id: UUID) -> Iterator[asyncio.Event]:
    """On the event loop: an asyncio.Event set whenever the task publishes an event (read
    by this process's Redis listener, which this starts if it is not running) and whenever
    the listener (re)subscribes (it may have missed some). A hint to look at the database
    again, as every wakeup is: without Redis it is never set, and the waiter polls."""
    ensure_running()
    channel, woken = channel_for(task_id), asyncio.Event()
    _waiters.setdefault(channel, set()).add(woken)
    try:
        yield woken
    finally:
        waiting = _waiters.get(channel, set())
        waiting.discard(woken)
        if not waiting:
            _waiters.pop(channel, None)


def _wake_waiters(channel: str | None = None) -> None:
    for woken in _waiters.get(channel, set()) if channel is not None else set().union(*_waiters.values()):
        woken.set()


async def _resilient_listen() -> None:
    from django_eventstream.views import get_listener_manager
    from redis.asyncio import Redis

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
                    wake_all()
                    _wake_waiters()
                    continue
                if message["type"] != "message":
                    continue
                event = json.loads(message["data"])
                if task_id_from(event["channel"]) is None:
                    continue  # pitfall 4: another deployment's event
                _wake_waiters(event["channel"])
                get_listener_manager().add_to_queues(
                    event["channel"], Event(event["channel"], event["event_type"], event["data"], id=event["pub_id"])
                )
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
            wake_all(moved)


_background: dict[str, asyncio.Task[None]] = {}  # strong references: the loop keeps only weak ones


def ensure_running() -> None:
    """On every new stream: the reconnecting Redis listener, or the database bridge without
    Redis, runs in this process (django-eventstream starts its own listener with a bare
    loop.create_task() and never again: once that task dies, no stream gets a live event)."""
    task = _background.get("task")
    if task is None or task.done():
        if getattr(settings, "EVENTSTREAM_REDIS", None):
            coroutine = _resilient_listen()
        else:
            coroutine = _poll_bridge(settings.RUNTIME["stream"]["poll_seconds"])
        _background["task"] = asyncio.get_event_loop().create_task(coroutine)
