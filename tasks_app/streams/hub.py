"""The fan-out of one web process's event streams (issue 14: 500 streams of one task waited
2.9 s for an event and held 20 database connections).

One subscription per process brings every event (wakeups.py: Redis pub/sub, or the database
bridge without Redis); the hub encodes it once and queues it for each stream of its task,
in seq order. A stream reads the database only when it must catch up — it started while the
subscription was down, it fell behind (a gap in seq, or more than MAX_PENDING queued), or
the subscription came back after an outage — and then once per task, not once per stream:
one read from the lowest seq any of the task's waiting streams has, shared among them, on a
connection borrowed for that read only.

The order of a stream's start makes a read unneeded when the subscription is up: the stream
is registered (`subscribe`) before its snapshot is read, so an event committed after the
snapshot is published after the registration and reaches it; one committed before is at or
below the snapshot's seq and is dropped. `start(sub, seq)` then says where it begins.

Events of one task carry consecutive seqs (tasks_app.events allocates them under the task
row's lock), so a stream that gets seq n+2 after n missed n+1: it holds n+2 and reads.
Everything here runs on the event loop that serves the streams (one per uvicorn process);
only the reads leave it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

from asgiref.sync import sync_to_async
from django_eventstream.utils import make_id, sse_encode_event
from psycopg import sql

from tasks_app import faults
from tasks_app.streams.publish import TaskEventStorage, task_id_from

logger = logging.getLogger(__name__)

# Events queued for one stream before it is sent back to the database instead (a client
# that does not read, or an event loop stalled for a moment).
MAX_PENDING = 200
READ_LIMIT = 100  # events per catch-up read
# A stream quiet this long sends a keep-alive event (as django-eventstream's does), within
# a quarter of it.
KEEP_ALIVE_SECONDS = 20.0


class StreamEnded(Exception):
    """The stream must end: `reason` is "forbidden" (its caller may no longer read it) or
    "unavailable" (the database or the token issuer cannot be reached: `cause` says which,
    in words for the client, as tasks_app.faults.infrastructure_fault names it)."""

    def __init__(self, reason: str, cause: str = "") -> None:
        super().__init__(reason)
        self.reason, self.cause = reason, cause


def event_frame(channel: str, event_type: str, data: str, seq: int) -> str:
    """An event as django-eventstream's stream sends it (its id: <channel>:<seq>)."""
    return sse_encode_event(event_type, data, event_id=make_id({channel: seq}))


Reader = Callable[[str, int, int], Awaitable[list[tuple[int, str]]]]


async def read_events(channel: str, after: int, limit: int) -> list[tuple[int, str]]:
    """(seq, frame) of the stored events of `channel` after seq `after`, oldest first: on the
    event loop's own pool on PostgreSQL, or through the storage (its connection closed
    after each read) in a thread on SQLite."""
    from runtime_site import dbpool

    task_id = task_id_from(channel)
    if task_id is None:
        return []
    if not dbpool.async_available():
        events = await sync_to_async(TaskEventStorage().get_events, thread_sensitive=False)(channel, after, limit)
        return [(int(e.id), event_frame(channel, e.type, e.data, int(e.id))) for e in events]
    async with dbpool.borrow() as conn:
        cursor = await conn.execute(READ, {"task": task_id, "after": after, "limit": limit})
        rows = await cursor.fetchall()
    return [(seq, event_frame(channel, kind, json.dumps(data), seq)) for seq, kind, data in rows]


# A stream's catch-up: the stored events of its task after the seq it has.
READ = sql.SQL("""
    SELECT seq, type, data FROM tasks_app_taskevent
     WHERE task_id = %(task)s AND seq > %(after)s ORDER BY seq LIMIT %(limit)s
""")


