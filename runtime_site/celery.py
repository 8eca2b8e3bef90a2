from __future__ import annotations

import os
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
kombu_patches.install()  # before any worker consumes: broker losses must not kill it
prefork_patches.install()  # a stopping worker acknowledges what its pool ran


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


@worker_process_init.connect
def keep_database_connections(**_: Any) -> None:
    """Worker processes are long-lived and run one slice at a time: keep their database
    connection between slices instead of reconnecting for each (the web process, under
    ASGI, keeps CONN_MAX_AGE=0). Celery's Django fixup still drops unusable connections."""
    from django.db import connections

    for conn in connections.all(initialized_only=False):
        conn.settings_dict["CONN_MAX_AGE"] = 300


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
    the main process's signal handler: it only sets a flag.)"""
    if how == "Warm":
        shutdown.request()


@task_prerun.connect
def task_started(**_: Any) -> None:
    shutdown.task_started()


@task_postrun.connect
def task_finished(**_: Any) -> None:
    shutdown.task_finished()
