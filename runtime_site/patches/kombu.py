"""Our patches to kombu's Redis transport (install() says what and why).

Written against kombu 5.7.0: they replace library internals (QoS.restore_unacked,
Message.ack_log_error), so another release must be read against them before it is let in.
"""

from __future__ import annotations

import logging
from importlib.metadata import version
from typing import Any

from kombu import message
from kombu.transport import redis as kombu_redis

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
    log = logging.getLogger(__name__)
    restore, ack_log_error = kombu_redis.QoS.restore_unacked, message.Message.ack_log_error

    def restore_unacked(self: Any, client: Any = None) -> None:
        try:
            restore(self, client)
        except AttributeError:
            log.warning("broker connection already gone; unacked messages stay in Redis")

    def ack_log_error_tolerant(self: Any, logger: Any, errors: Any, multiple: bool = False) -> None:
        try:
            ack_log_error(self, logger, errors, multiple=multiple)
        except AttributeError:
            log.warning(
                "could not ack %r on a channel lost with the broker; it may be delivered again", self.delivery_tag
            )

    # Replacing the methods is the point of this patch (see the docstring).
    kombu_redis.QoS.restore_unacked = restore_unacked  # type: ignore[method-assign]
    message.Message.ack_log_error = ack_log_error_tolerant  # type: ignore[method-assign]
