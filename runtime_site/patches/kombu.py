"""Our patches to kombu's Redis transport (install() and set_aside_unreadable() say what and why).

Written against kombu 5.7.0: they replace library internals (QoS.restore_unacked,
Message.ack_log_error, Channel._brpop_read, _get and _deliver_fanout_message), so another
release must be read against them before it is let in.
"""

from __future__ import annotations

import json
import logging
import time
from contextvars import ContextVar
from importlib.metadata import version
from queue import Empty
from typing import Any

import redis
from kombu import message
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual
from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import loads

logger = logging.getLogger(__name__)

WRITTEN_FOR = "5.7.0"
if version("kombu") != WRITTEN_FOR:
    raise RuntimeError(
        f"runtime_site/patches/kombu.py patches kombu {WRITTEN_FOR} internals, but "
        f"{version('kombu')} is installed: check each patch against its source, then update WRITTEN_FOR"
    )


def install() -> None:
    """Celery 5.7 / kombu 5.7 bugs (seen in tests/test_faults.py and test_streaming.py):
    when a worker loses its Redis broker mid-task, the consumer collects the connection
    and then (1) closes it, restoring unacked messages through a connection whose client
    info is gone, and (2) later acks the in-flight message through that dead channel.
    Both raise AttributeError, which kills the worker ("Unrecoverable error: 'NoneType'
    object has no attribute 'hostname' / 'client'"; the family of kombu#582 and #970).
    The messages stay in Redis's unacked set either way; a stale one comes back after the
    visibility timeout as a duplicate, which the lease claim drops. Skipping is safe;
    dying is not (each Redis blip would count a recovery against every running task)."""
    restore, ack_log_error = kombu_redis.QoS.restore_unacked, message.Message.ack_log_error

    def restore_unacked(self: Any, client: Any = None) -> None:
        try:
            restore(self, client)
        except AttributeError:
            logger.warning("broker connection already gone; unacked messages stay in Redis")

    def ack_log_error_tolerant(self: Any, logger: Any, errors: Any, multiple: bool = False) -> None:
        try:
            ack_log_error(self, logger, errors, multiple=multiple)
        except AttributeError:
            logger.warning(
                "could not ack %r on a channel lost with the broker; it may be delivered again", self.delivery_tag
            )

    # Replacing the methods is the point of this patch (see the docstring).
    kombu_redis.QoS.restore_unacked = restore_unacked  # type: ignore[method-assign]
    message.Message.ack_log_error = ack_log_error_tolerant  # type: ignore[method-assign]
    set_aside_unreadable()


UNREADABLE_LIST = "unreadable"  # under the deployment's key prefix: "<RUNTIME_DEPLOYMENT>:unreadable"
UNREADABLE_KEEP = 1000  # the newest; older ones are trimmed away
UNREADABLE_ENTRY_BYTES = 1 << 20  # one entry at most; a message longer than that is cut
REASON_CHARS = 1000
# The queue whose message is being handed to its consumer, while it is: Celery's consumer
# sees only the message, whose routing key need not name the queue it was read from.
delivering_from: ContextVar[str | None] = ContextVar("delivering_from", default=None)


class Unreadable(Exception):
    """A message no consumer can take; its text says why."""


def checked_payload(channel: Any, item: bytes) -> dict[str, Any]:
    """The message kombu delivers for `item`, a queue's raw entry, or Unreadable.

    Checks what kombu would otherwise trip over outside any handler, between popping the
    entry and handing it to the consumer: JSON (not UTF-8, not JSON, truncated), the shape
    of an envelope (its properties, delivery tag and delivery info, which the unacked hash
    is written from), and the body's encoding (bad base64), by building the message as
    kombu will. Pure computation: whatever it raises is about the message."""
    try:
        payload = loads(bytes_to_str(item))
    except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError alike
        raise Unreadable(f"not JSON: {type(exc).__name__}: {exc}") from None
    return checked_envelope(channel, payload)


def checked_envelope(channel: Any, payload: Any) -> dict[str, Any]:
    """`payload`, decoded JSON, if kombu can make a message of it (checked_payload says
    what is checked), else Unreadable."""
    if not isinstance(payload, dict):
        raise Unreadable(f"not a message: a JSON {type(payload).__name__}")
    properties = payload.get("properties")
    if not isinstance(properties, dict):
        raise Unreadable("not a message: no properties")
    if not isinstance(properties.get("delivery_tag"), str):
        raise Unreadable("not a message: no delivery tag")
    info = properties.get("delivery_info")
    if not isinstance(info, dict) or not all(isinstance(info.get(k), str) for k in ("exchange", "routing_key")):
        raise Unreadable("not a message: no delivery info")
    if not isinstance(payload.get("headers") or {}, dict):
        raise Unreadable("not a message: headers that are no object")
    try:
        channel.Message(payload, channel=channel)
    except Exception as exc:  # noqa: BLE001 (whatever building it raises, binascii.Error for bad base64 and more)
        raise Unreadable(f"not a message: {type(exc).__name__}: {exc}") from None
    return payload


