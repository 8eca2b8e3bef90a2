"""The stream plumbing that needs no server: our patches to django-eventstream's queues."""

from __future__ import annotations

import asyncio

from django_eventstream.event import Event
from django_eventstream.views import Listener, ListenerManager

from runtime_site.patches import eventstream


def test_a_lagging_stream_queues_up_to_max_pending_then_rereads_storage():
    async def scenario() -> tuple[int, bool, int, bool]:
        manager, listener = ListenerManager(), Listener()
        listener.assign_loop()
        listener.channels = {"task-x"}
        manager.listeners_by_channel["task-x"] = {listener}
        for seq in range(1, eventstream.MAX_PENDING + 1):
            manager.add_to_queues("task-x", Event("task-x", "log", "{}", id=seq))
        queued, overflowed = len(listener.channel_items["task-x"]), listener.overflow
        manager.add_to_queues("task-x", Event("task-x", "log", "{}", id=eventstream.MAX_PENDING + 1))
        return queued, overflowed, len(listener.channel_items.get("task-x", [])), listener.overflow

    queued, overflowed, after, overflowed_after = asyncio.run(scenario())
    assert (queued, overflowed) == (eventstream.MAX_PENDING, False)  # a short stall costs no re-read
    assert (after, overflowed_after) == (0, True)  # past it: nothing queued, the stream re-reads storage
