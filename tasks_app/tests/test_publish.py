"""publish_all writes django-eventstream's Redis message itself (one pipeline for a commit's
events): it must be the very message send_event publishes, or the web processes' listeners
miss the doorbell and streams only catch up at the next single event. Real Redis."""

from __future__ import annotations

import json
import time
import uuid

from django_eventstream import eventstream

from tasks_app.streams.publish import publish, publish_all


def test_publish_all_sends_for_each_event_the_message_send_event_sends():
    pubsub = eventstream.redis_client.pubsub()
    pubsub.subscribe("events_channel")
    task_id = uuid.uuid4()
    events = [("progress", {"seq": 7, "progress": 0.5}), ("checkpoint", {"seq": 8, "note": "café ✓", "n": None})]
    try:
        deadline = time.monotonic() + 10
        # Subscribed once Redis says so: a message published before then is not delivered.
        while (confirmed := pubsub.get_message(timeout=0.5)) is None and time.monotonic() < deadline:
            pass
        assert confirmed is not None and confirmed["type"] == "subscribe"
        for event_type, data in events:
            publish(task_id, event_type, data)  # send_event, one message each
        publish_all(task_id, events)  # the same, in one pipeline
        received: list[dict] = []
        while len(received) < 4 and time.monotonic() < deadline:
            if (message := pubsub.get_message(timeout=0.5)) is not None and message["type"] == "message":
                payload = json.loads(message["data"])
                if payload.get("channel", "").endswith(str(task_id)):
                    received.append(payload)
    finally:
        pubsub.close()
    assert len(received) == 4, received
    assert received[2:] == received[:2]
