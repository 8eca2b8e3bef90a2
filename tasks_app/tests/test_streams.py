"""The fan-out of a web process's streams (tasks_app/streams/hub.py), in process: events as
the process's one subscription hands them to the hub, the catch-up reads from real
PostgreSQL rows (the event loop's own pool, as in the web process)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from django.db import connection

from runtime_site import dbpool
from tasks_app.models import Task, TaskEvent
from tasks_app.streams import hub as hubs
from tasks_app.streams.hub import Hub, StreamEnded, Subscriber, event_frame, read_events
from tasks_app.streams.publish import channel_for

# The hub's reads use connections of their own, which see only committed rows.
pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def event_loop_pool(settings: Any) -> None:
    settings.RUNTIME_DB_ASYNC_POOL = True  # as in the web process (runtime_site/asgi.py)


def new_task(persona: Any) -> Task:
    """A task with no event yet (no worker runs here)."""
    return Task.objects.create(
        tenant=persona.tenant, created_by="user:test", agent="noop", status="paused", input={"steps": 1}
    )


def store(task: Task, *seqs: int) -> None:
    """Events of `task` with these seqs, committed (as tasks_app.events stores them)."""
    TaskEvent.objects.bulk_create(
        [
            TaskEvent(tenant_id=task.tenant_id, task=task, seq=seq, type="log", data={"seq": seq, "line": f"#{seq}"})
            for seq in seqs
        ]
    )
    Task.objects.filter(id=task.id).update(event_seq=max(seqs))


def store_in_thread(task: Task, *seqs: int) -> None:
    try:
        store(task, *seqs)
    finally:
        connection.close()


def frame(task: Task, seq: int) -> str:
    """The frame of an event as the subscription brings it (its data as send_event encodes it)."""
    return event_frame(channel_for(task.id), "log", f'{{"seq": {seq}, "line": "#{seq}"}}', seq)


def seqs(chunks: list[str]) -> list[int]:
    return [int(line.rsplit(":", 1)[1]) for chunk in chunks for line in chunk.splitlines() if line.startswith("id: ")]


def run(scenario: Callable[[], Awaitable[Any]]) -> Any:
    async def main() -> Any:
        try:
            return await scenario()
        finally:
            await dbpool.close_async_pool()

    return asyncio.run(main())


async def drain(sub: Subscriber, until: int, timeout: float = 10) -> list[int]:
    """The seqs a stream sends until it has sent `until` (a deadline, not a sleep)."""
    got: list[str] = []
    async with asyncio.timeout(timeout):
        while not seqs(got) or seqs(got)[-1] < until:
            got.append(await sub.next() or "")
    return seqs(got)


def started(hub: Hub, task: Task, n: int, at: int) -> list[Subscriber]:
    subs = [hub.subscribe(channel_for(task.id)) for _ in range(n)]
    for sub in subs:
        hub.start(sub, at)
    return subs


def test_every_stream_of_a_task_gets_every_event_in_order_without_reading_the_database(alice):
    task = new_task(alice)

    async def scenario() -> tuple[list[list[int]], int]:
        hub = Hub()
        hub.subscribed()  # the subscription is up before the streams register
        subs = started(hub, task, 50, at=3)
        for seq in range(4, 14):
            hub.publish(channel_for(task.id), seq, frame(task, seq))
        return [await drain(sub, 13) for sub in subs], hub.reads

    streams, reads = run(scenario)
    assert streams == [list(range(4, 14))] * 50
    assert reads == 0


def test_a_missed_event_is_read_once_for_all_the_streams_of_its_task(alice):
    task = new_task(alice)
    store(task, 1, 2, 3, 4, 5)

    async def scenario() -> tuple[list[list[int]], int]:
        hub = Hub()
        hub.subscribed()
        subs = started(hub, task, 20, at=3)
        hub.publish(channel_for(task.id), 5, frame(task, 5))  # 4 was lost on the way
        return [await drain(sub, 5) for sub in subs], hub.reads

    streams, reads = run(scenario)
    assert streams == [[4, 5]] * 20  # in order: 5 waited for 4
    assert reads == 1  # one read for twenty streams


def test_a_stream_that_starts_while_the_subscription_is_down_catches_up_from_its_snapshot(alice):
    task = new_task(alice)
    store(task, 1, 2, 3)

    async def scenario() -> tuple[list[int], list[int], int]:
        hub = Hub()  # never subscribed: events published now reach it only through the database
        first, second = started(hub, task, 2, at=1)
        return await drain(first, 3), await drain(second, 3), hub.reads

    first, second, reads = run(scenario)
    assert first == second == [2, 3]
    assert reads == 1


def test_after_the_subscription_comes_back_every_stream_catches_up(alice):
    task, other = new_task(alice), new_task(alice)

    async def scenario() -> tuple[list[int], list[int], int]:
        hub = Hub()
        hub.subscribed()
        subs = started(hub, task, 5, at=0) + started(hub, other, 5, at=0)
        hub.lost()
        await asyncio.to_thread(store_in_thread, task, 1, 2)  # published while the subscription was down
        await asyncio.to_thread(store_in_thread, other, 1)
        hub.subscribed()
        return await drain(subs[0], 2), await drain(subs[9], 1), hub.reads

    mine, theirs, reads = run(scenario)
    assert (mine, theirs) == ([1, 2], [1])
    assert reads == 2  # one per task, not one per stream


def test_an_event_that_arrives_during_a_read_does_not_skip_the_ones_before_it(alice):
    """A read (the subscription came back) finds nothing new; while it runs, 4 and 5 are
    committed and 5 arrives (4 lost). 5 must wait for a read issued after it came, which
    finds 4, not be sent past a gap that only looked like one the database no longer has."""
    task = new_task(alice)
    store(task, 1, 2, 3)
    hub = Hub()

    async def reader(channel: str, after: int, limit: int) -> list[tuple[int, str]]:
        events = await read_events(channel, after, limit)
        if hub.reads == 1:  # the first read, answered as of before 4 and 5
            await asyncio.to_thread(store_in_thread, task, 4, 5)
            hub.publish(channel, 5, frame(task, 5))
        return events

    hub.reader = reader

    async def scenario() -> tuple[list[int], int]:
        hub.subscribed()
        (sub,) = started(hub, task, 1, at=3)
        hub.subscribed()  # redis-py re-subscribed after a reconnect: a catch-up read
        return await drain(sub, 5), hub.reads

    sent, reads = run(scenario)
    assert sent == [4, 5]
    assert reads == 2


def test_a_gap_the_database_no_longer_has_is_passed_once_read(alice):
    task = new_task(alice)
    store(task, 1, 2, 5)  # 3 and 4 trimmed by retention

    async def scenario() -> list[int]:
        hub = Hub()
        hub.subscribed()
        (sub,) = started(hub, task, 1, at=2)
        hub.publish(channel_for(task.id), 5, frame(task, 5))
        return await drain(sub, 5)

    assert run(scenario) == [5]  # the client sees the jump and re-reads the snapshot


def test_a_stream_that_does_not_read_goes_back_to_the_database(alice):
    task = new_task(alice)
    last = hubs.MAX_PENDING + 50
    store(task, *range(1, last + 1))

    async def scenario() -> tuple[list[int], int]:
        hub = Hub()
        hub.subscribed()
        (sub,) = started(hub, task, 1, at=0)
        for seq in range(1, last + 1):  # the client takes nothing meanwhile
            hub.publish(channel_for(task.id), seq, frame(task, seq))
        return await drain(sub, last), hub.reads

    sent, reads = run(scenario)
    assert sent == list(range(1, last + 1))
    assert reads >= 1


def test_streams_end_when_they_cannot_catch_up():
    async def failing(channel: str, after: int, limit: int) -> list[tuple[int, str]]:
        raise ConnectionError("the database is down")

    async def scenario() -> str:
        hub = Hub(reader=failing)
        sub = hub.subscribe("x.task-00000000-0000-0000-0000-000000000000")
        hub.start(sub, 0)  # not subscribed: it must read
        with pytest.raises(StreamEnded) as ended:
            await asyncio.wait_for(sub.next(), 10)
        return ended.value.reason

    assert asyncio.run(scenario()) == "unavailable"


def test_a_quiet_stream_is_due_a_keep_alive(monkeypatch):
    monkeypatch.setattr(hubs, "KEEP_ALIVE_SECONDS", 0.2)

    async def scenario() -> str | None:
        hub = Hub()
        hub.subscribed()
        sub = hub.subscribe("x.task-00000000-0000-0000-0000-000000000000")
        hub.start(sub, 0)
        return await asyncio.wait_for(sub.next(), 10)  # None: send a keep-alive

    assert asyncio.run(scenario()) is None
