"""Waking this web process's open streams (pitfalls 2 and 4 in publish.py).

With Redis, one reconnecting subscription per process to django-eventstream's pub/sub
channel feeds the hub (hub.py), replacing the library's own listener, which dies silently
when Redis restarts; after every (re)subscribe the hub's streams catch up from the database,
so events published during the outage still arrive. Without Redis (the embedded profile), a
database-polling bridge tells the hub which tasks' event_seq moved. One background task per
event loop runs either, started with the first stream and restarted if it ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections.abc import Iterator
from uuid import UUID

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import connection

from tasks_app.models import Task
from tasks_app.streams.hub import Hub, loop_hub, parse_message
from tasks_app.streams.publish import channel_for, task_id_from

logger = logging.getLogger(__name__)


_waiters: dict[str, set[asyncio.Event]] = {}  # channel -> what waits in this process for its next event


@contextlib.contextmanager
def waiting_for(task_id: UUID) -> Iterator[asyncio.Event]:
    """On the event loop: an asyncio.Event set whenever the task publishes an event (read
    by this loop's Redis listener, which this starts if it is not running) and whenever
    the listener (re)subscribes (it may have missed some). A hint to look at the database
    again, as every wakeup is: without Redis it is never set, and the waiter polls."""
    get_hub()
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


async def _resilient_listen(hub: Hub) -> None:
    from redis.asyncio import Redis

    backoff = 0.2
    while True:
        # Not the publisher's socket_timeout and retry (settings.EVENTSTREAM_REDIS): a quiet channel is no failure.
        client = Redis(**{k: v for k, v in settings.EVENTSTREAM_REDIS.items() if k not in ("socket_timeout", "retry")})
        try:
            pubsub = client.pubsub()
            await pubsub.subscribe("events_channel")
            async for message in pubsub.listen():
                if message["type"] == "subscribe":
                    # First subscribe, or redis-py's own silent re-subscribe after a
                    # reconnect: whatever was published meanwhile is only in storage.
                    backoff = 0.2
                    hub.subscribed()
                    _wake_waiters()
                    continue
                if message["type"] != "message":
                    continue
                if (event := parse_message(message["data"])) is not None:  # None: pitfall 4
                    hub.publish(*event)
                    _wake_waiters(event[0])
            raise ConnectionError("pub/sub stream ended")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 (the listener outlives any failure: it reconnects)
            hub.lost()
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


async def _poll_bridge(hub: Hub, interval: float) -> None:
    """Embedded profile: no Redis, so watch event_seq of the tasks that have open streams."""
    read = sync_to_async(_seqs, thread_sensitive=False)
    while True:
        await asyncio.sleep(interval)
        if not hub.channels:
            continue
        try:
            current = await read(list(hub.channels))
        except Exception:
            logger.exception("SSE database bridge failed to poll")
            continue
        hub.resync(current)


_background: weakref.WeakKeyDictionary[Hub, asyncio.Task[None]] = weakref.WeakKeyDictionary()


def ensure_running(hub: Hub) -> None:
    """On every new stream: the reconnecting Redis listener, or the database bridge without
    Redis, feeds `hub` (the running loop's)."""
    task = _background.get(hub)
    if task is None or task.done():
        if getattr(settings, "EVENTSTREAM_REDIS", None):
            coroutine = _resilient_listen(hub)
        else:
            coroutine = _poll_bridge(hub, settings.RUNTIME["stream"]["poll_seconds"])
        _background[hub] = asyncio.get_running_loop().create_task(coroutine)


def get_hub() -> Hub:
    """The running event loop's hub, fed by its subscription (started here if it is not running)."""
    hub = loop_hub()
    ensure_running(hub)
    return hub
