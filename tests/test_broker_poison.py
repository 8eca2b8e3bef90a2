"""A message on a Redis queue that no worker can read (not JSON, truncated, NUL bytes, bad
base64, a content type the worker refuses, an unknown task, huge) is set aside in the
deployment's unreadable list with its queue and reason, logged once, and the worker takes
the next messages (runtime_site/patches/kombu.py and consumer.py). Before, the first of
them ended the worker ("Unrecoverable error: JSONDecodeError") and was gone with it."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
import redis
from celery import current_app
from django.conf import settings

from conftest import FAST_LEASES, Processes, wait_until
from runtime_site.patches.kombu import UNREADABLE_ENTRY_BYTES
from tasks_app.access import console
from tasks_app.actions import do_create_task
from tasks_app.models import Task
from tasks_app.queue import SLICE_TASK

pytestmark = pytest.mark.django_db(transaction=True)


def a_real_message(r: redis.Redis, task_id: str) -> dict:
    """A slice message as Celery and kombu send it, taken off a queue no worker reads: the
    garbage below is this message spoilt in one place each."""
    queue = "poison-template"
    current_app.send_task(SLICE_TASK, args=[task_id], queue=queue, ignore_result=True)
    raw = r.rpop(f"{settings.RUNTIME_DEPLOYMENT}:{queue}")
    assert raw is not None
    return json.loads(raw)


def spoilt(message: dict, **changes: object) -> bytes:
    return json.dumps({**message, **changes}).encode()


def garbage(message: dict) -> dict[str, tuple[bytes, str]]:
    """name: (what is pushed, a part of the reason it must be set aside with)."""
    whole = json.dumps(message).encode()
    return {
        "not JSON": (b"hello, worker", "not JSON"),
        "truncated": (whole[: len(whole) // 2], "not JSON"),
        "NUL bytes": (whole[:30] + b"\x00\x00" + whole[30:], "not JSON"),
        "bad base64": (spoilt(message, body="not base64!"), "not a message"),
        "wrong content type": (
            spoilt(message, **{"content-type": "application/x-python-serialize"}),
            "ContentDisallowed",
        ),
        "a body that is no JSON": (spoilt(message, body=base64.b64encode(b"{[").decode()), "DecodeError"),
        "unknown task": (
            spoilt(message, headers={**message["headers"], "task": "tasks.no_such_task"}),
            "no task 'tasks.no_such_task'",
        ),
        "a JSON list": (b"[1, 2]", "not a message"),
        # Headers of the wrong type, which Celery reads only after it has reserved the task
        # or in its event loop: the first ended the worker, the second left it taking
        # messages and running none, the third made it reconnect and take it again.
        "a time limit that is no number": (
            spoilt(message, headers={**message["headers"], "timelimit": ["a", "b"]}),
            "a time limit",
        ),
        "stamps that are no list": (
            spoilt(message, headers={**message["headers"], "stamps": 5, "stamped_headers": 7}),
            "stamped headers",
        ),
        "no task id": (
            spoilt(message, headers={k: v for k, v in message["headers"].items() if k != "id"}),
            "no task id",
        ),
        "huge": (b"{" + b"x" * (3 * UNREADABLE_ENTRY_BYTES), "not JSON"),
    }


def test_unreadable_messages_are_set_aside_and_the_worker_runs_the_tasks_around_them(alice, processes: Processes):
    r = redis.Redis.from_url(settings.REDIS_URL)
    deployment = settings.RUNTIME_DEPLOYMENT
    queue, unreadable = f"{deployment}:steps", f"{deployment}:unreadable"
    r.delete(unreadable)
    worker = processes.worker(ready=True, **FAST_LEASES)
    operator = console(alice.tenant, "user:test")
    template = a_real_message(r, "00000000-0000-0000-0000-000000000000")
    pushed = garbage(template)
    names = list(pushed)
    before, between = names[: len(names) // 2], names[len(names) // 2 :]

    for name in before:
        r.lpush(queue, pushed[name][0])  # as kombu sends: LPUSH, and the worker pops the oldest
    first, _ = do_create_task(operator, agent="noop", input={"steps": 3})
    wait_until(
        lambda: Task.objects.get(id=first.id).status == "completed", timeout=60, what="the task after the garbage"
    )
    for name in between:
        r.lpush(queue, pushed[name][0])
    second, _ = do_create_task(operator, agent="noop", input={"steps": 3})
    wait_until(
        lambda: Task.objects.get(id=second.id).status == "completed", timeout=60, what="the task after more garbage"
    )

    assert worker.poll() is None, "the worker died"
    entries = r.lrange(unreadable, 0, -1)
    kept = []
    for entry in entries:
        assert len(entry) <= UNREADABLE_ENTRY_BYTES
        head, _, raw = entry.partition(b"\n")
        kept.append((json.loads(head), raw))
    assert len(kept) == len(pushed), [about for about, _ in kept]
    for name, (message, reason) in pushed.items():
        found = [(about, raw) for about, raw in kept if about["bytes"] == len(message) and message.startswith(raw)]
        assert len(found) == 1, name
        about, raw = found[0]
        assert about["queue"] == "steps", name
        assert reason in about["reason"], (name, about["reason"])
        assert raw == message[: len(raw)] and (raw == message or name == "huge"), name
    huge = next(raw for about, raw in kept if about["bytes"] == len(pushed["huge"][0]))
    assert len(huge) > UNREADABLE_ENTRY_BYTES - 1000  # cut at the limit, not emptied
    log = Path(worker.log_path).read_text(errors="replace")  # type: ignore[attr-defined]
    assert log.count("set aside") == len(pushed), log[-4000:]  # each said once
    # Nothing of the garbage is left unacknowledged, to come back at the visibility timeout.
    wait_until(lambda: r.hlen(f"{deployment}:unacked") == 0, timeout=30, what="no message left unacknowledged")


def test_a_broadcast_that_is_no_message_is_set_aside_and_every_worker_lives(alice, processes: Processes):
    """Celery's remote control reaches each worker by a Redis PUBLISH, not a queue: one junk
    broadcast ("[1, 2]") ended every worker of the deployment at once ("Unrecoverable error:
    TypeError"), and "{}" made each drop its broker connection and put back its running
    slices."""
    r = redis.Redis.from_url(settings.REDIS_URL)
    deployment = settings.RUNTIME_DEPLOYMENT
    unreadable = f"{deployment}:unreadable"
    r.delete(unreadable)
    worker = processes.worker(ready=True, **FAST_LEASES)
    template = a_real_message(r, "00000000-0000-0000-0000-000000000000")
    junk = [b"[1, 2]", b"{}", spoilt(template, body="not base64!"), spoilt(template, properties={})]
    log = Path(worker.log_path)  # type: ignore[attr-defined]
    # The worker subscribes to its remote control once it is ready; a PUBLISH counts who got it.
    wait_until(lambda: r.publish(f"{deployment}:/0.celery.pidbox", junk[0]) == 1, timeout=30, what="a subscriber")
    for message in junk[1:]:
        assert r.publish(f"{deployment}:/0.celery.pidbox", message) == 1

    wait_until(lambda: r.llen(unreadable) >= len(junk), timeout=30, what="the broadcasts set aside")
    operator = console(alice.tenant, "user:test")
    task, _ = do_create_task(operator, agent="noop", input={"steps": 3})
    wait_until(lambda: Task.objects.get(id=task.id).status == "completed", timeout=60, what="the task after them")
    assert current_app.control.ping(timeout=30, limit=1), "the remote control no longer answers"
    assert worker.poll() is None, log.read_text(errors="replace")[-4000:]
    text = log.read_text(errors="replace")
    assert "Connection to broker lost" not in text, text[-4000:]
    abouts = [json.loads(entry.partition(b"\n")[0]) for entry in r.lrange(unreadable, 0, -1)]
    assert all(about["queue"].endswith(".celery.pidbox") for about in abouts), abouts
    assert {about["bytes"] for about in abouts} == {len(message) for message in junk}
