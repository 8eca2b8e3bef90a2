"""The embedded default's broker: kombu's filesystem transport, with whole messages only.

kombu 5.7.0's filesystem transport creates a message's file under its final name and then
writes it, and a reader takes whatever file it lists. A worker that read a file between
the two got an empty or half message, and the JSONDecodeError out of the transport killed
the worker (its consumer has no handler for it); a sender killed between the two (SIGKILL,
a crash) left a half file that killed every worker that came to it. In CI, under load, the
demo hung after it killed one of its two workers, most likely because the other had died
this way before: nothing was left to recover the task (the reproduction:
tests/test_broker_files.py, tests/test_embedded_profile.py).

Here a message is written under a name no reader picks and renamed into place, which is
atomic on one filesystem: a reader sees all of it or nothing. A file that is not a message
(left by an older release, or by hand; JSON that kombu cannot make a message of; a folder)
is set aside with a warning instead of killing the worker. A reader takes a file by
renaming it within the queue's folder, so of two readers exactly one gets it; kombu moved
it to the system's temporary folder, a copy and a delete across filesystems, which two
readers could both win. Names sort in sending order: kombu's
millisecond counter was not zero-padded, so as text 9999 sorted after 10000.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
import uuid
from importlib.metadata import version
from queue import Empty
from typing import Any

from celery.worker import state as worker_state
from kombu.exceptions import ChannelError
from kombu.transport import filesystem
from kombu.utils.encoding import bytes_to_str, str_to_bytes
from kombu.utils.json import dumps, loads

WRITTEN_FOR = "5.7.0"
if version("kombu") != WRITTEN_FOR:
    raise RuntimeError(
        f"runtime_site/brokerfs.py replaces kombu {WRITTEN_FOR}'s filesystem Channel._put and _get and virtual drain_events, but "
        f"{version('kombu')} is installed: check each against its source, then update WRITTEN_FOR"
    )

logger = logging.getLogger(__name__)
PARTIAL = ".part"  # a message being written: "….<queue>.msg.part" is no queue's file
UNREADABLE = ".unreadable"  # set aside in the processed folder: not a message
CANNOT_TAKE_LOG_SECONDS = 60.0


class Channel(filesystem.Channel):
    # kombu's type stubs give _put two signatures (the base's and the filesystem's): the latter's.
    def _put(self, queue: str, payload: dict[str, Any], **kwargs: Any) -> None:  # type: ignore[override]
        name = os.path.join(self.data_folder_out, f"{time.monotonic_ns():020d}_{uuid.uuid4()}.{queue}.msg")
        try:
            with open(name + PARTIAL, "wb") as f:
                f.write(str_to_bytes(dumps(payload)))
            os.rename(name + PARTIAL, name)
        except OSError as exc:
            # What was written of it (a full disk, a file size limit): a failed send leaves
            # nothing behind, or each one retried on a full disk kept its half for good.
            with contextlib.suppress(OSError):
                os.remove(name + PARTIAL)
            raise ChannelError(f"Cannot add file {name!r} to directory") from exc

    def _get(self, queue: str, timeout: float | None = None) -> Any:
        wanted = f"{queue}.msg"
        for filename in sorted(os.listdir(self.data_folder_in)):
            if filename.partition(".")[2] != wanted:
                continue
            # A rename in the same folder: atomic, so of two readers exactly one takes it.
            taken = os.path.join(self.data_folder_in, f".taken-{os.getpid()}-{filename}")
            try:
                os.rename(os.path.join(self.data_folder_in, filename), taken)
            except FileNotFoundError:
                continue  # another reader took it first
            except OSError as exc:
                # Not taken by another: this reader cannot take any (a folder the kernel
                # remounted read-only, a full disk). The worker lives on and takes them once
                # it can; said once a minute, not at every poll.
                self._cannot_take(filename, exc)
                break
            if (message := self._read(taken, filename)) is None:
                shutil.move(taken, os.path.join(self.processed_folder, filename + UNREADABLE))
                continue
            if self.store_processed:
                shutil.move(taken, os.path.join(self.processed_folder, filename))
            else:
                os.remove(taken)
            return message
        raise Empty()  # what kombu's channels raise for an empty queue

    _said_at: float | None = None  # when _cannot_take last logged (monotonic)

    def _cannot_take(self, name: str, exc: OSError) -> None:
        now = time.monotonic()
        if self._said_at is None or now - self._said_at >= CANNOT_TAKE_LOG_SECONDS:
            self._said_at = now
            logger.warning("broker: cannot take %s from %s: %s", name, self.data_folder_in, exc)

    def _read(self, taken: str, name: str) -> Any:
        """The message in the file `taken` (`name` in the queue), or None (with a warning) if it holds none.

        Whatever the file holds (JSON that is no message, a folder under a message's
        name), the worker must live: kombu builds the message from what _get returns outside
        any handler, and a TypeError or a KeyError there was an unrecoverable error that
        ended the worker. So kombu's own constructor decides here what a message is."""
        try:
            with open(taken, "rb") as f:
                payload = f.read()
        except OSError as exc:
            logger.warning("broker: %s cannot be read (%s); set aside", name, exc)
            return None
        try:
            message = loads(bytes_to_str(payload))
            self.Message(message, channel=self)
        except (
            ValueError,
            TypeError,
            KeyError,
            AttributeError,
        ) as exc:  # what kombu's Message raises on a shape it lacks
            logger.warning(
                "broker: %s is no whole message (%d bytes: %s: %s); set aside",
                name,
                len(payload),
                type(exc).__name__,
                exc,
            )
            return None
        return message


def _worker_stopping() -> bool:
    """Whether this process is a Celery worker told to stop (SIGTERM, SIGQUIT, SIGINT)."""
    return worker_state.should_stop is not None or worker_state.should_terminate is not None


class Transport(filesystem.Transport):
    Channel = Channel

    # kombu's stubs give drain_events two signatures (the base's and the virtual's): the latter's.
    def drain_events(self, connection: Any, timeout: float | None = None) -> None:  # type: ignore[override]
        """kombu's virtual transport polls for up to `timeout` (Celery's loop for a transport
        without sockets, loops.synloop, asks for 2 s) and the loop looks at a stop request
        only between polls, then polls once more (the `finally` after maybe_shutdown): an
        idle embedded worker began its warm shutdown 2-4 s after SIGTERM, and took messages
        while it did. Here a worker told to stop takes no more messages, and its poll ends
        at the next polling interval."""
        interval = (
            float(self.polling_interval or 0) if timeout is None else min(float(self.polling_interval or 0), timeout)
        )
        assert self.cycle is not None  # set up with the connection, before any drain
        started = time.monotonic()
        while not _worker_stopping():
            try:
                self.cycle.get(self._deliver, timeout=timeout)
                return
            except Empty:
                if timeout is not None and time.monotonic() - started >= timeout:
                    break
                time.sleep(interval)
        raise TimeoutError  # socket.timeout, which Celery's loop catches
