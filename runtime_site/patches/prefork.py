"""Our patches to Celery's prefork pool (billiard), for a warm shutdown (SIGTERM) that gets
out of the way at once (issue 12 #8; install() says what and why).

Written against celery 5.7.0 and billiard 4.3.2: they replace library internals
(AsynPool.flush and join, billiard's pool process exit, the time module as Celery's
prefork pool sees it), so another release must be read against them before it is let in.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from importlib.metadata import version
from typing import Any

from billiard import pool as _billiard_pool
from celery.concurrency import asynpool as _asynpool
from celery.concurrency import prefork as _celery_prefork

# Internals the type stubs do not show.
billiard_pool: Any = _billiard_pool
asynpool: Any = _asynpool
celery_prefork: Any = _celery_prefork

WRITTEN_FOR = {"celery": "5.7.0", "billiard": "4.3.2"}
if found := {name: version(name) for name in WRITTEN_FOR if version(name) != WRITTEN_FOR[name]}:
    raise RuntimeError(
        f"runtime_site/patches/prefork.py patches internals of {WRITTEN_FOR}, but {found} is installed: "
        "check each patch against its source, then update WRITTEN_FOR"
    )


def install(stopping_warmly: Callable[[], bool]) -> None:
    """What kept a worker told to stop (SIGTERM) alive long after its slices had handed their
    tasks over (measured, bench/soak.py); in deploys that stop a worker before starting the
    next (compose, systemd), its replacement waited for it to be gone:

    1. A message whose job was written to a pool process, but whose "accepted" reply the
       worker had not read yet when the signal came, was dropped from the pool's books by
       AsynPool.flush ("it will be redelivered by the broker"). The pool process runs it all
       the same; nothing then read its result, so the pool process waited 30 s for that
       (billiard's _ensure_messages_consumed) while the worker waited for the pool process:
       31.5 s to stop, and the message, never acknowledged, was given back at the end and
       ran a second time. Such jobs stay in the books now: the shutdown reads their results
       and acknowledges their messages.
    2. Every pool process sleeps 1 s before it exits (so that its pool reads its last
       message while it still runs). In a warm shutdown the pool reads nothing more from
       it: it exits at once.
    3. While the pool drains, a thread of Celery's keeps the event loop's timers firing,
       sleeping 0.5 s between rounds, and the worker waits for that thread after the pool
       has joined: every stop took half a second more. Its sleep now ends with the join.
    4. While the pool drains, its result handler looks at each pool process's pipe and,
       finding no result there yet, sleeps 0.5 s before it looks again
       (ResultHandler._flush_outqueue): a slice that handed its task over a few
       milliseconds after the signal kept its worker 0.5 s longer (signal → process gone
       0.60-0.70 s, with the lease given back after 0.02-0.09 s; measured). That sleep now
       waits on the pipe it found empty, up to the same 0.5 s, and ends when a result
       arrives."""
    flush = asynpool.AsynPool.flush

    def flush_keeping_jobs_sent(self: Any) -> None:
        sent = [job for job in self._cache.values() if not job._accepted and job._write_to is not None]
        flush(self)
        for job in sent:
            writer = asynpool._get_job_writer(job)
            if writer is None or inspect.getgeneratorstate(writer) == inspect.GEN_CLOSED:  # all of it written
                self._cache.setdefault(job._job, job)

    do_exit = billiard_pool.Worker._do_exit

    def do_exit_at_once_when_stopping(self: Any, pid: int, exitcode: int | None, exc: Exception | None = None) -> None:
        if not stopping_warmly() or sys.platform == "win32":
            return do_exit(self, pid, exitcode, exc)
        if exitcode is None:
            exitcode = billiard_pool.EX_FAILURE if exc else billiard_pool.EX_OK
        try:
            if self.on_exit is not None:
                self.on_exit(pid, exitcode)
            mask = signal.pthread_sigmask(signal.SIG_BLOCK, {billiard_pool.TERM_SIGNAL})
            try:
                self.outq.put((billiard_pool.DEATH, (pid, exitcode)))
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        finally:
            os._exit(exitcode)

    joined = threading.Event()
    join = asynpool.AsynPool.join

    def join_and_say_so(self: Any) -> None:
        try:
            join(self)
        finally:
            joined.set()

    class TimerThreadClock:
        """Stands in for the time module in celery.concurrency.prefork, whose one use of it
        is the timer thread's sleep (TaskPool.on_stop)."""

        @staticmethod
        def sleep(seconds: float) -> None:
            joined.wait(seconds)

    draining = threading.local()  # the pipe the result handler is looking at, while it does
    flush_outqueue = asynpool.ResultHandler._flush_outqueue

    def flush_outqueue_watching_its_pipe(
        self: Any, fd: int, remove: Any, process_index: Any, on_state_change: Any
    ) -> Any:
        proc = process_index.get(fd)
        draining.pipe = getattr(getattr(proc, "outq", None), "_reader", None)
        try:
            return flush_outqueue(self, fd, remove, process_index, on_state_change)
        finally:
            draining.pipe = None

    def sleep_until_the_pipe_is_readable(seconds: float) -> None:
        """Stands in for time.sleep in celery.concurrency.asynpool: its sleep after finding a
        pipe empty (_flush_outqueue) waits on that pipe instead; any other sleeps."""
        pipe = getattr(draining, "pipe", None)
        if pipe is None:
            time.sleep(seconds)
            return
        with contextlib.suppress(OSError):  # closed meanwhile: the next look drops it
            pipe.poll(seconds)

    # Replacing the methods is the point of this patch (see the docstring).
    asynpool.AsynPool.flush = flush_keeping_jobs_sent
    asynpool.AsynPool.join = join_and_say_so
    billiard_pool.Worker._do_exit = do_exit_at_once_when_stopping
    celery_prefork.time = TimerThreadClock
    asynpool.ResultHandler._flush_outqueue = flush_outqueue_watching_its_pipe
    asynpool.sleep = sleep_until_the_pipe_is_readable
