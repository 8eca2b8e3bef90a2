"""The emergency stop (issue 18): a `kill` aborts the running step without waiting for it.

Accepting a kill (steering_app.actions) ends a task that nobody is running at once. A
running task is ended in the same transaction too, and its lease epoch moves, so nothing
the step does can commit — unless the Kill Policy says the call in flight must finish
(`kill.finish_first`): then the worker stops the task right after that call returns.
Either way the worker holding the task is told, two ways, one fast and one sure:

- the doorbell: a Redis message after commit, heard by one listener thread per worker
  process (losing it costs latency, never correctness);
- the lease: the heartbeat's renewal and the renewal right before every external call
  (leases.confirm) refuse a killed task, so the worker learns at its next beat at the
  latest, and never starts another call.

Told, the worker cuts the step where it stands: the slice's thread gets StepKilled raised
by a signal, which also breaks a blocking socket read or sleep (the HTTP client then drops
the connection). Inside the runtime's own bookkeeping (a ledger write) and inside a call
that must finish, the step is shielded: StepKilled is raised the moment it leaves.
A step that does not come back (stuck in native code) is ended with its process, as a
step past its deadline is (leases.Heartbeat).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from types import FrameType
from typing import Any
from uuid import UUID

from django.conf import settings
from django.db import transaction

logger = logging.getLogger(__name__)

# SIGUSR1 is billiard's soft time limit in pool processes; SIGUSR2 is free (Celery's rdb
# uses it only when CELERY_RDBSIG is set). It is sent to one thread of our own process.
CUT_SIGNAL = signal.SIGUSR2


class StepKilled(BaseException):
    """Raised in the slice's thread: its task was killed. A BaseException, so that an agent's
    `except Exception` around a tool call cannot swallow it."""


def policy() -> dict[str, Any]:
    """The Kill Policy as the kill command's answer shows it."""
    kill = settings.RUNTIME["kill"]
    return {
        "cut": list(kill["cut"]),
        "finishFirst": list(kill["finish_first"]),
        "default": kill["default"],
        "graceSeconds": kill["grace_seconds"],
    }


def must_finish(tool: str) -> bool:
    kill = settings.RUNTIME["kill"]
    if tool in kill["finish_first"]:
        return True
    return tool not in kill["cut"] and kill["default"] == "finish_first"


# --- the doorbell ---------------------------------------------------------------------


def _channel() -> str:
    return f"{settings.RUNTIME_DEPLOYMENT}:kill"


def ring_on_commit(task_id: UUID) -> None:
    """After the kill commits: tell the worker holding the task (if the message is lost, its
    lease tells it at the next beat)."""
    if settings.REDIS_URL:
        transaction.on_commit(lambda: _ring(task_id))


def _ring(task_id: UUID) -> None:
    import redis

    try:
        with redis.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=2, socket_timeout=2) as client:
            client.publish(_channel(), str(task_id))
    except redis.RedisError as exc:
        logger.warning("task %s: kill doorbell not rung (%s); the worker learns at its next beat", task_id, exc)


_listening: dict[int, threading.Thread] = {}


def _listen_once_per_process() -> None:
    pid = os.getpid()
    if not settings.REDIS_URL or pid in _listening:
        return
    _listening.clear()  # a forked child: the parent's thread is not here
    _listening[pid] = threading.Thread(target=_listen, name="kill-doorbell", daemon=True)
    _listening[pid].start()


def _listen() -> None:
    """One thread per process for its whole life: a subscription on one Redis connection,
    re-made with a backoff after Redis goes away."""
    import redis

    backoff = 0.5
    while True:
        try:
            client = redis.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=5, health_check_interval=25)
            with client, client.pubsub(ignore_subscribe_messages=True) as pubsub:
                pubsub.subscribe(_channel())
                backoff = 0.5
                for message in pubsub.listen():
                    if guard := _by_task.get(message["data"].decode()):
                        guard.kill("doorbell")
        except Exception as exc:  # noqa: BLE001 (Redis away: the lease is the sure path meanwhile)
            logger.info("kill doorbell listener: %s; reconnecting in %.1fs", exc, backoff)
            time.sleep(backoff)
            # A few seconds at most: a kill rung while Redis was away waits for the heartbeat's
            # look at the row (its lease period), and one rung after it returns waits for this.
            backoff = min(backoff * 2, 5)


