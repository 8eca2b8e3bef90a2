"""Stopping workers (deploys, autoscaling) hand their tasks over at the next safe point.

Celery's warm shutdown (SIGTERM) waits for running tasks: a slice would run out its budget
(runtime.slice_seconds) first, and a killed pool process would leave its task to wait for
the lease to expire. Instead the engine yields at its next safe point (it finishes the step
in hand, checkpoints, releases the lease and enqueues the successor), so a running worker
takes the task over at once (issue 12 #8).

The request reaches a slice two ways:
- the worker's main process gets SIGTERM (docker stop, Kubernetes): Celery sends
  worker_shutting_down there, which sets a flag in memory the pool processes share (mapped
  before they fork; runtime_site/celery.py);
- a pool process gets SIGTERM itself (systemd's default, a signal to the process group, or
  the pool terminating its processes): during a task it asks the slice to yield and ends
  after the task (its successor enqueued), unless its worker is stopping warmly (its pool
  then closes it); outside a task, or at a second SIGTERM, it ends at once, as it always did.
"""

from __future__ import annotations

import mmap
import os
import signal
from types import FrameType
from typing import Any

_warm = mmap.mmap(-1, 1)  # anonymous and shared: written by the main process, read by its pool
_deferring = False  # a pool process: its own SIGTERM waits for the task in hand
_in_task = False
_signalled = False  # this pool process got SIGTERM during a task
_previous: Any = signal.SIG_DFL  # the pool's own SIGTERM handler, for what is not deferred


def request() -> None:
    """The worker's main process is stopping warmly: every slice yields at its next safe point."""
    _warm[0] = 1


def requested() -> bool:
    return bool(_warm[0]) or _signalled


def stopping_warmly() -> bool:
    """The worker (its main process) is in a warm shutdown: its pool closes when the slices
    have handed over."""
    return bool(_warm[0])


def defer_sigterm() -> None:
    """In a pool process: a SIGTERM during a task asks its slice to yield instead of
    killing it mid-step."""
    global _deferring
    _deferring = True


def task_started() -> None:
    global _in_task, _previous
    _in_task = True
    if _deferring:  # per task: the pool installs its own handler after the process starts
        _previous = signal.signal(signal.SIGTERM, _on_sigterm)


def task_finished() -> None:
    """After a task (a slice and its successor's enqueue). A process whose SIGTERM was
    deferred ends now, unless its worker stops warmly (its pool closes it then): a pool
    terminating its processes waits for them to end."""
    global _in_task
    _in_task = False
    if _deferring:
        signal.signal(signal.SIGTERM, _previous)
        if _signalled and not _warm[0]:
            os.kill(os.getpid(), signal.SIGTERM)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    global _signalled
    if _in_task and not _signalled:
        _signalled = True
        return
    signal.signal(signal.SIGTERM, _previous)  # a second SIGTERM: what it always did
    if callable(_previous):
        _previous(signum, frame)
    else:
        os.kill(os.getpid(), signum)
