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

Delivery is at least once, as on Redis. kombu's filesystem transport deleted a file as it
read it, so a worker killed while it ran the message's task lost the message (the lease
scanner re-found the task, a stall period later; with no scanner running, never). Here a
taken message (".taken-<pid>-<name>") stays on disk, held under an fcntl lock (lockf) by
the reading process, until its consumer acknowledges it; given back (a warm shutdown, a
reject with requeue), it is renamed back into its queue. Every SWEEP_SECONDS, whichever
process polls puts back the taken files whose lock is free (their reader died: the kernel
drops a dead process's locks) and removes ".part" files older than PART_MAX_SECONDS (their
sender died while writing them). A message run twice this way is harmless: the engine's
lease fences the steps of a slice run again.

lockf locks belong to a process, not to a file descriptor: closing any descriptor of the
file drops all of the process's locks on it. So a process never opens a file it holds
(HOLDING), and reads a message through the descriptor that holds its lock.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
import stat
import threading
import time
import uuid
from importlib.metadata import version
from queue import Empty
from typing import IO, Any

from celery.worker import state as worker_state
from kombu.exceptions import ChannelError
from kombu.transport import filesystem, virtual
from kombu.utils.encoding import str_to_bytes
from kombu.utils.json import dumps

from runtime_site.patches.kombu import Unreadable, checked_payload

WRITTEN_FOR = "5.7.0"
if version("kombu") != WRITTEN_FOR:
    raise RuntimeError(
        f"runtime_site/brokerfs.py replaces kombu {WRITTEN_FOR}'s filesystem Channel._put and _get and virtual drain_events, but "
        f"{version('kombu')} is installed: check each against its source, then update WRITTEN_FOR"
    )

logger = logging.getLogger(__name__)
PARTIAL = ".part"  # a message being written: "….<queue>.msg.part" is no queue's file
UNREADABLE = ".unreadable"  # set aside in the processed folder: not a message
TAKEN = ".taken-"  # ".taken-<pid>-<name>": taken by the reader <pid>, held until acknowledged
CANNOT_TAKE_LOG_SECONDS = 60.0
SWEEP_SECONDS = 5.0
PART_MAX_SECONDS = 300.0  # a send writes its file in far less; one this old lost its sender
MESSAGE_MAX_BYTES = 64 << 20  # our messages are a task id and a few numbers; a file larger is not one

# The taken files this process holds: path -> the open file holding its lock.
HOLDING: dict[str, IO[bytes]] = {}
_swept_at: dict[str, float] = {}  # queue folder -> when this process last swept it (monotonic)
_sweeping = threading.Lock()


def sweep(folder: str) -> None:
    """Put back into the queue the taken files of readers that are gone, and remove the
    half-written files of senders that are gone (the module docstring says why)."""
    now = time.time()
    with _sweeping:
        for name in os.listdir(folder):
            path = os.path.join(folder, name)
            if name.startswith(TAKEN) and path not in HOLDING:
                _put_back_if_free(folder, name)
            elif name.endswith(PARTIAL):
                with contextlib.suppress(OSError):  # gone meanwhile: renamed into place, or removed by another
                    if now - os.lstat(path).st_mtime > PART_MAX_SECONDS:
                        os.remove(path)
                        logger.warning("broker: %s was left half-written by its sender; removed", name)


def _put_back_if_free(folder: str, name: str) -> None:
    path = os.path.join(folder, name)
    try:
        f = open(path, "r+b")  # noqa: SIM115 (closed below, after the rename: its lock guards that)
    except OSError:
        return  # acknowledged or put back meanwhile, or a folder we cannot write to
    try:
        try:
            fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return  # its reader lives and holds it
        reader, _, original = name.removeprefix(TAKEN).partition("-")
        try:
            os.rename(path, os.path.join(folder, original))
        except OSError:
            return
        logger.warning("broker: %s was taken by reader %s, which is gone; put back", original, reader)
    finally:
        f.close()


class NotAMessageFile(Exception):
    """A queue's entry that no sender wrote (its text says what it is): set aside unread."""


