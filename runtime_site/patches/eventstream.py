"""Our patch to django-eventstream (tasks_app/streams/ says why).

Written against django-eventstream 5.3.4, whose internals it touches, so another release
must be read against it before it is let in. The library publishes our events (send_event,
in every process) and encodes them (sse_encode_event, make_id); its listener manager and
stream view are not used: tasks_app/streams/hub.py fans events out to the streams.
tasks_app/streams/publish.py's publish_all writes send_event's Redis message itself (several
in one pipeline): that message's shape is one more internal to read against a new release.
"""

from __future__ import annotations

from importlib.metadata import version

WRITTEN_FOR = "5.3.4"
if version("django-eventstream") != WRITTEN_FOR:
    raise RuntimeError(
        f"runtime_site/patches/eventstream.py patches django-eventstream {WRITTEN_FOR} internals, "
        f"but {version('django-eventstream')} is installed: check each patch against its source, "
        "then update WRITTEN_FOR"
    )


def install() -> None:
    """Called from TasksAppConfig.ready() in every process: the library's own Redis listener,
    which dies silently when Redis restarts (pitfall 2), never starts; ours
    (tasks_app/streams/wakeups.py) feeds the hub."""
    from django_eventstream import views

    views.get_listener_manager().redis_listener = None