class Subscriber:
    """One open stream: what is queued for it, and where it is in its task's seq."""

    def __init__(self, hub: Hub, channel: str) -> None:
        self.hub, self.channel = hub, channel
        self.generation = hub.generation  # the subscription it was registered under
        self.last: int | None = None  # the newest seq queued for the client; None before start()
        self.sent = 0  # the newest seq handed to the client
        self.frames: list[str] = []
        self.held: dict[int, str] = {}  # events that came before their predecessors
        self.stale = False  # must catch up from the database
        self.ended: str | None = None
        self.ended_cause = ""  # why, for a stream that ended "unavailable"
        self.quiet_since = asyncio.get_running_loop().time()  # when it last sent anything
        self.keep_alive = False  # quiet for KEEP_ALIVE_SECONDS: a keep-alive is due
        self._waiter: asyncio.Future[None] | None = None
        self.started = asyncio.Event()  # caught up once after start(): the stream "opens"

    def offer(self, seq: int, frame: str) -> None:
        if self.ended is not None or (self.last is not None and seq <= self.last):
            return  # the end, or a duplicate
        if self.last is not None and seq == self.last + 1:
            self._queue(seq, frame)
            self.release_held()
        else:
            if len(self.held) >= MAX_PENDING:
                self.held.clear()  # too far behind to keep: the read brings it all
            self.held[seq] = frame
        if self.held and self.last is not None:
            self.hub.catch_up(self)  # a gap: its events are in the database

    def _queue(self, seq: int, frame: str) -> None:
        if len(self.frames) >= MAX_PENDING:
            # The client is not reading: forget what waits, take it from the database later.
            self.frames.clear()
            self.last = self.sent
            self.hub.catch_up(self)
            return
        self.frames.append(frame)
        self.last = seq
        self.wake()

    def wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def release_held(self, skippable: frozenset[int] = frozenset()) -> None:
        """Queue the held events that now follow on, and those of `skippable` past a gap
        (held before a read that found nothing between: trimmed by retention)."""
        for seq in sorted(self.held):
            if self.last is None:
                return
            if seq <= self.last:
                del self.held[seq]
            elif seq == self.last + 1 or seq in skippable:
                self._queue(seq, self.held.pop(seq))
            else:
                return

    def end(self, reason: str, cause: str = "") -> None:
        if self.ended is None:
            self.ended, self.ended_cause = reason, cause
            self.frames.clear()
            self.wake()
            self.started.set()

    async def next(self) -> str | None:
        """What to send next: events, or None when a keep-alive is due (the hub's ticker says
        when; one timer per process, not one per stream and wait)."""
        while not self.frames and self.ended is None and not self.keep_alive:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        self.keep_alive = False
        return self.take()

    def take(self) -> str | None:
        if self.ended is not None:
            raise StreamEnded(self.ended, self.ended_cause)
        self.quiet_since = asyncio.get_running_loop().time()
        if not self.frames:
            return None
        chunk, self.frames = "".join(self.frames), []
        self.sent = self.last or 0
        return chunk