def _open_message(path: str) -> IO[bytes]:
    """The message file at `path`, open for reading and writing (lockf's exclusive lock
    needs a file open for writing), or NotAMessageFile.

    Only a regular file no larger than MESSAGE_MAX_BYTES: a named pipe raised an OSError
    that read as "this reader cannot take any", so it held up its queue for good; a
    symbolic link to /dev/zero, or a file of gigabytes, was read whole into memory and the
    MemoryError ended the worker. O_NONBLOCK: opening a named pipe does not wait for a
    writer."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
    except IsADirectoryError:
        raise NotAMessageFile("a folder, not a file") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # what O_NOFOLLOW answers for a symbolic link
            raise NotAMessageFile("a symbolic link, not a file") from None
        raise
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):
            raise NotAMessageFile("not a regular file")
        if status.st_size > MESSAGE_MAX_BYTES:
            raise NotAMessageFile(f"{status.st_size} bytes, more than any message ({MESSAGE_MAX_BYTES})")
        return os.fdopen(fd, "r+b")
    except BaseException:
        os.close(fd)
        raise


def _release(path: str, *, into: str | None) -> None:
    """Done with a taken file this process holds: moved into the folder `into` (or removed
    if None), then its lock dropped. Moved or removed first: a sweep then finds it held, or
    not at all."""
    with contextlib.suppress(OSError):  # gone already: nothing left to release but the lock
        if into is None:
            os.remove(path)
        else:
            shutil.move(path, os.path.join(into, os.path.basename(path).removeprefix(TAKEN).partition("-")[2]))
    if (f := HOLDING.pop(path, None)) is not None:
        f.close()


class QoS(virtual.QoS):
    """Acknowledged or rejected, a message's taken file is done with (a rejection with
    requeue has been put back by then, through Channel._restore)."""

    channel: Channel

    def ack(self, delivery_tag: Any) -> None:
        super().ack(delivery_tag)
        self.channel._done(delivery_tag)

    def reject(self, delivery_tag: Any, requeue: bool = False) -> None:
        super().reject(delivery_tag, requeue=requeue)
        self.channel._done(delivery_tag)


class Channel(filesystem.Channel):
    QoS = QoS

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._taken: dict[Any, str] = {}  # delivery tag -> the taken file that holds the message
        self._unacknowledged: set[str] = set()  # queues consumed with no_ack (a worker's remote control)

    def basic_consume(self, queue: str, no_ack: bool, *args: Any, **kwargs: Any) -> Any:
        """A consumer that acknowledges nothing (no_ack: Celery's remote control) takes its
        messages at most once, as it asked: held until an ack that never comes, each would
        stay locked on disk as long as its process lived."""
        if no_ack:
            self._unacknowledged.add(queue)
        return super().basic_consume(queue, no_ack, *args, **kwargs)

    def basic_get(self, queue: str, no_ack: bool = False, **kwargs: Any) -> Any:
        message = super().basic_get(queue, no_ack=no_ack, **kwargs)
        if message is not None and no_ack:
            self._done(message.delivery_tag)
        return message

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
        folder = self.data_folder_in
        try:
            if time.monotonic() - _swept_at.get(folder, -SWEEP_SECONDS) >= SWEEP_SECONDS:
                _swept_at[folder] = time.monotonic()
                sweep(folder)
            names = sorted(os.listdir(folder))
        except OSError as exc:
            # The queue folder itself is gone or closed to us (removed by hand, or by a
            # cleaner of old files under /tmp): the FileNotFoundError ended the worker. It
            # says so once a minute and takes messages again once the folder is back.
            self._cannot_take(f"any {queue} message", exc)
            raise Empty() from None
        wanted = f"{queue}.msg"
        for filename in names:
            if filename.partition(".")[2] != wanted:
                continue
            path = os.path.join(folder, filename)
            try:
                f = _open_message(path)
            except FileNotFoundError:
                continue  # another reader took it first
            except NotAMessageFile as exc:
                self._set_aside_file(path, filename, str(exc))
                continue
            except PermissionError as exc:
                # This file only (another user's, written by root with mode 0644: the
                # worker may not write it, so may not lock it): it held up every message
                # behind it, for good. Set aside, it lets them through; a rename needs
                # only the folder's permission.
                self._set_aside_file(path, filename, f"cannot be opened for reading and writing: {exc.strerror}")
                continue
            except OSError as exc:
                # Not taken by another: this reader cannot take any (a folder the kernel
                # remounted read-only, a full disk). The worker lives on and takes them once
                # it can; said once a minute, not at every poll.
                self._cannot_take(filename, exc)
                break
            if (taken := self._take(f, path, filename)) is None:
                f.close()
                continue
            try:
                message = self._read(f, filename)
            except Unreadable as exc:
                HOLDING[taken] = f
                self._set_aside_file(taken, filename, str(exc))
                _release(taken, into=None)
                continue
            if message["properties"]["delivery_tag"] in self._taken:
                # A copy of a message this channel holds (the same message put twice, a file
                # set aside and put back by hand twice): taken too, it replaced the first
                # in _taken, whose file then stayed locked, unacknowledged, for the life of
                # the process, and ran again after. It waits in its queue for the first.
                with contextlib.suppress(OSError):
                    os.rename(taken, path)
                f.close()
                continue
            HOLDING[taken] = f
            self._taken[message["properties"]["delivery_tag"]] = taken
            if queue in self._unacknowledged:
                self._done(message["properties"]["delivery_tag"])
            return message
        raise Empty()  # what kombu's channels raise for an empty queue

    def _take(self, f: IO[bytes], path: str, filename: str) -> str | None:
        """Lock the file, then rename it to our taken name: the taken file, or None if
        another reader has it. The lock comes first, so no taken file is ever unlocked while
        its reader lives; a sweep that finds one unlocked finds a reader gone."""
        try:
            fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return None  # another reader is taking it, or a sweep is looking at it
        taken = os.path.join(self.data_folder_in, f"{TAKEN}{os.getpid()}-{filename}")
        try:
            # A rename in the same folder: atomic, so of two readers exactly one takes it.
            os.rename(path, taken)
        except FileNotFoundError:
            return None  # another reader took it first (and let go of it since)
        except OSError as exc:
            self._cannot_take(filename, exc)
            return None
        return taken

    def _done(self, delivery_tag: Any) -> None:
        """The consumer is done with the message (acknowledged, rejected or put back)."""
        if (taken := self._taken.pop(delivery_tag, None)) is not None:
            _release(taken, into=self.processed_folder if self.store_processed else None)

    def _restore(self, message: Any) -> None:
        """Given back unacknowledged (a warm shutdown, a reject with requeue): its file goes
        back into the queue under its name, ahead of newer ones, as a sweep would put it."""
        if (taken := self._taken.pop(message.delivery_tag, None)) is None:
            super()._restore(message)
            return
        original = os.path.basename(taken).removeprefix(TAKEN).partition("-")[2]
        with contextlib.suppress(OSError):  # gone: put back by a sweep that took it for a dead reader's
            os.rename(taken, os.path.join(self.data_folder_in, original))
        if (f := HOLDING.pop(taken, None)) is not None:
            f.close()

    def set_aside(self, queue: str, raw: bytes, reason: str) -> None:
        """A message the consumer cannot run (runtime_site/patches/consumer.py): a copy goes to
        the processed folder, as a file that is no message is set aside there."""
        name = f"{time.monotonic_ns():020d}_{uuid.uuid4()}.{queue.replace(os.sep, '_')}.msg{UNREADABLE}"
        try:
            with open(os.path.join(self.processed_folder, name), "wb") as f:
                f.write(raw)
        except OSError as exc:
            # No copy (the processed folder removed by hand, a full disk), but the message
            # is done with all the same: the OSError ended the worker, its taken file went
            # back at the next sweep, and ended the next worker, and the next.
            logger.warning("broker: no copy of the unreadable message on %s kept: %s", queue, exc)

    _said_at: float | None = None  # when _cannot_take last logged (monotonic)

    def _cannot_take(self, name: str, exc: OSError) -> None:
        now = time.monotonic()
        if self._said_at is None or now - self._said_at >= CANNOT_TAKE_LOG_SECONDS:
            self._said_at = now
            logger.warning("broker: cannot take %s from %s: %s", name, self.data_folder_in, exc)

    def _set_aside_file(self, path: str, name: str, reason: str) -> None:
        try:
            shutil.move(path, os.path.join(self.processed_folder, name + UNREADABLE))
        except OSError as exc:
            if not os.path.lexists(path):
                return  # gone: another reader set it aside or took it first
            # Said once a minute, not for each file at each poll (a folder we may not write to).
            self._cannot_take(name, exc)
            return
        logger.warning("broker: %s is no whole message (%s); set aside", name, reason)

    def _read(self, f: IO[bytes], name: str) -> Any:
        """The message in the taken file `f` (`name` in the queue), or Unreadable.

        Read through the descriptor that holds the file's lock (the module docstring says
        why). Whatever the file holds (JSON that is no message, a delivery tag that is no
        text), the worker must live: kombu builds the message from what _get returns
        outside any handler, and a TypeError or a KeyError there was an unrecoverable error
        that ended the worker. The checks are those of the Redis transport's messages."""
        try:
            payload = f.read()
        except OSError as exc:
            raise Unreadable(f"cannot be read: {exc}") from None
        try:
            return checked_payload(self, payload)
        except Unreadable as exc:
            raise Unreadable(f"{len(payload)} bytes: {exc}") from None


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
