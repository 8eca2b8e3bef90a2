"""Prometheus metrics (docs/operations.md lists them, deploy/prometheus/alerts.yml alerts on them).

Two kinds, served from two places:

* What the database and the broker know — tasks by status, dead letters, tasks stuck
  recovering, tasks waiting for input and for how long, ledger entries unknown or
  pending, queue depth and oldest message age per priority — is read when the web
  process's GET /metrics is scraped. The database is the truth; counting it at scrape
  time cannot drift, and restarts lose nothing. The same numbers come from every web
  replica: aggregate them with max(), not sum().
* What happens inside workers — step durations, slice start latency, slices by outcome,
  lease takeovers, recoveries, tool calls — is counted where it happens. Celery's prefork
  pool runs slices in child processes, so workers count in prometheus-client's
  multiprocess mode: each child writes to files in PROMETHEUS_MULTIPROC_DIR and the
  worker's main process serves their sum on its own port (RUNTIME_METRICS_PORT, set
  on workers only). Its own port rather than the web's /metrics, because workers run in
  other containers (other PID namespaces, other files) than the web process, and each
  replica must be scraped on its own to keep its counters monotonic.

The web process (one uvicorn process per container) adds its own: open SSE streams and
its database pool.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

logger = logging.getLogger(__name__)

# --- counted in workers (registry=None: served by the worker's multiprocess collector only) -----
STEP_SECONDS = Histogram(
    "runtime_step_duration_seconds",
    "Time an agent's step took, by agent and outcome (ok, waiting, error).",
    ["agent", "outcome"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
    registry=None,
)
SLICE_START_LATENCY = Histogram(
    "runtime_slice_start_latency_seconds",
    "From the moment a slice's message was due (sent, plus its countdown) until a worker started it.",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900),
    registry=None,
)
SLICES = Counter(
    "runtime_slices_total",
    "Slices run, by outcome (continue, poll, done, dropped, at_capacity).",
    ["outcome"],
    registry=None,
)
LEASE_TAKEOVERS = Counter(
    "runtime_lease_takeovers_total",
    "Slices that found their lease taken over (the reaper or an operator moved it) and stopped without writing.",
    registry=None,
)
RECOVERIES = Counter(
    "runtime_recoveries_total",
    "Expired leases the reaper took back from a lost worker, by outcome (recovering, dead_lettered).",
    ["outcome"],
    registry=None,
)
TOOL_CALLS = Counter(
    "runtime_tool_calls_total",
    "Tool call attempts, by tool and outcome (ok, error).",
    ["tool", "outcome"],
    registry=None,
)

# The header a slice message carries: when it is due (time.time() plus its countdown).
READY_AT_HEADER = "rt_ready_at"


def observe_slice_start(ready_at: Any) -> None:
    if isinstance(ready_at, int | float):
        SLICE_START_LATENCY.observe(max(0.0, time.time() - ready_at))


# --- read at scrape time (web process) -------------------------------------------------------


def _gauge(name: str, documentation: str, labels: list[str] | None = None) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, labels=labels)


def _database() -> Iterator[Metric]:
    from django.db.models import Count, Min, OuterRef, Subquery
    from django.db.models.functions import Coalesce
    from django.utils import timezone

    from ledger_app.models import EffectStatus, LedgerEntry
    from steering_app.models import InputRequest, InputStatus
    from tasks_app.models import AuditRecord, Task
    from tasks_app.states import Status

    now = timezone.now()

    def age(oldest: Any) -> float:
        return max(0.0, (now - oldest).total_seconds()) if oldest else 0.0

    counts = dict(Task.objects.order_by().values_list("status").annotate(n=Count("id")))
    tasks = _gauge("runtime_tasks", "Tasks by internal status.", ["status"])
    for status in Status:
        tasks.add_metric([status.value], counts.get(status.value, 0))
    yield tasks
    yield GaugeMetricFamily(
        "runtime_dead_letters", "Tasks held for an operator (dead_lettered).", value=counts.get(Status.DEAD_LETTERED, 0)
    )
    # Since it became recovering (its audit trail says when), not its updated_at: the lease
    # scanner touches a runnable task each time it re-enqueues it, so that age never grows.
    # (updated_at only for a row set to recovering by hand, without a trail.)
    became_recovering = (
        AuditRecord.objects.filter(task=OuterRef("pk"), to_status=Status.RECOVERING)
        .order_by("-seq")
        .values("created_at")[:1]
    )
    recovering = (
        Task.objects.filter(status=Status.RECOVERING)
        .annotate(since=Coalesce(Subquery(became_recovering), "updated_at"))
        .aggregate(oldest=Min("since"))["oldest"]
    )
    yield GaugeMetricFamily(
        "runtime_tasks_recovering_oldest_age_seconds",
        "How long the task recovering the longest has waited for a worker.",
        value=age(recovering),
    )
    yield GaugeMetricFamily(
        "runtime_tasks_waiting_for_input",
        "Tasks waiting for a person (input_required).",
        value=counts.get(Status.INPUT_REQUIRED, 0),
    )
    waiting = InputRequest.objects.filter(status=InputStatus.OPEN, task__status=Status.INPUT_REQUIRED).aggregate(
        oldest=Min("created_at")
    )["oldest"]
    yield GaugeMetricFamily(
        "runtime_tasks_waiting_for_input_oldest_age_seconds",
        "Age of the oldest open question or approval of a task waiting for input.",
        value=age(waiting),
    )
    effects = dict(
        LedgerEntry.objects.filter(status__in=[EffectStatus.UNKNOWN, EffectStatus.PENDING])
        .order_by()
        .values_list("status")
        .annotate(n=Count("id"))
    )
    ledger = _gauge(
        "runtime_ledger_entries",
        "Side effects not settled: unknown (may or may not have happened) and pending (a remote task is being polled).",
        ["status"],
    )
    for effect in (EffectStatus.UNKNOWN, EffectStatus.PENDING):
        ledger.add_metric([effect.value], effects.get(effect.value, 0))
    yield ledger


def _broker() -> Iterator[Metric]:
    """Depth and oldest message age of each queue, per priority step. Messages scheduled with
    a countdown sit with a worker, not in the queue, and are not counted."""
    from django.conf import settings

    depth = _gauge(
        "runtime_queue_depth", "Messages waiting in a queue, by queue and priority step.", ["queue", "priority"]
    )
    oldest = _gauge(
        "runtime_queue_oldest_message_age_seconds",
        "How long the oldest message of a queue and priority step has been due.",
        ["queue", "priority"],
    )
    queues = ("steps", "maintenance")
    options = settings.CELERY_BROKER_TRANSPORT_OPTIONS
    now = time.time()
    if settings.CELERY_BROKER_URL.startswith("filesystem://"):  # embedded: one file per message, no priorities
        files = sorted(Path(options["data_folder_in"]).glob("*.msg"))
        for queue in queues:
            mine = [f for f in files if f.name.endswith(f".{queue}.msg")]
            depth.add_metric([queue, "all"], len(mine))
            oldest.add_metric([queue, "all"], _age(_ready_at(mine[0].read_bytes()), now) if mine else 0.0)
    else:
        import redis

        prefix = options.get("global_keyprefix", "")
        steps = options.get("priority_steps", [0])
        with redis.Redis.from_url(settings.CELERY_BROKER_URL, socket_connect_timeout=3, socket_timeout=3) as client:
            pipe = client.pipeline(transaction=False)
            keys = [
                (queue, step, f"{prefix}{queue}" + (f"\x06\x16{step}" if step else ""))
                for queue in queues
                for step in steps
            ]
            for _, _, key in keys:
                pipe.llen(key)
                pipe.lindex(key, -1)  # kombu pushes on the left and pops on the right: the oldest
            answers = pipe.execute()
        for i, (queue, step, _) in enumerate(keys):
            length, tail = answers[2 * i], answers[2 * i + 1]
            depth.add_metric([queue, str(step)], length)
            oldest.add_metric([queue, str(step)], _age(_ready_at(tail), now) if tail else 0.0)
    yield depth
    yield oldest


def _ready_at(raw: bytes) -> float | None:
    try:
        value = json.loads(raw)["headers"].get(READY_AT_HEADER)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    return value if isinstance(value, int | float) else None


def _age(ready_at: float | None, now: float) -> float:
    return max(0.0, now - ready_at) if ready_at else 0.0


def _web_process() -> Iterator[Metric]:
    from django.db import connections

    from tasks_app.streams.hub import open_streams

    yield GaugeMetricFamily("runtime_sse_open_streams", "SSE streams open on this web process.", value=open_streams())
    pool = getattr(connections["default"], "pool", None)
    if pool is not None:
        stats = pool.get_stats()
        used = _gauge("runtime_db_pool_connections", "This web process's database pool, by state.", ["state"])
        used.add_metric(["in_use"], stats["pool_size"] - stats["pool_available"])
        used.add_metric(["idle"], stats["pool_available"])
        yield used
        yield GaugeMetricFamily("runtime_db_pool_max", "The pool's largest size.", value=stats["pool_max"])
        yield GaugeMetricFamily(
            "runtime_db_pool_requests_waiting",
            "Requests waiting for a pooled connection.",
            value=stats.get("requests_waiting", 0),
        )


class _Scrape:
    """What the web process's /metrics shows. A source that fails (database or broker down)
    is reported as runtime_scrape_error{source} = 1, and the rest is still served."""

    def collect(self) -> Iterator[Metric]:
        yield from REGISTRY.collect()
        errors = _gauge("runtime_scrape_error", "1 when a source could not be read for this scrape.", ["source"])
        for source, read in (("database", _database), ("broker", _broker), ("web", _web_process)):
            try:
                metrics = list(read())
            except Exception as exc:  # noqa: BLE001 (one source failing is reported; the rest is still served)
                logger.warning("metrics: could not read the %s: %s", source, exc)
                errors.add_metric([source], 1)
                continue
            errors.add_metric([source], 0)
            yield from metrics
        yield errors


def metrics_view(request: Any) -> Any:
    """Served GET and HEAD only (health.read_only, in urls.py), to scrapers only (health.scrapers_only):
    a scrape reads the database and the broker."""
    from django.http import HttpResponse

    return HttpResponse(generate_latest(_Scrape()), content_type=CONTENT_TYPE_LATEST)


# --- the worker's own port ---------------------------------------------------------------


def serve_worker_metrics() -> None:
    """In the worker's main process: the sum over its pool processes, on RUNTIME_METRICS_PORT."""
    from prometheus_client import multiprocess, start_http_server

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    port = int(os.environ["RUNTIME_METRICS_PORT"])
    start_http_server(port, addr=os.getenv("RUNTIME_METRICS_ADDR", "0.0.0.0"), registry=registry)  # noqa: S104
    logger.info("worker metrics on :%s/metrics", port)