# --- cutting the step -----------------------------------------------------------------


class Guard:
    """What a slice's thread is doing, as far as a kill is concerned."""

    def __init__(self, task_id: UUID) -> None:
        self.task_id = task_id
        self.thread = threading.get_ident()
        self.killed_at: float | None = None
        self.stepping = False  # in the agent's step (leases.Heartbeat.watch)
        self.shield = 0  # >0: in the runtime's bookkeeping or a call that must finish

    @property
    def killed(self) -> bool:
        return self.killed_at is not None

    def kill(self, how: str) -> None:
        """From any thread: cut the step now if it may be cut, else when it may."""
        if self.killed_at is None:
            self.killed_at = time.monotonic()
            logger.warning("task %s: killed (%s); cutting its step", self.task_id, how)
        if self.stepping and not self.shield and self.thread == threading.main_thread().ident:
            signal.pthread_kill(self.thread, CUT_SIGNAL)  # Python runs the handler in that thread

    def raise_if_killed(self) -> None:
        if self.killed and self.stepping and not self.shield:
            raise StepKilled(f"task {self.task_id} was killed")

    def stuck(self, grace: float) -> bool:
        """Killed, cut, and still in the step (native code a signal cannot break) past the grace."""
        return (
            self.killed_at is not None
            and self.stepping
            and not self.shield
            and time.monotonic() - self.killed_at > grace
        )


_by_task: dict[str, Guard] = {}
_by_thread: dict[int, Guard] = {}


def _on_signal(signum: int, frame: FrameType | None) -> None:
    if guard := _by_thread.get(threading.get_ident()):
        guard.raise_if_killed()


@contextlib.contextmanager
def guarding(task_id: UUID) -> Iterator[Guard]:
    """Around a slice: its step can be killed. Signals reach only the main thread, where
    Celery runs tasks (prefork and solo pools); elsewhere the step is cut at its next
    call or ledger write instead."""
    guard = Guard(task_id)
    if guard.thread == threading.main_thread().ident and signal.getsignal(CUT_SIGNAL) is not _on_signal:
        signal.signal(CUT_SIGNAL, _on_signal)
    _listen_once_per_process()
    _by_task[str(task_id)], _by_thread[guard.thread] = guard, guard
    try:
        yield guard
    finally:
        _by_task.pop(str(task_id), None)
        _by_thread.pop(guard.thread, None)


def current() -> Guard | None:
    return _by_thread.get(threading.get_ident())


# Each of these saves and restores its guard's state rather than counting: a StepKilled
# raised by the signal between two statements of an inner `finally` then cannot leave the
# state off by one, because the outer one restores what it saved.


@contextlib.contextmanager
def step(guard: Guard) -> Iterator[None]:
    """Around the agent's step, and only it: the engine's own handling of what the step
    raised (a fenced write) must not be cut."""
    guard.stepping = True
    try:
        guard.raise_if_killed()
        yield
    finally:
        guard.stepping = False


@contextlib.contextmanager
def shielded() -> Iterator[None]:
    """The runtime's own work inside a step (a ledger row, a blob): not cut in the middle;
    a kill that came meanwhile is raised on the way out."""
    guard = current()
    if guard is None:
        yield
        return
    saved, guard.shield = guard.shield, guard.shield + 1
    try:
        yield
    finally:
        guard.shield = saved
    guard.raise_if_killed()


@contextlib.contextmanager
def calling(tool: str) -> Iterator[None]:
    """Around the remote call itself, inside the ledger's shield: a tool the Kill Policy lets
    be cut is exposed to the kill for the call's duration; one that must finish stays
    shielded, and the kill lands when the ledger has recorded its answer."""
    guard = current()
    if guard is None or must_finish(tool):
        yield
        return
    saved, guard.shield = guard.shield, 0
    try:
        guard.raise_if_killed()  # killed already: do not start it
        yield
    finally:
        guard.shield = saved