def unreadable_entry(queue: str, raw: bytes, reason: str) -> bytes:
    """One entry of the unreadable list: a line of JSON (queue, reason, size, when), a
    newline, then the message as it came, byte for byte, cut so the entry holds at most
    UNREADABLE_ENTRY_BYTES. Raw bytes and not JSON text: garbage need not be UTF-8, and a
    message that only missed an accepted content type can be pushed back as it was."""
    about = {"queue": queue, "reason": reason[:REASON_CHARS], "bytes": len(raw), "at": time.time()}
    head = json.dumps(about).encode() + b"\n"
    return head + raw[: max(0, UNREADABLE_ENTRY_BYTES - len(head))]


def set_aside(channel: Any, queue: str, raw: bytes, reason: str) -> None:
    """Log an unreadable message once and keep it where its channel keeps such messages
    (its set_aside method: the Redis list here, a file for runtime_site/brokerfs.py); a
    channel without one only logs it."""
    logger.warning("broker: an unreadable message on %s (%d bytes) set aside: %s", queue, len(raw), reason)
    if (keep := getattr(channel, "set_aside", None)) is not None:
        keep(queue, raw, reason)


def set_aside_unreadable() -> None:
    """A message on a queue that kombu cannot make a message of (not JSON, bad base64, no
    envelope, truncated, NUL bytes) raised out of Channel._brpop_read, popped already and
    in no unacked set: the worker died ("Unrecoverable error: JSONDecodeError") and the
    message was gone; a broadcast of the same ended every worker at once. Now it goes to
    the list "<deployment>:unreadable" with its queue and why (runtime_site/patches/consumer.py
    does the same for what Celery cannot run), and the worker goes on with the next message. The list keeps the newest UNREADABLE_KEEP."""

    def keep_in_redis(self: Any, queue: str, raw: bytes, reason: str) -> None:
        # A client of our own on the channel's pool: kombu's prefixes some commands' keys
        # (LPUSH) and not others (LTRIM); this one prefixes none, so the key is written whole.
        key = f"{self.global_keyprefix}{UNREADABLE_LIST}"
        with redis.Redis(connection_pool=self.pool).pipeline() as pipe:  # MULTI: push and trim as one
            pipe.lpush(key, unreadable_entry(queue, raw, reason))
            pipe.ltrim(key, 0, UNREADABLE_KEEP - 1)
            pipe.execute()

    def deliverable(self: Any, queue: str, item: bytes) -> dict[str, Any] | None:
        try:
            return checked_payload(self, item)
        except Unreadable as exc:
            set_aside(self, queue, item, str(exc))
            return None

    def brpop_read(self: Any, **options: Any) -> bool:
        """kombu 5.7.0's Channel._brpop_read, with the message checked before it is delivered."""
        try:
            try:
                dest__item = self.client.parse_response(self.client.connection, "BRPOP", **options)
            except self.connection_errors:
                # if there's a ConnectionError, disconnect so the next
                # iteration will reconnect automatically.
                self.client.connection.disconnect()
                raise
            if dest__item:
                dest, item = dest__item
                dest = bytes_to_str(dest).rsplit(self.sep, 1)[0]
                self._queue_cycle.rotate(dest)
                if (payload := deliverable(self, dest, item)) is not None:
                    self.connection._deliver(payload, dest)
                return True
            else:
                raise Empty()
        finally:
            self._in_poll = None
            self._flush_brpop_reauth()

    def get(self: Any, queue: str) -> dict[str, Any]:
        """kombu 5.7.0's Channel._get (synchronous reads), going on past unreadable messages."""
        with self.conn_or_acquire() as client:
            for pri in self.priority_steps:
                while item := client.rpop(self._q_for_pri(queue, pri)):
                    if (payload := deliverable(self, queue, item)) is not None:
                        self._maybe_update_queues_expire(client, queue)
                        return payload
            self._maybe_update_queues_expire(client, queue)
            raise Empty()

    redis_channel: Any = kombu_redis.Channel  # internals the type stubs do not show
    deliver_fanout = redis_channel._deliver_fanout_message

    def deliver_fanout_checked(self: Any, message: Any, exchange: str) -> bool:
        """kombu 5.7.0's Channel._deliver_fanout_message, with the message checked first. A
        broadcast (Celery's remote control: PUBLISH on "<deployment>:/0.celery.pidbox") is
        delivered to every worker at once, so one that was JSON but no message (a list, no
        properties, bad base64) ended them all ("Unrecoverable error: TypeError"), or made
        each drop its connection and put back its running slices."""
        queue = self._fanout_to_queue.get(exchange)
        try:
            if queue is None:
                raise Unreadable(f"no queue is bound to the exchange {exchange[:200]!r}")
            checked_envelope(self, message)
        except Unreadable as exc:
            set_aside(self, queue or exchange, json.dumps(message).encode(), str(exc))
            return True
        return bool(deliver_fanout(self, message, exchange))

    deliver = virtual.Transport._deliver

    def deliver_saying_from_where(self: Any, message: Any, queue: str) -> Any:
        token = delivering_from.set(queue)
        try:
            return deliver(self, message, queue)
        finally:
            delivering_from.reset(token)

    transport: Any = virtual.Transport  # internals the type stubs do not show
    transport._deliver = deliver_saying_from_where
    channel: Any = kombu_redis.Channel
    channel.set_aside = keep_in_redis
    channel._brpop_read = brpop_read
    channel._get = get
    channel._deliver_fanout_message = deliver_fanout_checked
