"""Our patches to Celery's prefork pool (billiard), for a warm shutdown (SIGTERM) that gets
out of the way at once (issue 12 #8; install() says what and why).

Written against celery 5.7.0 and billiard 4.3.2: they replace library internals
(AsynPool.flush), so another release must be read against them before it is let in.
"""

from __future__ import annotations

import inspect
from importlib.metadata import version
from typing import Any

from celery.concurrency import asynpool as _asynpool

asynpool: Any = _asynpool  # internals the type stubs do not show

WRITTEN_FOR = {"celery": "5.7.0", "billiard": "4.3.2"}
if found := {name: version(name) for name in WRITTEN_FOR if version(name) != WRITTEN_FOR[name]}:
    raise RuntimeError(
        f"runtime_site/patches/prefork.py patches internals of {WRITTEN_FOR}, but {found} is installed: "
        "check each patch against its source, then update WRITTEN_FOR"
    )


def install() -> None:
    """A worker told to stop (SIGTERM) with a message in hand, its job already written to a
    pool process but the "accepted" reply not read yet when the signal came: AsynPool.flush
    dropped the job from the pool's books ("it will be redelivered by the broker"). The pool
    process runs it all the same; nothing then reads its result, so the pool process waits
    30 s for that (billiard's _ensure_messages_consumed) while the worker waits for the pool
    process: 31.5 s to stop (measured, bench/soak.py; its replacement, in deploys that stop
    a worker before starting the next, waited that long), and the message, never
    acknowledged, was given back at the end and ran a second time. Such jobs stay in the
    books now: the shutdown reads their results and acknowledges their messages."""
    flush = asynpool.AsynPool.flush

    def flush_keeping_jobs_sent(self: Any) -> None:
        sent = [job for job in self._cache.values() if not job._accepted and job._write_to is not None]
        flush(self)
        for job in sent:
            writer = asynpool._get_job_writer(job)
            if writer is None or inspect.getgeneratorstate(writer) == inspect.GEN_CLOSED:  # all of it written
                self._cache.setdefault(job._job, job)

    # Replacing the method is the point of this patch (see the docstring).
    asynpool.AsynPool.flush = flush_keeping_jobs_sent
