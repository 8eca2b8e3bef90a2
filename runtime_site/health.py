"""/healthz and /readyz: is the process up, and can it do its work?

/healthz answers from the process alone (no database, no broker): a failing one means
restart the process. /readyz checks what the web process needs to serve the API —
the database reachable, every migration on disk applied, the broker reachable — and
answers 503 naming what is missing: don't route traffic here (yet), the process is fine.
"""

from __future__ import annotations

import time
from functools import cache
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import connections
from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_safe

TIMEOUT = 3  # seconds per check: a probe must answer before the orchestrator gives up on it


def read_only(view: Any) -> Any:
    """A probe answers GET and HEAD; anything else is a 405 (not CSRF's 403, logged as an
    attack, nor an OPTIONS that runs the whole check)."""
    return csrf_exempt(require_safe(view))


@read_only
def healthz(request: HttpRequest) -> JsonResponse:
    return JsonResponse({"ok": True})


@read_only
def readyz(request: HttpRequest) -> JsonResponse:
    checks: dict[str, Any] = {}
    try:
        applied = _applied_migrations()
        checks["database"] = "ok"
    except Exception as exc:  # noqa: BLE001 (a probe: any failure is "unreachable", with its reason)
        applied = None
        checks["database"] = f"unreachable: {_brief(exc)}"
    if applied is not None:
        pending = sorted(f"{app}.{name}" for app, name in _migrations_on_disk() - applied)
        checks["migrations"] = "ok" if not pending else f"{len(pending)} not applied: {', '.join(pending[:5])}"
    else:
        checks["migrations"] = "unknown: the database is unreachable"
    try:
        _ping_broker()
        checks["broker"] = "ok"
    except Exception as exc:  # noqa: BLE001 (a probe: any failure is "unreachable", with its reason)
        checks["broker"] = f"unreachable: {_brief(exc)}"
    ok = all(value == "ok" for value in checks.values())
    return JsonResponse({"ok": ok, "checks": checks}, status=200 if ok else 503)


def _brief(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:300]


def _applied_migrations() -> set[tuple[str, str]]:
    """(app, name) of applied migrations. On PostgreSQL through a connection of its own with
    a short connect timeout: the web process's pool would wait up to its own timeout (30 s)
    for a database that is down, far longer than a probe may take."""
    db = settings.DATABASES["default"]
    query = "SELECT app, name FROM django_migrations"
    if db["ENGINE"] != "django.db.backends.postgresql":
        with connections["default"].cursor() as cursor:  # the embedded SQLite file
            cursor.execute(query)
            return set(cursor.fetchall())
    import psycopg

    params: dict[str, Any] = {
        "dbname": db["NAME"],
        "user": db["USER"],
        "password": db["PASSWORD"] or None,
        "host": db["HOST"] or None,
        "port": db["PORT"] or None,
    }
    with psycopg.connect(
        **{k: v for k, v in params.items() if v},
        connect_timeout=TIMEOUT,
        options=f"-c statement_timeout={TIMEOUT * 1000}",
    ) as conn:
        try:
            return set(conn.execute(query).fetchall())
        except psycopg.errors.UndefinedTable:
            return set()  # a database that has never been migrated


@cache
def _migrations_on_disk() -> frozenset[tuple[str, str]]:
    """Read once per process: the code, and so its migrations, cannot change under it."""
    from django.db.migrations.loader import MigrationLoader

    loader = MigrationLoader(None, ignore_no_migrations=True)
    return frozenset(loader.graph.leaf_nodes())  # the newest of each app; the rest come before them


def _ping_broker() -> None:
    url = settings.CELERY_BROKER_URL
    if url.startswith("filesystem://"):  # the embedded profile: the queue is a folder
        folder = Path(settings.CELERY_BROKER_TRANSPORT_OPTIONS["data_folder_in"])
        probe = folder.parent / f".readyz-{time.monotonic_ns()}"
        probe.write_text("")  # writable, not just present
        probe.unlink()
        return
    import redis

    with redis.Redis.from_url(url, socket_connect_timeout=TIMEOUT, socket_timeout=TIMEOUT) as client:
        client.ping()