class Hub:
    def __init__(self, reader: Reader = read_events) -> None:
        self.channels: dict[str, set[Subscriber]] = {}
        self.live = False  # the subscription is up and nothing was missed since it came up
        self.generation = 0
        self.reader = reader
        self.reads = 0  # database reads made (tests, metrics)
        self._readers: dict[str, asyncio.Task[None]] = {}
        self._ticker: asyncio.Task[None] | None = None

    @property
    def open_streams(self) -> int:
        return sum(len(subs) for subs in self.channels.values())

    def subscribe(self, channel: str) -> Subscriber:
        """Register a stream of `channel` before its snapshot is read (see the module's doc)."""
        sub = Subscriber(self, channel)
        self.channels.setdefault(channel, set()).add(sub)
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.get_running_loop().create_task(self._keep_alive())
        return sub

    async def _keep_alive(self) -> None:
        """Wake the streams that sent nothing for KEEP_ALIVE_SECONDS: they send a keep-alive."""
        loop = asyncio.get_running_loop()
        while self.channels:
            await asyncio.sleep(KEEP_ALIVE_SECONDS / 4)
            due = loop.time() - KEEP_ALIVE_SECONDS
            for subs in list(self.channels.values()):
                for sub in subs:
                    if sub.quiet_since <= due:
                        sub.keep_alive = True
                        sub.wake()

    def unsubscribe(self, sub: Subscriber) -> None:
        subs = self.channels.get(sub.channel)
        if subs is not None:
            subs.discard(sub)
            if not subs:
                del self.channels[sub.channel]
        sub.end("closed")

    def start(self, sub: Subscriber, seq: int, *, registered_before_read: bool = True) -> None:
        """The stream's snapshot is at `seq`: it sends what comes after. It catches up from
        the database first unless every event after `seq` is sure to reach it live."""
        sub.last = sub.sent = seq
        sub.release_held()
        if not registered_before_read or not self.live or sub.generation != self.generation or sub.held:
            self.catch_up(sub)
        else:
            sub.started.set()

    def publish(self, channel: str, seq: int, frame: str) -> None:
        """An event from the subscription: queue it for each stream of its task."""
        for sub in self.channels.get(channel, ()):
            sub.offer(seq, frame)

    def subscribed(self) -> None:
        """The subscription is up again (or for the first time): what was published while it
        was down is only in the database, so every started stream catches up."""
        self.generation += 1
        self.live = True
        self.resync()

    def lost(self) -> None:
        self.live = False

    def resync(self, seqs: dict[str, int] | None = None) -> None:
        """Catch up the started streams of every channel, or those of `seqs` whose task's seq
        is past what they have (the database bridge)."""
        for channel, subs in list(self.channels.items()):
            for sub in list(subs):
                if sub.last is not None and (seqs is None or seqs.get(channel, 0) > sub.last):
                    self.catch_up(sub)

    def catch_up(self, sub: Subscriber) -> None:
        sub.stale = True
        task = self._readers.get(sub.channel)
        if task is None or task.done():
            self._readers[sub.channel] = asyncio.get_running_loop().create_task(self._read(sub.channel))

    async def _read(self, channel: str) -> None:
        """Catch up the stale streams of `channel`, one read at a time, shared among them."""
        while True:
            waiting = [s for s in self.channels.get(channel, ()) if s.stale and s.ended is None and s.last is not None]
            if not waiting:
                return
            after = min(s.last or 0 for s in waiting)
            # Held before the read: their predecessors were committed before they were
            # published, so before this read, which returns them unless they are gone.
            before = {sub: frozenset(sub.held) for sub in waiting}
            for sub in waiting:
                sub.stale = False  # an event arriving during the read sets it again
            self.reads += 1
            try:
                events = await self.reader(channel, after, READ_LIMIT)
            except Exception as exc:  # noqa: BLE001 (the database is down: these streams end, the next reconnect says 503)
                logger.warning("the streams of %s ended: they could not catch up (%s)", channel, exc)
                cause = faults.infrastructure_fault(exc) or "the stream could not catch up"
                for sub in waiting:
                    sub.end("unavailable", cause)
                continue
            more = len(events) >= READ_LIMIT
            for sub in waiting:
                for seq, frame in events:
                    if sub.last is not None and seq > sub.last:
                        sub.held.pop(seq, None)
                        sub._queue(seq, frame)
                sub.release_held(frozenset() if more else before[sub])
                if more or sub.held:
                    sub.stale = True
                elif not sub.stale:
                    sub.started.set()


_hubs: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Hub] = weakref.WeakKeyDictionary()


def loop_hub() -> Hub:
    """The hub of the running event loop (wakeups.get_hub also starts its subscription)."""
    loop = asyncio.get_running_loop()
    hub = _hubs.get(loop)
    if hub is None:
        hub = _hubs[loop] = Hub()
    return hub


def open_streams() -> int:
    """Streams open in this process, over its event loops (for /metrics, from any thread)."""
    return sum(hub.open_streams for hub in list(_hubs.values()))


def parse_message(raw: bytes | str) -> tuple[str, int, str] | None:
    """(channel, seq, frame) of a pub/sub message django-eventstream's send_event published,
    or None for another deployment's (pitfall 4)."""
    message: dict[str, Any] = json.loads(raw)
    channel = message["channel"]
    if task_id_from(channel) is None or message.get("pub_id") is None:
        return None
    seq = int(message["pub_id"])
    return channel, seq, event_frame(channel, message["event_type"], message["data"], seq)
