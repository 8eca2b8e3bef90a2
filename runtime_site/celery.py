from __future__ import annotations

import os
import threading
from typing import Any

from celery import Celery
from celery.signals import (
    task_postrun,
    task_prerun,
    worker_init,
    worker_process_init,
    worker_process_shutdown,
    worker_ready,
    worker_shutting_down,
)
from kombu.asynchronous import get_event_loop

from runtime_site.patches import consumer as consumer_patches
from runtime_site.patches import kombu as kombu_patches
from runtime_site.patches import prefork as prefork_patches
from tasks_app import shutdown  # here, so its flag is mapped before a worker's pool forks

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "runtime_site.settings")


def _count_in_multiprocess_mode() -> None:
    """A worker with RUNTIME_METRICS_PORT counts its metrics in prometheus-client's
    multiprocess mode (runtime_site/metrics.py says why), in a fresh folder of its own
    unless PROMETHEUS_MULTIPROC_DIR names one. Here, because prometheus-client reads the
    variable once, when first imported, and nothing has imported it yet."""
    if os.getenv("RUNTIME_METRICS_PORT") and not os.getenv("PROMETHEUS_MULTIPROC_DIR"):
        import atexit
        import shutil
        import tempfile

        owner = os.getpid()
        _remove_folders_of_dead_workers(tempfile.gettempdir())
        folder = tempfile.mkdtemp(prefix=f"runtime-metrics-{owner}-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = folder
        atexit.register(lambda: os.getpid() == owner and shutil.rmtree(folder, ignore_errors=True))


def _remove_folders_of_dead_workers(tmp: str) -> None:
    """A worker killed with SIGKILL never ran its atexit: its folder (named for its pid) stays.
    The next worker on the host removes those whose worker is gone (a reused pid keeps its
    folder: harmless, and never a live worker's counts)."""
    import re
    import shutil
    from pathlib import Path

    for folder in Path(tmp).glob("runtime-metrics-*-*"):
        if not (found := re.fullmatch(r"runtime-metrics-(\d+)-.+", folder.name)):
            continue
        try:
            os.kill(int(found[1]), 0)
        except ProcessLookupError:
            shutil.rmtree(folder, ignore_errors=True)
        except (PermissionError, OverflowError):  # another user's live process; a pid beyond C's range
            continue


_count_in_multiprocess_mode()

app = Celery("runtime_site")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
kombu_patches.install()  # before any worker consumes: broker losses and unreadable messages must not kill it
consumer_patches.install()  # a message Celery cannot run is set aside, not lost and not fatal
prefork_patches.install(stopping_warmly=shutdown.stopping_warmly)  # a stopping worker is gone at once


@worker_ready.connect
def serve_metrics(**_: Any) -> None:
    if os.getenv("RUNTIME_METRICS_PORT"):
        from runtime_site.metrics import serve_worker_metrics

        serve_worker_metrics()


@worker_process_init.connect
def trace_pool_process(**_: Any) -> None:
    """Each pool process exports its own spans (an exporter thread does not survive the fork)."""
    from runtime_site import tracing

    tracing.configure("runtime-worker")


@worker_process_shutdown.connect
def flush_spans(**_: Any) -> None:
    """A pool process ends with os._exit, which runs no atexit hook: it flushes here (bounded)."""
    from runtime_site import tracing

    tracing.shutdown()


@worker_init.connect
def warm_tool_clients(**_: Any) -> None:
    """In the worker's main process, before the pool forks: every pool process then starts
    with the remote MCP client loaded instead of loading it inside a leased slice."""
    from ledger_app import mcp_client

    mcp_client.warm()


@worker_init.connect
def bound_database_round_trips(**_: Any) -> None:
    """In the worker's main process, before the pool forks (and where a solo pool runs its
    tasks): every database connection made from now on waits for each answer at most
    RUNTIME_DB_WORKER_QUERY_SECONDS. A frozen database held a slice and its heartbeat for as
    long as it was frozen; past the deadline the slice is abandoned as an infrastructure
    fault and tried again after a backoff (runtime_site/dbpool.py says why this long). Beat
    needs none: it keeps its schedule in a file and opens no database connection."""
    from runtime_site import dbpool

    dbpool.own_connection_class = dbpool.WorkerConnection


@worker_init.connect
def freeze_the_loaded_heap(**_: Any) -> None:
    """Last before the pool forks: what the worker has loaded (Django, the apps, the tool
    clients) lives as long as the process, so the garbage collector stops walking it
    (gc.freeze, as the gc docs advise before a fork). Pool processes then share those pages
    instead of copying them when a collection touches them, their collections stay short
    (the GIL a lease's heartbeat needs), and a stopping worker skips the collection at its
    exit, which took 2 s of a stop before its replacement could start (measured)."""
    import gc

    gc.collect()
    gc.freeze()


@worker_process_init.connect
def keep_database_connections(**_: Any) -> None:
    """Worker processes are long-lived and run one slice at a time: keep their database
    connection between slices instead of reconnecting for each (the web process, under
    ASGI, keeps CONN_MAX_AGE=0). Celery's Django fixup would close it around every task
    whatever CONN_MAX_AGE says (celery/fixups/django.py, close_database): settings.py sets
    CELERY_DB_REUSE_MAX, and check_database_connections drops only the unusable ones."""
    from django.db import connections

    for conn in connections.all(initialized_only=False):
        conn.settings_dict["CONN_MAX_AGE"] = 300


@task_prerun.connect
def check_database_connections(**_: Any) -> None:
    """Before each task, what Django does before each request (close_old_connections): drop
    a connection that had an error and no longer works, or is past CONN_MAX_AGE. Its health
    check (CONN_HEALTH_CHECKS) is a round trip at the task's first query; it is paid only
    when the socket has something to read, since an idle connection hears from the server
    only when it is ended (a restart, pg_terminate_backend: runtime_site/dbpool.py)."""
    from django.db import connections

    from runtime_site.dbpool import readable

    for conn in connections.all(initialized_only=True):
        conn.close_if_unusable_or_obsolete()
        if conn.connection is not None and conn.vendor == "postgresql" and not readable(conn.connection):
            conn.health_check_done = True  # type: ignore[attr-defined]  # Django's flag, not in django-stubs


@worker_process_init.connect
def pool_process_init(**_: Any) -> None:
    """In a pool process (not in a solo pool, which runs tasks in the worker itself):
    - stuck in a step past its deadline, it ends itself, and its pool starts a fresh one
      (tasks_app.leases.Heartbeat); nothing would restart a solo worker, so there the
      stuck step is only abandoned;
    - a SIGTERM of its own during a slice makes the slice yield first (tasks_app.shutdown)."""
    from billiard.process import current_process

    from tasks_app import leases

    if current_process().name != "MainProcess":
        leases.recycle_stuck_processes = True
        shutdown.defer_sigterm()


@worker_shutting_down.connect
def hand_over_running_tasks(how: str, **_: Any) -> None:
    """Warm shutdown (SIGTERM): running slices yield at their next safe point instead of
    running out their budget, so other workers take their tasks over at once. (Called in
    the main process's signal handler: it only sets flags.)

    Celery stops consuming when its event loop next looks at its own flag, set right after
    this; the loop sleeps in poll() up to a second, and a message it receives meanwhile is
    held until the worker has stopped. Ringing the loop's waker (from a thread: a wake from
    the loop's own thread is skipped) makes it look now."""
    if how == "Warm":
        shutdown.request()
        if hub := get_event_loop():
            threading.Thread(target=hub.call_soon, args=(_nothing,), daemon=True).start()


def _nothing() -> None:
    pass


@task_prerun.connect
def task_started(**_: Any) -> None:
    shutdown.task_started()


@task_postrun.connect
def task_finished(**_: Any) -> None:
    shutdown.task_finished()
