"""Our patches to django-eventstream's listener manager (tasks_app/streams/ says why).

Written against django-eventstream 5.3.4: they replace library internals
(ListenerManager.add_listener and add_to_queues, views.sync_to_async), so another release
must be read against them before it is let in.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from importlib.metadata import version
from typing import Any

from asgiref.sync import sync_to_async
from django_eventstream.event import Event

WRITTEN_FOR = "5.3.4"
if version("django-eventstream") != WRITTEN_FOR:
    raise RuntimeError(
        f"runtime_site/patches/eventstream.py patches django-eventstream {WRITTEN_FOR} internals, "
        f"but {version('django-eventstream')} is installed: check each patch against its source, "
        "then update WRITTEN_FOR"
    )

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


def install(on_listener: Callable[[], None]) -> None:
    """Called from TasksAppConfig.ready() in every process (harmless where nothing streams).
    `on_listener` runs on each new stream, on the event loop: it keeps our own listener
    running (tasks_app.streams.wakeups.ensure_running); the library's never starts."""
    from django_eventstream import views

    views.get_listener_manager().redis_listener = None  # theirs never starts
    original_add = views.ListenerManager.add_listener

    def add_listener(self: Any, listener: Any) -> None:
        original_add(self, listener)
        on_listener()

    views.ListenerManager.add_listener = add_listener
    views.ListenerManager.add_to_queues = _add_to_queues
    # Streams read storage (our TaskEvent rows; each read closes its connection) in the
    # default thread pool, in parallel, not one by one on asgiref's single shared thread.
    views.sync_to_async = functools.partial(sync_to_async, thread_sensitive=False)
